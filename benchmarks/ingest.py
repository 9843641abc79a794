#!/usr/bin/env python
"""Ingest benchmark for `nightshift collect`.

    python benchmarks/ingest.py [--seconds N] [--senders K] [--spans-per-request 512]
                                [--transport http|grpc] [--peer phoenix]

What it does, in one run:

1. Builds realistic GenAI `chat` spans up front (1-10 KB each, message content
   included) as a few OTLP `ExportTraceServiceRequest` templates, serialized once.
   Every send gets fresh random trace and span ids, written straight into the
   serialized bytes at offsets found once at build time (no protobuf work in the
   senders, and no id is ever sent twice, so deduplication hides no work).
2. Raw loop, the physical reference: one process doing only
   `ExportTraceServiceRequest.FromString(b)`, append to a file, `os.fdatasync` per
   request; then the same with one fdatasync per 8 requests (group commit).
3. Starts the collector as a real process in a temp dir, then K sender processes
   (HTTP keep-alive POSTs or raw-bytes gRPC `Export` calls) for:
   warm-up -> full load (closed loop) -> wait until Parquet has everything ->
   half of the measured peak (rate-limited, open loop) -> wait -> SIGTERM.
4. Prints throughput (total, per collector core), sustained throughput to
   Parquet, ack latencies, RSS (receiver and flusher, sampled every 100 ms), and
   checks the Parquet row count against what was acknowledged.
5. With `--peer phoenix`: afterwards, the same load against Arize Phoenix (own
   virtualenv, see benchmarks/peer_phoenix.py), its figures next to Nightshift's.

Progress goes to stderr; the report (plain text) to stdout.
"""

from __future__ import annotations

import argparse
import array
import datetime as dt
import http.client
import json
import math
import multiprocessing as mp
import os
import platform
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hardening.proc import free_port  # noqa: E402  one helper for every harness

# NB: grpc and polars are imported only where used (grpc in the sender processes,
# polars after the senders are gone): both start threads, and the senders are forked.

GRPC_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
PROTOBUF = "application/x-protobuf"
MB = 1 << 20

# Targets printed next to the figures.
T_ACK_PER_CORE = 100_000
T_RAW_RATIO = 0.3
T_PARQUET_PER_CORE = 50_000
T_FLUSHER_PER_CORE = 40_000  # issue 16: spans per flusher CPU-second
T_HALF_P99_MS = 20.0
T_RSS_MB = 150.0
T_RSS_RATE = 50_000

PEERS = (
    "peer references (not measured here):",
    "  Arize Phoenix: ~126 spans/s persisted on this kind of machine",
    "  Agent Lightning 0.3, OTLP path: ~1,400 spans/s",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def build_template(seed: int, n_spans: int, secret_fraction: float) -> Template:
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
            spans.append(_span(rng, tid, sid, root or b"", int(rng.uniform(1000, 10000)), now_ns, secret_fraction))
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


# --------------------------------------------------------------------------------------
# Senders (forked processes, one request in flight each)
# --------------------------------------------------------------------------------------

OK, REFUSED, ERROR = 0, 1, 2


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

    def send(self, body: bytes) -> tuple[int, int]:
        """(outcome, spans rejected through partial success)."""
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
            return ERROR, 0
        if r.status == 200:
            rejected = ExportTraceServiceResponse.FromString(data).partial_success.rejected_spans if data else 0
            return OK, rejected
        return (REFUSED if r.status == 503 else ERROR), 0

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

    def send(self, body: bytes) -> tuple[int, int]:
        try:
            data = self.export(body, timeout=60)
        except self.grpc.RpcError as e:
            return (REFUSED if e.code() == self.grpc.StatusCode.UNAVAILABLE else ERROR), 0
        rejected = ExportTraceServiceResponse.FromString(data).partial_success.rejected_spans if data else 0
        return OK, rejected

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
            cpu0 = time.process_time()
            now = time.perf_counter()
            if start_at > now:
                time.sleep(start_at - now)
            last_done = time.perf_counter()
            while True:
                if interval:
                    t_sched = start_at + offset + i * interval
                    if t_sched >= end_at:
                        break
                    now = time.perf_counter()
                    if t_sched > now:
                        time.sleep(t_sched - now)
                    elif now - t_sched > interval:
                        late += 1
                else:
                    t_sched = time.perf_counter()
                    if t_sched >= end_at:
                        break
                i += 1
                t = templates[k % len(templates)]
                body = t.fresh(bufs[k % len(templates)])
                k += 1
                t0 = time.perf_counter()
                outcome, rej = client.send(body)
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
                    time.sleep(0.1)  # back off, as an exporter would
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


# --------------------------------------------------------------------------------------
# Raw loop: parse + append + fdatasync, nothing else
# --------------------------------------------------------------------------------------


def parquet_tradeoff(templates: list[Template], chunk_rows: int = 1536) -> list[str]:
    """Write speed (MB of protobuf per CPU-second) against file size for the codecs
    and levels worth considering, with the flusher's dictionary and statistics
    columns, in row groups of a flush chunk's size: the measurement behind
    `collector.datasets.PARQUET_OPTIONS`."""
    import io

    import pyarrow.parquet as pq

    from nightshift.collector import datasets
    from nightshift.collector.otlp_arrow import spans_table

    payloads = [t.fresh(bytearray(t.data)) for t in templates]
    spans_table(payloads[:1], [0])  # the converter is built on first use
    t0 = time.process_time()
    table = spans_table(payloads, [time.time_ns()] * len(payloads)).table
    conv = time.process_time() - t0
    raw = sum(len(p) for p in payloads)
    out = [f"{table.num_rows:,} spans, {raw / 1e6:.0f} MB of protobuf; conversion to Arrow: "
           f"{table.num_rows / conv:,.0f} spans per CPU-second"]
    base = datasets.parquet_options(table.schema)
    chosen = (datasets.PARQUET_OPTIONS["compression"], datasets.PARQUET_OPTIONS.get("compression_level"))
    for codec, level in (("zstd", 1), ("zstd", 3), ("zstd", 6), ("snappy", None), ("lz4", None), ("none", None)):
        opts = {**base, "compression": codec}
        opts.pop("compression_level", None)
        if level is not None:
            opts["compression_level"] = level
        best, size = float("inf"), 0
        for _ in range(2):
            buf = io.BytesIO()
            t0 = time.process_time()
            w = pq.ParquetWriter(buf, table.schema, **opts)
            for i in range(0, table.num_rows, chunk_rows):
                w.write_table(table.slice(i, chunk_rows))
            w.close()
            best, size = min(best, time.process_time() - t0), len(buf.getvalue())
        name = codec + (f" {level}" if level is not None else "")
        mark = "  <- the flusher's" if (codec, level) == chosen else ""
        out.append(f"{name:8s} {raw / best / 1e6:6.0f} MB/s ({table.num_rows / best:8,.0f} spans/s)   "
                   f"file {size / raw:.3f} of the protobuf{mark}")
    return out


def raw_loop(directory: Path, templates: list[Template], seconds: float, group: int) -> dict:
    seg = 0
    rotate = 256 * MB

    def open_file(n: int) -> int:
        return os.open(directory / f"raw-{group}-{n}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    fd = open_file(seg)
    size = 0
    reqs = spans = nbytes = pending = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    try:
        while True:
            t = templates[reqs % len(templates)]
            ExportTraceServiceRequest.FromString(t.data)  # the decode the collector must do
            view = memoryview(t.data)
            while view:
                view = view[os.write(fd, view):]
            size += len(t.data)
            reqs += 1
            spans += t.spans
            nbytes += len(t.data)
            pending += 1
            if pending >= group:
                os.fdatasync(fd)
                pending = 0
                if time.perf_counter() >= deadline:
                    break
                if size >= rotate:  # like a WAL segment roll
                    os.close(fd)
                    os.unlink(directory / f"raw-{group}-{seg}.log")
                    seg += 1
                    fd = open_file(seg)
                    size = 0
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
        os.unlink(directory / f"raw-{group}-{seg}.log")
    return {"reqs": reqs, "spans": spans, "bytes": nbytes, "elapsed": elapsed, "cpu": cpu,
            "spans_s": spans / elapsed, "mb_s": nbytes / MB / elapsed, "per_cpu": spans / cpu if cpu else float("nan")}


# --------------------------------------------------------------------------------------
# Collector process, metrics, RSS sampling
# --------------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read()


def metrics(port: int) -> dict[str, float]:
    # The collector refreshes its flusher gauges (nightshift_flushed, ...) only when
    # /healthz is served, not on /metrics; ask for /healthz first so they are current.
    try:
        http_get(port, "/healthz", timeout=5.0)
    except urllib.error.HTTPError:
        pass  # 503 while shutting down: the gauges were still refreshed
    out = {}
    for line in http_get(port, "/metrics", timeout=5.0).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            pass
    return out


FLUSHED = 'nightshift_flushed{signal="traces"}'
ACCEPTED = 'nightshift_accepted_total{signal="traces"}'


def cpu_seconds(p: psutil.Process | None) -> float:
    if p is None:
        return 0.0
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def machine_busy() -> tuple[float, float]:
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle, sum(t)


@dataclass
class RssStats:
    max_r: float = 0.0
    max_f: float = 0.0
    max_sum: float = 0.0
    sum_sum: float = 0.0
    n: int = 0

    def add(self, r: float, f: float) -> None:
        self.max_r = max(self.max_r, r)
        self.max_f = max(self.max_f, f)
        self.max_sum = max(self.max_sum, r + f)
        self.sum_sum += r + f
        self.n += 1

    @property
    def mean_sum(self) -> float:
        return self.sum_sum / self.n if self.n else 0.0


class Collector:
    def __init__(self, root: Path, flush_interval: float):
        self.root = root
        self.data = root / "data"
        self.wal = root / "wal"
        self.log_path = root / "collector.log"
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.flush_interval = flush_interval
        self.proc: subprocess.Popen | None = None
        self.ps: psutil.Process | None = None
        self.flusher: psutil.Process | None = None
        self._log = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "nightshift.cli", "collect",
            "--data", str(self.data), "--wal", str(self.wal),
            "--grpc", f"127.0.0.1:{self.grpc_port}", "--http", f"127.0.0.1:{self.http_port}",
        ]
        env = {**os.environ, "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": str(self.flush_interval)}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            self.check_alive()
            try:
                info = json.loads(http_get(self.http_port, "/healthz", timeout=1.0))
                if info.get("status") == "ok" and info.get("flusher_pid"):
                    self.flusher = psutil.Process(info["flusher_pid"])
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"collector not healthy after 60 s; log:\n{self.log_tail()}")

    def refresh_flusher(self) -> None:
        try:
            info = json.loads(http_get(self.http_port, "/healthz", timeout=1.0))
            if info.get("flusher_pid") and (self.flusher is None or self.flusher.pid != info["flusher_pid"]):
                self.flusher = psutil.Process(info["flusher_pid"])
        except (OSError, ValueError, psutil.Error):
            pass

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"collector exited with {self.proc.returncode}; log:\n{self.log_tail()}")

    def cpu(self) -> tuple[float, float]:
        return cpu_seconds(self.ps), cpu_seconds(self.flusher)

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 300.0) -> tuple[int, float]:
        """SIGTERM: drain, flush, exit. Returns (exit code, seconds)."""
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, time.perf_counter() - t0

    def kill(self) -> None:
        """Last resort on error: the collector and its flusher, by pid."""
        procs = []
        if self.ps is not None:
            try:
                procs = self.ps.children(recursive=True)
            except psutil.Error:
                procs = []
        if self.flusher is not None and all(p.pid != self.flusher.pid for p in procs):
            procs.append(self.flusher)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None


class Sampler(threading.Thread):
    """RSS of the receiver and the flusher every 100 ms, by phase label."""

    def __init__(self, coll: Collector):
        super().__init__(name="rss-sampler", daemon=True)
        self.coll = coll
        self.label = "start"
        self.stats: dict[str, RssStats] = {}
        self.all = RssStats()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.1):
            try:
                r = self.coll.ps.memory_info().rss / MB
            except psutil.Error:
                continue
            try:
                f = self.coll.flusher.memory_info().rss / MB if self.coll.flusher else 0.0
            except psutil.Error:
                f = 0.0
                self.coll.refresh_flusher()
            self.all.add(r, f)
            self.stats.setdefault(self.label, RssStats()).add(r, f)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(2)


# --------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


@dataclass
class Phase:
    name: str
    start: float = 0.0
    end: float = 0.0
    acked_spans: int = 0
    acked_reqs: int = 0
    refused: int = 0
    errors: int = 0
    rejected: int = 0
    late: int = 0
    sent: int = 0
    sender_cpu: float = 0.0
    lat: list = field(default_factory=list)
    sched: list = field(default_factory=list)
    cpu_r: float = 0.0
    cpu_f: float = 0.0
    busy: float = 0.0  # machine CPU seconds busy (all cores)
    target_rate: float = 0.0
    commits: float = 0.0
    commit_reqs: float = 0.0
    cpu_start: tuple | None = None  # (receiver, flusher) CPU seconds at the start
    main_cpu: float = 0.0  # this process (RSS sampler, metrics polling)

    @property
    def other_cpu(self) -> float:
        """Busy CPU seconds not used by the collector, the senders or this process:
        kernel threads (writeback, softirq) and anything else running on the machine."""
        return max(0.0, self.busy - self.cpu_r - self.cpu_f - self.sender_cpu - self.main_cpu)

    @property
    def elapsed(self) -> float:
        return max(1e-9, self.end - self.start)

    @property
    def rate(self) -> float:
        return self.acked_spans / self.elapsed


class Senders:
    def __init__(self, k: int, transport: str, port: int, templates: list[Template]):
        ctx = mp.get_context("fork")  # templates are inherited, not pickled
        self.procs = []
        self.conns = []
        for i in range(k):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=sender_main, args=(i, transport, port, templates, child), name=f"sender-{i}", daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def _recv(self, c, timeout: float = 120.0):
        if not c.poll(timeout):
            raise RuntimeError("a sender did not answer")
        return c.recv()

    def prepare(self) -> None:
        for c in self.conns:
            c.send(("prepare",))
        for c in self.conns:
            self._recv(c, 60)

    def run(self, coll: Collector, sampler: Sampler, name: str, seconds: float, rate: float | None,
            spans_per_request: int) -> Phase:
        self.prepare()
        k = len(self.conns)
        interval = spans_per_request * k / rate if rate else 0.0
        ph = Phase(name, target_rate=rate or 0.0)
        m0 = metrics(coll.http_port)
        start_at = time.perf_counter() + 0.3
        for i, c in enumerate(self.conns):
            c.send(("run", start_at, start_at + seconds, interval, i * interval / k))
        time.sleep(max(0.0, start_at - time.perf_counter()))
        sampler.label = name
        r0, f0 = coll.cpu()
        b0, _ = machine_busy()
        ph.cpu_start = (r0, f0)
        m_cpu0 = time.process_time()
        results = []
        for c in self.conns:
            while not c.poll(0.5):
                coll.check_alive()
                if time.perf_counter() > start_at + seconds + 120:
                    raise RuntimeError("senders did not finish within 120 s of the end of the phase")
            results.append(c.recv())
        r1, f1 = coll.cpu()
        b1, _ = machine_busy()
        ph.main_cpu = time.process_time() - m_cpu0
        sampler.label = f"after {name}"
        m1 = metrics(coll.http_port)
        ph.start = start_at
        ph.end = max(r["last_done"] for r in results)
        ph.cpu_r, ph.cpu_f, ph.busy = r1 - r0, f1 - f0, b1 - b0
        for r in results:
            for key in ("acked_spans", "acked_reqs", "refused", "errors", "rejected", "late", "sent"):
                setattr(ph, key, getattr(ph, key) + r[key])
            ph.sender_cpu += r["cpu"]
            ph.lat.extend(array.array("d", r["lat"]))
            ph.sched.extend(array.array("d", r["sched"]))
        ph.lat.sort()
        ph.sched.sort()
        ph.commits = m1.get("nightshift_wal_group_commit_requests_count", 0) - m0.get("nightshift_wal_group_commit_requests_count", 0)
        ph.commit_reqs = m1.get("nightshift_wal_group_commit_requests_sum", 0) - m0.get("nightshift_wal_group_commit_requests_sum", 0)
        return ph

    def stop(self) -> None:
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


@dataclass
class Drain:
    done: bool
    at: float  # perf_counter when flushed reached the target
    flushed: float
    cpu_r: float = 0.0
    cpu_f: float = 0.0


def wait_flushed(coll: Collector, target: int, timeout: float) -> Drain:
    deadline = time.perf_counter() + timeout
    flushed = 0.0
    while True:
        coll.check_alive()
        now = time.perf_counter()
        try:
            flushed = metrics(coll.http_port).get(FLUSHED, 0.0)
        except OSError:
            flushed = flushed
        if flushed >= target:
            return Drain(True, now, flushed, *coll.cpu())
        if now > deadline:
            return Drain(False, now, flushed)
        time.sleep(0.1)


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "[met]" if ok else "[NOT met]"


def fmt(n: float) -> str:
    if n != n:  # nan
        return "n/a"
    return f"{n:,.0f}"


def fs_of(path: Path) -> str:
    best = None
    p = str(path.resolve())
    for part in psutil.disk_partitions(all=True):
        mp_ = part.mountpoint
        if p == mp_ or p.startswith(mp_.rstrip("/") + "/"):
            if best is None or len(mp_) > len(best.mountpoint):
                best = part
    return f"{best.fstype} on {best.device} (mounted at {best.mountpoint})" if best else "unknown filesystem"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="full-load phase duration (default 10)")
    ap.add_argument("--half-seconds", type=float, default=None, help="half-load phase duration (default: --seconds)")
    ap.add_argument("--senders", type=int, default=4, help="concurrent sender processes, one request in flight each (default 4)")
    ap.add_argument("--spans-per-request", type=int, default=512, help="spans per export request (default 512)")
    ap.add_argument("--transport", choices=("http", "grpc"), default="http")
    ap.add_argument("--templates", type=int, default=8, help="distinct request templates (content); ids are new on every send")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before the full-load phase, not counted")
    ap.add_argument("--raw-seconds", type=float, default=4.0, help="duration of each raw-loop variant (default 4)")
    ap.add_argument("--flush-interval", type=float, default=0.5,
                    help="NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL: seconds before a WAL segment goes to the flusher (default 0.5)")
    ap.add_argument("--secret-fraction", type=float, default=0.0,
                    help="fraction of spans whose user message contains an API key (exercises redaction); default 0")
    ap.add_argument("--drain-timeout", type=float, default=300.0, help="max seconds to wait for Parquet to catch up")
    ap.add_argument("--dir", default=None, help="parent folder for the temp dir (its filesystem is what gets fsync'd)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (data, WAL, collector log)")
    ap.add_argument("--peer", choices=("phoenix",), default=None,
                    help="after the Nightshift phases, measure a peer with the same load (--seconds, --senders; "
                         "phoenix: Arize Phoenix in its own venv, see benchmarks/peer_phoenix.py)")
    ap.add_argument("--peer-persist-timeout", type=float, default=120.0,
                    help="max seconds after the peer's load to wait for its spans to be persisted (default 120)")
    args = ap.parse_args()
    if args.senders < 1 or args.spans_per_request < 1 or args.templates < 1 or args.seconds <= 0:
        ap.error("--senders, --spans-per-request, --templates and --seconds must be positive")
    half_seconds = args.half_seconds or args.seconds

    def on_term(*_):
        raise KeyboardInterrupt

    out: list[str] = []

    def say(line: str = "") -> None:
        out.append(line)

    ncpu = os.cpu_count() or 1
    say("nightshift ingest benchmark")
    say(f"date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}")
    say(f"host: {socket.gethostname()}, {ncpu} logical CPUs ({psutil.cpu_count(logical=False) or '?'} physical), "
        f"{psutil.virtual_memory().total / (1 << 30):.1f} GiB RAM, {platform.processor() or platform.machine()}")
    say(f"python: {platform.python_version()} ({sys.executable})")
    say("args: " + " ".join(f"{k}={v}" for k, v in vars(args).items()))
    background = psutil.cpu_percent(interval=1.0) / 100 * ncpu
    say(f"CPU busy before start (other processes): {background:.2f} of {ncpu} cores"
        + ("  WARNING: the machine is not idle; figures will be low" if background > 0.1 * ncpu else ""))

    senders: Senders | None = None
    coll: Collector | None = None
    sampler: Sampler | None = None
    tmp: Path | None = None
    old_term = signal.signal(signal.SIGTERM, on_term)  # SIGTERM cleans up like Ctrl-C
    try:
        tmp = Path(tempfile.mkdtemp(prefix="nightshift-bench-", dir=args.dir))
        say(f"temp dir: {tmp} ({fs_of(tmp)})")
        # --- workload -------------------------------------------------------------------
        log(f"building {args.templates} request templates x {args.spans_per_request} spans")
        t0 = time.perf_counter()
        templates = [build_template(1000 + i, args.spans_per_request, args.secret_fraction) for i in range(args.templates)]
        sizes = sorted(s for t in templates for s in t.span_sizes)
        req_sizes = [len(t.data) for t in templates]
        buf = bytearray(templates[0].data)
        n = 50
        tp0 = time.perf_counter()
        for _ in range(n):
            templates[0].fresh(buf)
        patch_ms = (time.perf_counter() - tp0) / n * 1e3
        say(f"workload: {args.templates} templates x {args.spans_per_request} GenAI chat spans (built in "
            f"{time.perf_counter() - t0:.1f} s); span size min/median/mean/max "
            f"{sizes[0]:,}/{sizes[len(sizes) // 2]:,}/{sum(sizes) // len(sizes):,}/{sizes[-1]:,} B; "
            f"request {min(req_sizes) / MB:.2f}-{max(req_sizes) / MB:.2f} MiB; new ids per send: {patch_ms:.2f} ms of sender CPU")

        # --- raw loop, before anything else runs ----------------------------------------
        log(f"raw loop: FromString + append + fdatasync per request, {args.raw_seconds:.0f} s")
        raw1 = raw_loop(tmp, templates, args.raw_seconds, 1)
        log(f"raw loop: group commit every 8 requests, {args.raw_seconds:.0f} s")
        raw8 = raw_loop(tmp, templates, args.raw_seconds, 8)

        # --- senders forked now: before any thread (sampler, grpc, polars) exists --------
        coll = Collector(tmp, args.flush_interval)
        port = coll.http_port if args.transport == "http" else coll.grpc_port
        senders = Senders(args.senders, args.transport, port, templates)

        log("starting the collector")
        coll.start()
        sampler = Sampler(coll)
        sampler.start()

        total_acked = 0
        log(f"warm-up {args.warmup:.0f} s ({args.senders} {args.transport} senders)")
        warm = senders.run(coll, sampler, "warmup", args.warmup, None, args.spans_per_request)
        total_acked += warm.acked_spans
        d = wait_flushed(coll, total_acked, args.drain_timeout)
        if not d.done:
            raise RuntimeError(f"warm-up data not flushed after {args.drain_timeout:.0f} s")

        log(f"full load {args.seconds:.0f} s")
        full = senders.run(coll, sampler, "full", args.seconds, None, args.spans_per_request)
        total_acked += full.acked_spans
        if full.acked_spans == 0:
            raise RuntimeError(f"nothing acknowledged under full load ({full.refused} refused, {full.errors} errors)")
        flushed_at_end = metrics(coll.http_port).get(FLUSHED, 0.0) - warm.acked_spans
        log(f"full load: {fmt(full.rate)} spans/s acknowledged; waiting for Parquet to catch up")
        sampler.label = "drain after full"
        drain1 = wait_flushed(coll, total_acked, args.drain_timeout)

        half_rate = full.rate / 2
        log(f"half load: {fmt(half_rate)} spans/s for {half_seconds:.0f} s")
        half = senders.run(coll, sampler, "half", half_seconds, half_rate, args.spans_per_request)
        total_acked += half.acked_spans
        sampler.label = "drain after half"
        drain2 = wait_flushed(coll, total_acked, args.drain_timeout)

        senders.stop()
        senders = None
        m_end = metrics(coll.http_port)
        sampler.label = "shutdown"
        log("SIGTERM: drain and exit")
        rc, stop_s = coll.stop()
        sampler.stop()

        # --- verification ---------------------------------------------------------------
        log("counting Parquet rows")
        import polars as pl

        pattern = f"{coll.data}/spans/**/*.parquet"
        lf = pl.scan_parquet(pattern, hive_partitioning=True)
        stored = lf.select(pl.len()).collect().item()
        unique = lf.select(pl.struct("trace_id", "span_id").n_unique()).collect().item()

        # --- peer, same load, after Nightshift is gone ------------------------------------
        peer = None
        if args.peer == "phoenix":
            from peer_phoenix import report_lines, run_phoenix

            log("peer: Arize Phoenix")
            peer = run_phoenix(sys.modules[__name__], templates, senders=args.senders, seconds=args.seconds,
                               spans_per_request=args.spans_per_request, secret_fraction=args.secret_fraction,
                               persist_timeout=args.peer_persist_timeout, parent_dir=args.dir)

        # --- report ---------------------------------------------------------------------
        say()
        say("raw loop (physical reference; 1 process, same request bytes, no collector running):")
        say(f"  FromString + append + fdatasync per request: {fmt(raw1['spans_s'])} spans/s "
            f"({raw1['mb_s']:.0f} MiB/s, {raw1['reqs'] / raw1['elapsed']:.0f} req/s, {fmt(raw1['per_cpu'])} spans per CPU-second)")
        say(f"  same, one fdatasync per 8 requests:         {fmt(raw8['spans_s'])} spans/s "
            f"({raw8['mb_s']:.0f} MiB/s, {raw8['reqs'] / raw8['elapsed']:.0f} req/s, {fmt(raw8['per_cpu'])} spans per CPU-second)")

        def phase_lines(ph: Phase) -> None:
            say(f"  acknowledged: {ph.acked_spans:,} spans in {ph.acked_reqs:,} requests over {ph.elapsed:.1f} s; "
                f"refused (503): {ph.refused:,}; errors: {ph.errors:,}; rejected spans: {ph.rejected:,}")
            say(f"  ack latency (send -> 200/OK) ms: p50 {pct(ph.lat, 50):.1f}, p90 {pct(ph.lat, 90):.1f}, "
                f"p99 {pct(ph.lat, 99):.1f}, max {pct(ph.lat, 100):.1f}")
            e = ph.elapsed
            say(f"  CPU (cores): receiver {ph.cpu_r / e:.2f}, flusher {ph.cpu_f / e:.2f}, senders {ph.sender_cpu / e:.2f}, "
                f"other (kernel, other processes) {ph.other_cpu / e:.2f}; machine busy {ph.busy / e:.2f} of {ncpu}")
            if ph.commits:
                say(f"  WAL group commit: {ph.commit_reqs / ph.commits:.1f} requests per fsync ({ph.commits:.0f} fsyncs)")

        say()
        say(f"full load ({args.senders} {args.transport} senders, closed loop, {args.spans_per_request} spans/request):")
        phase_lines(full)
        per_core = full.acked_spans / full.cpu_r if full.cpu_r else float("nan")
        ratio = full.rate / raw1["spans_s"]
        say(f"  acknowledged durable spans/s: {fmt(full.rate)} total; {fmt(per_core)} per receiver core "
            f"(spans / receiver CPU-seconds; machine has {ncpu} cores)")
        say(f"    target >= {T_ACK_PER_CORE:,} per core: {verdict(per_core >= T_ACK_PER_CORE)}")
        say(f"  collector / raw loop (fdatasync per request): {ratio:.3f}   target >= {T_RAW_RATIO}: {verdict(ratio >= T_RAW_RATIO)}"
            f"   (vs group-commit raw loop: {full.rate / raw8['spans_s']:.2f})")

        say()
        say("sustained to Parquet (full-load phase, first send -> flusher has written every acknowledged span):")
        if drain1.done:
            secs = drain1.at - full.start
            sustained = full.acked_spans / secs
            say(f"  {fmt(sustained)} spans/s ({full.acked_spans:,} spans in {secs:.1f} s; load stopped at {full.elapsed:.1f} s, "
                f"Parquet caught up {drain1.at - full.end:.1f} s later)")
        else:
            sustained = float("nan")
            say(f"  NOT caught up within {args.drain_timeout:.0f} s: {fmt(drain1.flushed - warm.acked_spans)} of {full.acked_spans:,} flushed")
        say(f"  written during the load window: {fmt(flushed_at_end)} spans ({fmt(flushed_at_end / full.elapsed)} spans/s while under full load)")
        return_cpu = drain_cpu(full, drain1)
        if return_cpu is not None and drain1.done:
            cpu_total, cpu_f_only = return_cpu
            pc_all = full.acked_spans / cpu_total if cpu_total else float("nan")
            pc_f = full.acked_spans / cpu_f_only if cpu_f_only else float("nan")
            say(f"  per core: {fmt(pc_all)} spans per collector CPU-second (receiver + flusher, {cpu_total:.1f} s); "
                f"flusher alone {fmt(pc_f)} spans per CPU-second")
            say(f"    target >= {T_PARQUET_PER_CORE:,} per core: {verdict(pc_all >= T_PARQUET_PER_CORE)}")
            say(f"    flusher target >= {T_FLUSHER_PER_CORE:,} per CPU-second: {verdict(pc_f >= T_FLUSHER_PER_CORE)}")
        if drain1.done:
            say(f"    sustained >= acknowledged ({fmt(full.rate)} spans/s, no growth of the log at full speed): "
                f"{verdict(sustained >= full.rate)}")

        say()
        say(f"half load (target {fmt(half.target_rate)} spans/s = half the full-load rate, {args.senders} senders, open loop):")
        phase_lines(half)
        say(f"  achieved {fmt(half.rate)} spans/s; sends late by more than one interval: {half.late:,}")
        say(f"  ack latency from scheduled send time ms: p50 {pct(half.sched, 50):.1f}, p99 {pct(half.sched, 99):.1f}")
        p99 = pct(half.lat, 99)
        say(f"  p99 ack latency at half of peak: {p99:.1f} ms   target < {T_HALF_P99_MS:.0f} ms: {verdict(p99 < T_HALF_P99_MS)}")
        if drain2.done:
            say(f"  Parquet caught up {drain2.at - half.end:.1f} s after the phase ended")
        else:
            say(f"  Parquet NOT caught up within {args.drain_timeout:.0f} s after the phase")

        say()
        say("memory (RSS, sampled every 100 ms):")
        a = sampler.all
        say(f"  peak over the run: receiver {a.max_r:.0f} MiB, flusher {a.max_f:.0f} MiB, sum {a.max_sum:.0f} MiB (peak of the sum)")
        for label in ("full", "drain after full", "half"):
            s = sampler.stats.get(label)
            if s:
                say(f"  {label:>16}: receiver max {s.max_r:.0f} MiB, flusher max {s.max_f:.0f} MiB, "
                    f"sum max {s.max_sum:.0f} / mean {s.mean_sum:.0f} MiB")
        hs = sampler.stats.get("half", RssStats())
        say(f"  at half load ({fmt(half.rate)} spans/s): {hs.max_sum:.0f} MiB ({hs.max_sum * MB / 1e6:.0f} MB)   target < {T_RSS_MB:.0f} MB at "
            f"{T_RSS_RATE // 1000}k spans/s: {verdict(hs.max_sum * MB / 1e6 < T_RSS_MB)}"
            + ("" if abs(half.rate - T_RSS_RATE) < 0.2 * T_RSS_RATE else " (measured at a different rate)"))

        say()
        say("verification:")
        in_wal = spans_left_in_wal(coll.wal)
        lost = max(0, total_acked - unique - in_wal)
        dup = stored - unique
        say(f"  acknowledged spans (warm-up + full + half): {total_acked:,}; Parquet rows: {stored:,} ({unique:,} distinct ids)")
        say(f"  Parquet span count {'equals' if stored == total_acked else 'DIFFERS FROM'} the acknowledged count"
            + (f"; {in_wal:,} spans still in the WAL after shutdown (flushed on the next start)" if in_wal else ""))
        say(f"  lost: {lost:,}, duplicated: {dup:,}" + (f", stored but never acknowledged: {unique - total_acked:,}" if unique > total_acked else ""))
        say(f"  collector counters: accepted {fmt(m_end.get(ACCEPTED, float('nan')))}, flushed {fmt(m_end.get(FLUSHED, float('nan')))}, "
            f"duplicates dropped {fmt(m_end.get('nightshift_duplicates_dropped', float('nan')))}, "
            f"flush errors {fmt(m_end.get('nightshift_flush_errors', float('nan')))}")
        say(f"  SIGTERM: exit code {rc} after {stop_s:.1f} s")

        say()
        say("Parquet codec trade-off (this run's spans converted once, written as the flusher writes them):")
        for line in parquet_tradeoff(templates):
            say("  " + line)

        say()
        say("summary:")
        say(f"  acknowledged durable: {fmt(full.rate)} spans/s total, {fmt(per_core)}/receiver core (target {T_ACK_PER_CORE // 1000}k/core) "
            f"{verdict(per_core >= T_ACK_PER_CORE)}")
        say(f"  vs raw loop: {ratio:.3f} (target {T_RAW_RATIO}) {verdict(ratio >= T_RAW_RATIO)}")
        if return_cpu is not None and drain1.done:
            say(f"  sustained to Parquet: {fmt(sustained)} spans/s, {fmt(pc_all)}/collector core (target {T_PARQUET_PER_CORE // 1000}k/core) "
                f"{verdict(pc_all >= T_PARQUET_PER_CORE)}")
        else:
            say("  sustained to Parquet: did not catch up [NOT met]")
        say(f"  p50/p99 ack: full load {pct(full.lat, 50):.1f}/{pct(full.lat, 99):.1f} ms; half load {pct(half.lat, 50):.1f}/{p99:.1f} ms "
            f"(target p99 < {T_HALF_P99_MS:.0f} ms) {verdict(p99 < T_HALF_P99_MS)}")
        say(f"  RSS: peak {a.max_sum:.0f} MiB; at half load ({fmt(half.rate)} spans/s) {hs.max_sum:.0f} MiB (target < {T_RSS_MB:.0f} MB at "
            f"{T_RSS_RATE // 1000}k spans/s) {verdict(hs.max_sum * MB / 1e6 < T_RSS_MB)}")
        say(f"  lost: {lost:,}, duplicated: {dup:,}")
        noisy = [f"{ph.name} {ph.other_cpu / ph.elapsed:.2f}" for ph in (full, half) if ph.other_cpu / ph.elapsed > 0.25]
        if noisy:
            say(f"  WARNING: CPU used outside the benchmark (cores: {', '.join(noisy)}); the machine was not quiet, "
                "throughput and latency are understated")
        say()
        if peer is not None:
            for line in report_lines(peer, {"ack_rate": full.rate, "sustained": sustained, "p50": pct(full.lat, 50),
                                            "p99": pct(full.lat, 99), "rss_mib": a.max_sum, "refused": full.refused,
                                            "spans_per_request": args.spans_per_request}):
                say(line)
            say()
        for line in PEERS:
            if peer is None or peer.skipped or "Phoenix" not in line:
                say(line)
        print("\n".join(out), flush=True)
        ok = lost == 0 and dup == 0 and rc == 0
        return 0 if ok else 1
    except KeyboardInterrupt:
        log("interrupted; cleaning up")
        return 130
    except Exception as e:  # noqa: BLE001
        if out:
            print("\n".join(out), flush=True)
        log(f"benchmark failed: {type(e).__name__}: {e}")
        if coll is not None and coll.proc is not None:
            log("collector log tail:\n" + coll.log_tail(3000))
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # don't interrupt the cleanup
        if sampler is not None:
            sampler.stop()
        if senders is not None:
            senders.kill()
        if coll is not None:
            coll.kill()
        if tmp is not None:
            if args.keep:
                log(f"kept {tmp}")
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, old_term)


def spans_left_in_wal(wal_dir: Path) -> int:
    """Spans in WAL segments the collector left behind at shutdown (normally none)."""
    segments = [p for p in wal_dir.glob("*") if p.suffix in (".sealed", ".active")]
    if not segments:
        return 0
    from nightshift.collector import wal  # imported late: it pulls in grpc

    n = 0
    for p in segments:
        for kind, _, payload in wal.read_segment(p):
            if kind == wal.KIND_TRACES:
                req = ExportTraceServiceRequest.FromString(payload)
                n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return n


def drain_cpu(full: Phase, drain: Drain) -> tuple[float, float] | None:
    """(receiver + flusher CPU, flusher CPU) from the start of the full-load phase
    until the drain completed."""
    if full.cpu_start is None:
        return None
    r0, f0 = full.cpu_start
    return (drain.cpu_r - r0) + (drain.cpu_f - f0), drain.cpu_f - f0


if __name__ == "__main__":
    sys.exit(main())
