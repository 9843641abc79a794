"""OTLP trace load: realistic GenAI spans and the processes that send them.

The workload of `benchmarks/ingest.py` and of its peer, `benchmarks/peer_phoenix.py`,
kept apart from both so that each measures the same load and neither imports the
other.

1. `build_templates`: GenAI `chat` spans (1-10 KB each, message content included)
   as a few OTLP `ExportTraceServiceRequest` templates, serialized once. Every send
   gets fresh random trace and span ids, written straight into the serialized bytes
   at offsets found once at build time (no protobuf work in the senders, and no id
   is ever sent twice, so deduplication hides no work).
2. `SenderPool`: K sender processes (`sender_main`: HTTP keep-alive POSTs or
   raw-bytes gRPC `Export` calls, one request in flight each), closed loop or at a
   set rate, each reporting what was acknowledged, refused and how fast. A refused
   request is resent after the delay the collector asked for (HTTP `Retry-After`,
   gRPC `RetryInfo`), as OTLP exporters do (the spec's "Failures" section), not
   after a fixed pause: a fixed 0.1 s made four senders knock ten times a second
   each on a collector that had asked for a second's rest.
"""

from __future__ import annotations

import argparse
import array
import email.utils
import http.client
import json
import multiprocessing as mp
import os
import random
import re
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

# NB: grpc is imported only in the sender processes: it starts threads, and the
# senders may be forked.

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTOBUF = "application/x-protobuf"
MB = 1 << 20


def add_load_flags(ap: argparse.ArgumentParser) -> None:
    """The load's flags, the same for Nightshift and its peer: the peer is measured
    under the load Nightshift was."""
    ap.add_argument("--seconds", type=float, default=10.0, help="full-load phase duration (default 10)")
    ap.add_argument("--senders", type=int, default=4, help="concurrent sender processes, one request in flight each (default 4)")
    ap.add_argument("--spans-per-request", type=int, default=512, help="spans per export request (default 512)")
    ap.add_argument("--templates", type=int, default=8, help="distinct request templates (content); ids are new on every send")


# --------------------------------------------------------------------------------------
# Workload: GenAI spans, serialized once, ids rewritten in place per send
# --------------------------------------------------------------------------------------

WORDS = (
    "the a an and or but if then else when while for with without about into over under between "
    "customer order invoice refund shipment account balance payment subscription plan renewal "
    "please summarize explain compare list extract classify translate rewrite draft review check "
    "quarterly revenue forecast variance region product team meeting notes action items owner "
    "deadline priority status blocked pending resolved escalated ticket incident outage latency "
    "database query index table column schema migration rollback deploy release version build "
    "function class method argument return value error exception retry timeout cache memory "
    "user assistant system tool result context window token budget answer question reason step "
    "first second third finally however therefore because since although unless until before after "
    "report chart graph trend increase decrease percent total average median maximum minimum "
    "europe asia america africa office warehouse store online channel partner vendor supplier "
    "contract clause term renewal notice liability warranty compliance policy audit security "
    "is are was were be been has have had do does did can could should would will may might must "
    "this that these those it its they their we our you your he she his her them us "
    "json field name amount currency date email phone address city country code total items"
).split()

SYSTEM_PROMPTS = (
    "You are a helpful customer support agent for an online store. Answer briefly and cite the order number.",
    "You are a senior data analyst. Use the tools to query the warehouse and explain results in plain words.",
    "You are a coding assistant. Prefer small, tested changes and explain the reasoning step by step.",
    "You are an operations agent. Triage incidents, propose next actions and keep a concise timeline.",
)

MODELS = (
    ("openai", "gpt-4o", "gpt-4o-2024-08-06", "api.openai.com"),
    ("openai", "gpt-4o-mini", "gpt-4o-mini-2024-07-18", "api.openai.com"),
    ("anthropic", "claude-sonnet-4-20250514", "claude-sonnet-4-20250514", "api.anthropic.com"),
    ("gcp.gemini", "gemini-2.0-flash", "gemini-2.0-flash-001", "generativelanguage.googleapis.com"),
)

SERVICES = ("support-agent", "analytics-agent", "code-agent", "ops-agent")
TOOLS = ("search_orders", "get_customer", "run_sql", "create_ticket", "read_file", "send_email")

# Placeholder ids: a 4-byte marker that cannot occur in UTF-8 text (0xFE, 0xFF)
# followed by the index of the id within its request. Found once in the serialized
# bytes, then overwritten with random bytes for every send.
TRACE_MARK = b"\xfe\xff\xfe\xf6"
SPAN_MARK = b"\xfe\xff\xfe\xf7"
MARK_RE = re.compile(rb"\xfe\xff\xfe[\xf6\xf7]")


def _kv(key: str, value) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    if isinstance(value, (list, tuple)):
        return KeyValue(key=key, value=AnyValue(array_value=ArrayValue(values=[AnyValue(string_value=v) for v in value])))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _text(rng: random.Random, nbytes: int) -> str:
    if nbytes <= 0:
        return ""
    words = rng.choices(WORDS, k=max(1, nbytes // 5))
    out = []
    size = 0
    for i, w in enumerate(words):
        if i and i % 17 == 0:
            w = w + "."
        out.append(w)
        size += len(w) + 1
        if size >= nbytes:
            break
    return " ".join(out)[:nbytes]


def _secret(rng: random.Random) -> str:
    alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "sk-proj-" + "".join(rng.choices(alnum, k=32))


def _span(rng: random.Random, trace_id: bytes, span_id: bytes, parent: bytes, target: int, now_ns: int,
          secret_fraction: float) -> Span:
    provider, model, resp_model, server = rng.choice(MODELS)
    budget = max(200, target - 900)  # ~900 bytes of attributes besides the message content
    sys_n = min(len(SYSTEM_PROMPTS[0]) + 200, budget // 6)
    user_n = int(budget * rng.uniform(0.25, 0.45))
    out_n = max(40, budget - sys_n - user_n)
    system = rng.choice(SYSTEM_PROMPTS)[:sys_n] if sys_n < 120 else rng.choice(SYSTEM_PROMPTS) + " " + _text(rng, sys_n - 110)
    user = _text(rng, user_n)
    if secret_fraction and rng.random() < secret_fraction:
        user += " my key is " + _secret(rng)
    inputs = [
        {"role": "system", "parts": [{"type": "text", "content": system}]},
        {"role": "user", "parts": [{"type": "text", "content": user}]},
    ]
    if rng.random() < 0.25:
        tool = rng.choice(TOOLS)
        call_id = f"call_{rng.getrandbits(64):016x}"
        outputs = [{
            "role": "assistant",
            "parts": [
                {"type": "text", "content": _text(rng, out_n // 3)},
                {"type": "tool_call", "id": call_id, "name": tool,
                 "arguments": {"query": _text(rng, out_n - out_n // 3 - 60), "limit": rng.randint(1, 50)}},
            ],
            "finish_reason": "tool_call",
        }]
        finish = "tool_call"
    else:
        outputs = [{"role": "assistant", "parts": [{"type": "text", "content": _text(rng, out_n)}], "finish_reason": "stop"}]
        finish = "stop"
    in_json = json.dumps(inputs, ensure_ascii=False)
    out_json = json.dumps(outputs, ensure_ascii=False)
    duration = int(rng.uniform(0.3, 12.0) * 1e9)
    start = now_ns - rng.randint(1, 60) * 1_000_000_000 - duration
    attrs = [
        _kv("gen_ai.operation.name", "chat"),
        _kv("gen_ai.provider.name", provider),
        _kv("gen_ai.request.model", model),
        _kv("gen_ai.response.model", resp_model),
        _kv("gen_ai.request.temperature", round(rng.uniform(0.0, 1.0), 2)),
        _kv("gen_ai.request.max_tokens", rng.choice((512, 1024, 2048, 4096))),
        _kv("gen_ai.response.id", f"chatcmpl-{rng.getrandbits(96):024x}"),
        _kv("gen_ai.response.finish_reasons", [finish]),
        _kv("gen_ai.usage.input_tokens", len(in_json) // 4),
        _kv("gen_ai.usage.output_tokens", len(out_json) // 4),
        _kv("gen_ai.conversation.id", f"conv_{rng.getrandbits(64):016x}"),
        _kv("server.address", server),
        _kv("server.port", 443),
        _kv("gen_ai.input.messages", in_json),
        _kv("gen_ai.output.messages", out_json),
    ]
    span = Span(
        trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=f"chat {model}",
        kind=Span.SPAN_KIND_CLIENT, start_time_unix_nano=start, end_time_unix_nano=start + duration,
        attributes=attrs,
    )
    if rng.random() < 0.02:
        span.status.CopyFrom(Status(code=Status.STATUS_CODE_ERROR, message="rate limit exceeded (429), retried"))
        ev = span.events.add()
        ev.time_unix_nano = start + duration // 2
        ev.name = "exception"
        ev.attributes.extend([_kv("exception.type", "RateLimitError"), _kv("exception.message", "429 Too Many Requests")])
    return span


@dataclass
class Template:
    """One serialized request and where its ids are."""

    data: bytes
    spans: int
    rnd_len: int  # random bytes needed per send
    patches: list  # (start, end, src_start, src_end)
    span_sizes: list

    def fresh(self, buf: bytearray) -> bytes:
        """The request with new random ids (buf: this template's bytes, reused)."""
        rnd = os.urandom(self.rnd_len)
        for s, e, rs, re_ in self.patches:
            buf[s:e] = rnd[rs:re_]
        return bytes(buf)


#: Span sizes (bytes) drawn uniformly when no size is asked for: GenAI calls from
#: a short answer to a long conversation.
SPAN_BYTES = (1000, 10000)


def span_range(kb: float | None) -> tuple[int, int]:
    """The span sizes of a run: about `kb` KB each (within 20 %), or `SPAN_BYTES`."""
    if not kb:
        return SPAN_BYTES
    return int(kb * 800), int(kb * 1200)


def build_template(seed: int, n_spans: int, secret_fraction: float, span_bytes: tuple[int, int] = SPAN_BYTES) -> Template:
    rng = random.Random(seed)
    now_ns = time.time_ns()
    provider_service = SERVICES[seed % len(SERVICES)]
    resource = Resource(attributes=[
        _kv("service.name", provider_service),
        _kv("service.version", f"1.{seed % 7}.{seed % 13}"),
        _kv("deployment.environment.name", "production"),
        _kv("host.name", f"agent-{seed % 5}.prod.internal"),
        _kv("process.pid", 1000 + seed),
        _kv("telemetry.sdk.name", "opentelemetry"),
        _kv("telemetry.sdk.language", "python"),
        _kv("telemetry.sdk.version", "1.38.0"),
    ])
    scope = InstrumentationScope(name="opentelemetry.instrumentation.openai_v2", version="2.1b0")
    spans = []
    n_traces = 0
    while len(spans) < n_spans:
        trace_len = min(rng.randint(1, 8), n_spans - len(spans))  # an agent run: a few chat calls
        tid = TRACE_MARK + struct.pack(">I", n_traces) + b"\x01" * 8
        root = None
        for _ in range(trace_len):
            sid = SPAN_MARK + struct.pack(">I", len(spans))
            spans.append(_span(rng, tid, sid, root or b"", int(rng.uniform(*span_bytes)), now_ns, secret_fraction))
            root = root or sid
        n_traces += 1
    req = ExportTraceServiceRequest(resource_spans=[ResourceSpans(resource=resource, scope_spans=[ScopeSpans(scope=scope, spans=spans)])])
    data = req.SerializeToString()
    patches = []
    for m in MARK_RE.finditer(data):
        pos = m.start()
        (idx,) = struct.unpack_from(">I", data, pos + 4)
        if data[pos + 3] == TRACE_MARK[3]:
            patches.append((pos, pos + 16, idx * 16, idx * 16 + 16))
        else:
            src = n_traces * 16 + idx * 8
            patches.append((pos, pos + 8, src, src + 8))
    expected = 2 * n_spans + sum(1 for s in spans if s.parent_span_id)  # trace id, span id, parent id
    if len(patches) != expected:
        raise RuntimeError(f"id placeholders: found {len(patches)}, expected {expected}")
    tpl = Template(data, n_spans, n_traces * 16 + n_spans * 8, patches, [s.ByteSize() for s in spans])
    # Check that rewriting really gives distinct, valid ids.
    check = ExportTraceServiceRequest.FromString(tpl.fresh(bytearray(data)))
    got = [s for rs in check.resource_spans for ss in rs.scope_spans for s in ss.spans]
    ids = {(s.trace_id, s.span_id) for s in got}
    if len(got) != n_spans or len(ids) != n_spans or any(TRACE_MARK in s.trace_id or SPAN_MARK in s.span_id for s in got):
        raise RuntimeError("id rewriting produced duplicate or placeholder ids")
    return tpl


def build_templates(count: int, n_spans: int, secret_fraction: float = 0.0,
                    span_bytes: tuple[int, int] = SPAN_BYTES) -> list[Template]:
    """The load's request templates: seeds 1000, 1001, ... so that Nightshift and its
    peer get the same content."""
    return [build_template(1000 + i, n_spans, secret_fraction, span_bytes) for i in range(count)]


# --------------------------------------------------------------------------------------
# Senders (processes, one request in flight each)
# --------------------------------------------------------------------------------------

OK, REFUSED, ERROR = 0, 1, 2

#: Seconds a refused sender waits when the collector named no delay (an exporter's
#: first backoff step is of this order).
DEFAULT_RETRY_S = 0.1
#: The longest wait honoured: a hint past it is taken as this (OTLP exporters cap
#: their backoff too; a bad header must not park a sender for the whole phase).
MAX_RETRY_S = 30.0


def retry_after_s(value: str | None) -> float:
    """Seconds to wait from an HTTP `Retry-After` header: delta-seconds or an
    HTTP date (RFC 9110 10.2.3); `DEFAULT_RETRY_S` when absent or unreadable."""
    if not value:
        return DEFAULT_RETRY_S
    value = value.strip()
    try:
        secs = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return DEFAULT_RETRY_S
        secs = when.timestamp() - time.time()
    if secs != secs:  # NaN
        return DEFAULT_RETRY_S
    return min(MAX_RETRY_S, max(0.0, secs))


def grpc_retry_s(trailing_metadata) -> float | None:
    """Seconds to wait from a gRPC error's trailers: the `RetryInfo` detail of its
    `grpc-status-details-bin` status (or the bare `google.rpc.retryinfo-bin`
    trailer); None when neither is there (RESOURCE_EXHAUSTED is then final)."""
    from google.rpc import error_details_pb2, status_pb2

    for key, value in trailing_metadata or ():
        try:
            if key == "grpc-status-details-bin":
                infos = [d for d in status_pb2.Status.FromString(value).details
                         if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)]
                if not infos:
                    continue
                delay = error_details_pb2.RetryInfo()
                infos[0].Unpack(delay)
                delay = delay.retry_delay
            elif key == "google.rpc.retryinfo-bin":
                delay = error_details_pb2.RetryInfo.FromString(value).retry_delay
            else:
                continue
        except Exception:  # noqa: BLE001 - a malformed detail: as if absent
            continue
        return min(MAX_RETRY_S, max(0.0, delay.seconds + delay.nanos / 1e9))
    return None


class HttpClient:
    def __init__(self, port: int):
        self.port = port
        self.conn: http.client.HTTPConnection | None = None
        self.headers = {"Content-Type": PROTOBUF}
        self._connect()
        self.conn.request("GET", "/healthz")  # opens the server's connection thread
        self.conn.getresponse().read()

    def _connect(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, body: bytes) -> tuple[int, int, float]:
        """(outcome, spans rejected through partial success, seconds to wait
        before resending when refused)."""
        try:
            self.conn.request("POST", "/v1/traces", body=body, headers=self.headers)
            r = self.conn.getresponse()
            data = r.read()
            if r.will_close:
                self._connect()
        except (OSError, http.client.HTTPException):
            try:
                self._connect()
            except OSError:
                time.sleep(0.1)
            return ERROR, 0, 0.0
        if r.status == 200:
            rejected = ExportTraceServiceResponse.FromString(data).partial_success.rejected_spans if data else 0
            return OK, rejected, 0.0
        if r.status in (429, 503):
            return REFUSED, 0, retry_after_s(r.getheader("Retry-After"))
        return ERROR, 0, 0.0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class GrpcClient:
    def __init__(self, port: int):
        import grpc

        self.grpc = grpc
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", 256 * MB), ("grpc.max_receive_message_length", 64 * MB)],
        )
        grpc.channel_ready_future(self.channel).result(timeout=15)
        self.export = self.channel.unary_unary(GRPC_METHOD)  # no (de)serializer: raw bytes both ways

    def send(self, body: bytes) -> tuple[int, int, float]:
        try:
            data = self.export(body, timeout=60)
        except self.grpc.RpcError as e:
            wait = grpc_retry_s(e.trailing_metadata())
            if e.code() == self.grpc.StatusCode.UNAVAILABLE:
                return REFUSED, 0, DEFAULT_RETRY_S if wait is None else wait
            if e.code() == self.grpc.StatusCode.RESOURCE_EXHAUSTED and wait is not None:
                return REFUSED, 0, wait
            return ERROR, 0, 0.0
        rejected = ExportTraceServiceResponse.FromString(data).partial_success.rejected_spans if data else 0
        return OK, rejected, 0.0

    def close(self) -> None:
        self.channel.close()


def sender_main(idx: int, transport: str, port: int, templates: list[Template], conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    bufs = [bytearray(t.data) for t in templates]
    client = None
    k = idx  # template rotation, different start per sender
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "prepare":
                if client is None:
                    client = HttpClient(port) if transport == "http" else GrpcClient(port)
                conn.send(("ready",))
                continue
            _, start_at, end_at, interval, offset = cmd
            lat = array.array("d")  # ms, actual send -> ack
            sched = array.array("d")  # ms, scheduled send -> ack (rate-limited runs)
            acked_spans = acked_reqs = refused = errors = rejected = late = 0
            i = 0
            retry = None  # (template, body) refused, resent first
            cpu0 = time.process_time()
            now = time.perf_counter()
            if start_at > now:
                time.sleep(start_at - now)
            last_done = time.perf_counter()
            while True:
                if interval:
                    t_sched = start_at + offset + i * interval
                    now = time.perf_counter()
                    if t_sched >= end_at or now >= end_at:  # a phase behind its schedule ends on time too
                        break
                    if t_sched > now:
                        time.sleep(t_sched - now)
                    elif now - t_sched > interval:
                        late += 1
                else:
                    t_sched = time.perf_counter()
                    if t_sched >= end_at:
                        break
                i += 1
                if retry is None:
                    t = templates[k % len(templates)]
                    body = t.fresh(bufs[k % len(templates)])
                    k += 1
                else:  # the refused batch again, as an exporter resends it
                    t, body = retry
                    retry = None
                t0 = time.perf_counter()
                outcome, rej, wait = client.send(body)
                t1 = time.perf_counter()
                last_done = t1
                if outcome == OK:
                    acked_reqs += 1
                    acked_spans += t.spans - rej
                    rejected += rej
                    lat.append((t1 - t0) * 1e3)
                    if interval:
                        sched.append((t1 - t_sched) * 1e3)
                elif outcome == REFUSED:
                    refused += 1
                    retry = (t, body)
                    # the delay the collector asked for, not past the phase's end
                    time.sleep(max(0.0, min(wait, end_at - time.perf_counter())))
                    last_done = time.perf_counter()  # waiting as told is part of the phase: it ends after the wait
                else:
                    errors += 1
            conn.send({
                "acked_spans": acked_spans, "acked_reqs": acked_reqs, "refused": refused, "errors": errors,
                "rejected": rejected, "late": late, "sent": i, "last_done": last_done,
                "cpu": time.process_time() - cpu0, "lat": lat.tobytes(), "sched": sched.tobytes(),
            })
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        if client is not None:
            client.close()


@dataclass
class Sent:
    """What the senders did in one phase, summed over them; latencies in ms, sorted
    by `add_all`."""

    acked_spans: int = 0
    acked_reqs: int = 0
    refused: int = 0
    errors: int = 0
    rejected: int = 0
    late: int = 0
    sent: int = 0
    sender_cpu: float = 0.0
    last_done: float = 0.0  # perf_counter of the last answer any sender got (or the end of a wait it was told)
    lat: list = field(default_factory=list)  # actual send -> ack
    sched: list = field(default_factory=list)  # scheduled send -> ack (rate-limited phases)

    def add_all(self, results: list[dict]) -> None:
        """Adds the senders' replies (sender_main's dict) and sorts the latencies."""
        for r in results:
            for key in ("acked_spans", "acked_reqs", "refused", "errors", "rejected", "late", "sent"):
                setattr(self, key, getattr(self, key) + r[key])
            self.sender_cpu += r["cpu"]
            self.last_done = max(self.last_done, r["last_done"])
            self.lat.extend(array.array("d", r["lat"]))
            self.sched.extend(array.array("d", r["sched"]))
        self.lat.sort()
        self.sched.sort()


class SenderPool:
    """K sender processes (`sender_main`), driven over pipes: prepare (connect),
    run a phase, collect the replies, stop.

    start_method: "fork" while the parent has no threads yet (the templates are
    inherited, not pickled); "spawn" once it has (an RSS sampler, polars' pool).
    """

    def __init__(self, k: int, transport: str, port: int, templates: list[Template], *,
                 start_method: str = "fork", name: str = "sender"):
        ctx = mp.get_context(start_method)
        self.procs: list = []
        self.conns: list = []
        for i in range(k):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=sender_main, args=(i, transport, port, templates, child), name=f"{name}-{i}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _recv(self, c, deadline: float, check: Callable[[], None] | None, error: str):
        while not c.poll(0.5):
            if check is not None:
                check()
            if time.perf_counter() > deadline:
                raise RuntimeError(error)
        return c.recv()

    def prepare(self, timeout: float = 60.0, check: Callable[[], None] | None = None) -> None:
        """Each sender connects (once) and says it is ready; `check` runs while waiting
        (it raises if the server died)."""
        for c in self.conns:
            c.send(("prepare",))
        for c in self.conns:
            self._recv(c, time.perf_counter() + timeout, check, "a sender did not answer")

    def start(self, seconds: float, rate: float | None, spans_per_request: int) -> float:
        """Starts a phase 0.3 s from now, closed loop or (rate, spans/s) open loop with
        the senders' sends spread evenly; returns its start (perf_counter)."""
        k = len(self.conns)
        interval = spans_per_request * k / rate if rate else 0.0
        start_at = time.perf_counter() + 0.3
        for i, c in enumerate(self.conns):
            c.send(("run", start_at, start_at + seconds, interval, i * interval / k))
        time.sleep(max(0.0, start_at - time.perf_counter()))
        return start_at

    def results(self, deadline: float, check: Callable[[], None] | None = None,
                error: str = "a sender did not answer") -> list[dict]:
        """Every sender's reply to the phase, waiting until `deadline` (perf_counter)."""
        return [self._recv(c, deadline, check, error) for c in self.conns]

    def stop(self) -> None:
        """Asks each sender to stop, then kills what is left."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)
        for c in self.conns:
            c.close()
