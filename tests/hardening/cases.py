"""Fuzz cases for the collector, each with the answer the OTLP spec demands.

A case is a request (path, headers, body) and an oracle: the HTTP codes it may
get (the gRPC code follows from it) and, where the generator knows it, exactly
how many records must be rejected through partial success. Generators are
structure-aware (they start from well-formed OTLP requests and break one thing:
an id's length, a timestamp's range, a string's UTF-8, a value's nesting, a
count, a float) and byte-level (flips, truncation, splices of valid bodies),
over protobuf, OTLP/JSON, every compression, and the feedback endpoint.
Seeded: the same seed gives the same cases.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import zlib
from dataclasses import dataclass, field

import zstandard
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span

PB = "application/x-protobuf"
JS = "application/json"
OK = frozenset({200})
DECODED = frozenset({200, 400})  # a mutated body: stored (maybe in part) or refused as undecodable
MAX_TIME = (1 << 63) - 1
T0 = 1_763_800_000_000_000_000


@dataclass
class Case:
    kind: str  # the generator's name, for the report
    path: str
    body: bytes
    content_type: str = PB
    encoding: str | None = None
    expect: frozenset[int] = OK
    rejected: int | None = None  # exact partial-success count, when known
    grpc: bool = True  # also sent to the gRPC handler (protobuf, no compression header)
    extra_headers: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        h = {"content-type": self.content_type, **self.extra_headers}
        if self.encoding:
            h["content-encoding"] = self.encoding
        return h


# --- well-formed requests ---------------------------------------------------------------

_WORDS = ["chat", "gpt-4o", "user", "assistant", "tool", "résumé", "日本語", "emoji 🤖", "", "x" * 300]


def _value(rng: random.Random, depth: int = 0) -> AnyValue:
    k = rng.randrange(8 if depth < 3 else 5)
    if k == 0:
        return AnyValue(string_value=rng.choice(_WORDS))
    if k == 1:
        return AnyValue(bool_value=rng.random() < 0.5)
    if k == 2:
        return AnyValue(int_value=rng.choice([0, 1, -1, 2**63 - 1, -(2**63), rng.randrange(-10**9, 10**9)]))
    if k == 3:
        return AnyValue(double_value=rng.choice([0.0, -0.0, 1.5, 1e308, -1e-308, math.nan, math.inf, -math.inf]))
    if k == 4:
        return AnyValue(bytes_value=rng.randbytes(rng.randrange(0, 40)))
    if k == 5:
        v = AnyValue()
        v.array_value.values.extend(_value(rng, depth + 1) for _ in range(rng.randrange(0, 4)))
        return v
    if k == 6:
        v = AnyValue()
        v.kvlist_value.values.extend(KeyValue(key=f"k{i}", value=_value(rng, depth + 1)) for i in range(rng.randrange(0, 4)))
        return v
    return AnyValue()  # empty: a valid "no value"


def _attrs(rng: random.Random, n: int) -> list[KeyValue]:
    keys = ["gen_ai.operation.name", "gen_ai.request.model", "gen_ai.input.messages", "service.name", "user.email",
            "http.request.header.authorization", "llm.input_messages.0.message.content", "a", ""]
    out = [KeyValue(key=rng.choice(keys) + (str(i) if rng.random() < 0.5 else ""), value=_value(rng)) for i in range(n)]
    if rng.random() < 0.3:  # something the redaction presets rewrite
        out.append(KeyValue(key="note", value=AnyValue(string_value="key sk-" + "a1B2" * 8 + " Bearer abc.def.ghi")))
    return out


def _id(rng: random.Random, n: int) -> bytes:
    b = rng.randbytes(n)
    return b if any(b) else b"\x01" + b[1:]


def trace_request(rng: random.Random, spans: int | None = None) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for _ in range(rng.randrange(1, 3)):
        rs = req.resource_spans.add()
        rs.resource.attributes.extend([KeyValue(key="service.name", value=AnyValue(string_value=rng.choice(
            ["agent", "../../etc", "a/b\\c", "date=2020-01-01", "\u202e", ""])))] + _attrs(rng, rng.randrange(0, 3)))
        for _ in range(rng.randrange(1, 3)):
            ss = rs.scope_spans.add()
            ss.scope.name = rng.choice(_WORDS)
            for _ in range(spans if spans is not None else rng.randrange(1, 6)):
                start = T0 + rng.randrange(0, 10**12)
                s = Span(trace_id=_id(rng, 16), span_id=_id(rng, 8), name=rng.choice(_WORDS), kind=rng.randrange(0, 6),
                         start_time_unix_nano=start, end_time_unix_nano=start + rng.randrange(0, 10**10))
                if rng.random() < 0.5:
                    s.parent_span_id = _id(rng, 8)
                s.attributes.extend(_attrs(rng, rng.randrange(0, 8)))
                for _ in range(rng.randrange(0, 3)):
                    ev = s.events.add(name=rng.choice(_WORDS), time_unix_nano=start)
                    ev.attributes.extend(_attrs(rng, rng.randrange(0, 3)))
                for _ in range(rng.randrange(0, 2)):
                    s.links.add(trace_id=_id(rng, 16), span_id=_id(rng, 8))
                s.status.code = rng.randrange(0, 3)
                ss.spans.append(s)
    return req


def log_request(rng: random.Random, records: int | None = None) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.extend(_attrs(rng, rng.randrange(0, 3)))
    sl = rl.scope_logs.add()
    for _ in range(records if records is not None else rng.randrange(1, 6)):
        r = LogRecord(time_unix_nano=T0 + rng.randrange(0, 10**12), severity_number=rng.randrange(0, 25),
                      event_name=rng.choice(["gen_ai.user.message", "gen_ai.choice", ""]), body=_value(rng))
        if rng.random() < 0.7:
            r.trace_id, r.span_id = _id(rng, 16), _id(rng, 8)
        r.attributes.extend(_attrs(rng, rng.randrange(0, 4)))
        sl.log_records.append(r)
    return req


def metrics_request(rng: random.Random) -> ExportMetricsServiceRequest:
    req = ExportMetricsServiceRequest()
    sm = req.resource_metrics.add().scope_metrics.add()
    for i in range(rng.randrange(1, 4)):
        m = sm.metrics.add(name=f"gen_ai.client.token.usage.{i}")
        for _ in range(rng.randrange(0, 4)):
            m.sum.data_points.add(as_int=rng.randrange(0, 1000), time_unix_nano=T0)
    return req


def to_json(msg) -> bytes:
    from nightshift.collector import otlp_json

    return otlp_json.encode(msg)


# --- raw protobuf, for what the Python API will not build ---------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field_no: int, payload: bytes) -> bytes:
    return _varint(field_no << 3 | 2) + _varint(len(payload)) + payload


def _wrap_span(span_bytes: bytes) -> bytes:
    """An ExportTraceServiceRequest around one encoded span."""
    return _ld(1, _ld(2, _ld(2, span_bytes)))


def nested_value(depth: int, kvlist: bool = False) -> bytes:
    """An encoded AnyValue nested `depth` arrays (or kvlists) deep."""
    v = _ld(1, b"leaf")
    for _ in range(depth):
        v = _ld(6, _ld(1, _ld(1, b"k") + _ld(2, v))) if kvlist else _ld(5, _ld(1, v))
    return v


def _base_span(rng: random.Random, **kw) -> Span:
    return Span(trace_id=_id(rng, 16), span_id=_id(rng, 8), name="chat", start_time_unix_nano=T0,
                end_time_unix_nano=T0 + 1000, **kw)


# --- generators: each returns a Case ------------------------------------------------------

def gen_valid(rng: random.Random) -> Case:
    signal = rng.choice(["traces", "traces", "logs", "metrics"])
    msg = {"traces": trace_request, "logs": log_request, "metrics": metrics_request}[signal](rng)
    if rng.random() < 0.5:
        return Case("valid-json", f"/v1/{signal}", to_json(msg), JS, rejected=0, grpc=False)
    return Case("valid-protobuf", f"/v1/{signal}", msg.SerializeToString(), rejected=0)


def gen_bad_ids(rng: random.Random) -> Case:
    """Wrong-length or all-zero ids on some spans or log records: each rejected alone."""
    if rng.random() < 0.7:
        req = trace_request(rng)
        spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        bad = rng.sample(spans, rng.randrange(1, len(spans) + 1))
        for s in bad:
            what = rng.randrange(5)
            if what == 0:
                s.trace_id = rng.randbytes(rng.choice([0, 1, 8, 15, 17, 32]))
            elif what == 1:
                s.span_id = rng.randbytes(rng.choice([0, 1, 4, 7, 9, 16]))
            elif what == 2:
                s.parent_span_id = rng.randbytes(rng.choice([1, 4, 7, 9, 16]))
            elif what == 3:
                s.trace_id = b"\0" * 16
            else:
                s.links.add(trace_id=rng.randbytes(3), span_id=rng.randbytes(8))
        path, msg = "/v1/traces", req
    else:
        req = log_request(rng)
        recs = [r for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records]
        bad = rng.sample(recs, rng.randrange(1, len(recs) + 1))
        for r in bad:
            if rng.random() < 0.5:
                r.trace_id = rng.randbytes(rng.choice([1, 8, 15, 17]))
            else:
                r.span_id = rng.randbytes(rng.choice([1, 4, 7, 9]))
        path, msg = "/v1/logs", req
    if rng.random() < 0.5:
        return Case("bad-ids-json", path, to_json(msg), JS, rejected=len(bad), grpc=False)
    return Case("bad-ids-protobuf", path, msg.SerializeToString(), rejected=len(bad))


def gen_timestamps(rng: random.Random) -> Case:
    """Timestamps at and past int64's range (stored as int64 ns): past it, rejected alone."""
    req = trace_request(rng, spans=rng.randrange(1, 5))
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    bad = 0
    for s in spans:
        t = rng.choice([0, 1, MAX_TIME, MAX_TIME + 1, 2**64 - 1, T0, 9_000_000_000 * 10**9])
        s.start_time_unix_nano = t
        s.end_time_unix_nano = rng.choice([t, 0, MAX_TIME, 2**64 - 1])
        for ev in s.events:
            ev.time_unix_nano = rng.choice([0, MAX_TIME, 2**64 - 1])
        bad += (s.start_time_unix_nano > MAX_TIME or s.end_time_unix_nano > MAX_TIME
                or any(ev.time_unix_nano > MAX_TIME for ev in s.events))
    if rng.random() < 0.3:  # as JSON, 64-bit values as strings
        return Case("timestamps-json", "/v1/traces", to_json(req), JS, rejected=bad, grpc=False)
    return Case("timestamps", "/v1/traces", req.SerializeToString(), rejected=bad)


def gen_deep(rng: random.Random) -> Case:
    """Attribute values nested up to 300 deep: stored, or refused whole past the
    decoder's depth limit; never a crash in the receiver or the flusher."""
    depth = rng.choice([1, 10, 30, 40, 45, 46, 47, 48, 50, 64, 100, 300])
    if rng.random() < 0.6:
        span = _base_span(rng).SerializeToString() + _ld(9, _ld(1, b"deep") + _ld(2, nested_value(depth, rng.random() < 0.5)))
        return Case("deep-protobuf", "/v1/traces", _wrap_span(span), expect=DECODED)
    leaf = '{"stringValue": "leaf"}'  # built as text: json.dumps itself stops at Python's recursion limit
    for _ in range(depth):
        leaf = ('{"arrayValue": {"values": [%s]}}' if rng.random() < 0.5
                else '{"kvlistValue": {"values": [{"key": "k", "value": %s}]}}') % leaf
    span = (f'{{"traceId": "{_id(rng, 16).hex()}", "spanId": "{_id(rng, 8).hex()}", "name": "deep", '
            f'"startTimeUnixNano": "{T0}", "endTimeUnixNano": "{T0 + 1}", "attributes": [{{"key": "deep", "value": {leaf}}}]}}')
    body = ('{"resourceSpans": [{"scopeSpans": [{"spans": [%s]}]}]}' % span).encode()
    if rng.random() < 0.2:  # plain JSON nesting, deeper than Python's recursion limit
        body = b'{"resourceSpans":' + b"[" * 5000 + b"]" * 5000 + b"}"
    return Case("deep-json", "/v1/traces", body, JS, expect=DECODED, grpc=False)


def gen_many(rng: random.Random) -> Case:
    """Huge counts: attributes, spans, events, a long string; over the size limit: 413."""
    what = rng.randrange(4)
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    if what == 0:
        s = _base_span(rng)
        s.attributes.extend(KeyValue(key=f"k{i}", value=AnyValue(int_value=i)) for i in range(rng.choice([1000, 20000, 100000])))
        ss.spans.append(s)
    elif what == 1:
        for _ in range(rng.choice([1000, 5000])):
            ss.spans.append(_base_span(rng))
    elif what == 2:
        s = _base_span(rng)
        for i in range(rng.choice([1000, 10000])):
            s.events.add(name="e", time_unix_nano=T0 + i)
        ss.spans.append(s)
    else:
        s = _base_span(rng)
        s.attributes.append(KeyValue(key="big", value=AnyValue(string_value="y" * rng.choice([1 << 20, 5 << 20]))))
        ss.spans.append(s)
    return Case("huge-counts", "/v1/traces", req.SerializeToString(), expect=frozenset({200, 413}), rejected=None)


def gen_utf8(rng: random.Random) -> Case:
    """Invalid UTF-8 in string fields (protobuf: the parser refuses the body; JSON:
    the body is not JSON text)."""
    req = trace_request(rng, spans=2)
    marker = "ZZMARKZZ"
    req.resource_spans[0].scope_spans[0].spans[0].name = marker
    bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc", b"\xe2\x82"])
    if rng.random() < 0.5:
        body = req.SerializeToString().replace(marker.encode(), bad + b"x" * (len(marker) - len(bad)))
        return Case("utf8-protobuf", "/v1/traces", body, expect=frozenset({400}))
    body = to_json(req).replace(marker.encode(), bad)
    if bad == b"\xed\xa0\x80":  # a UTF-16 surrogate: Python's JSON reads it, the span's field refuses it alone
        return Case("utf8-json", "/v1/traces", body, JS, rejected=1, grpc=False)
    return Case("utf8-json", "/v1/traces", body, JS, expect=frozenset({400}), grpc=False)


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        if not b:
            b += rng.randbytes(rng.randrange(1, 16))
            continue
        op = rng.randrange(7)
        i = rng.randrange(len(b))
        if op == 0:
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            b[i:i] = rng.randbytes(rng.randrange(1, 8))
        elif op == 3:
            del b[i:i + rng.randrange(1, 16)]
        elif op == 4:
            j = rng.randrange(len(b))
            b[i:i] = b[j:j + rng.randrange(1, 64)]
        elif op == 5:  # an "interesting" varint: huge lengths, negative numbers
            b[i:i + 1] = rng.choice([b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", b"\x00", b"\x7f"])
        else:
            b[i] = rng.randrange(256)
    return bytes(b)


def gen_mutated(rng: random.Random) -> Case:
    """Byte-level mutations of well-formed bodies: stored or refused, never a crash."""
    signal = rng.choice(["traces", "traces", "logs", "metrics"])
    msg = {"traces": trace_request, "logs": log_request, "metrics": metrics_request}[signal](rng)
    if rng.random() < 0.6:
        return Case("mutated-protobuf", f"/v1/{signal}", _mutate(rng, msg.SerializeToString()), expect=DECODED)
    text = to_json(msg)
    if rng.random() < 0.5:
        text = _mutate(rng, text)
    else:  # type confusion at a random JSON value
        doc = json.loads(text)
        _confuse(rng, doc)
        text = json.dumps(doc).encode()
    return Case("mutated-json", f"/v1/{signal}", text, JS, expect=DECODED, grpc=False)


_ODD = [None, True, 0, -1, 2**64, -2**63 - 1, 1e400, "NaN", "Infinity", "", "zz", [], {}, [1, 2], {"a": 1},
        "0" * 40, "-5", "18446744073709551616", "ffffffffffffffffffffffffffffffff", "1e3"]


def _confuse(rng: random.Random, doc) -> None:
    """Replaces one value somewhere in a JSON tree with a value of another type."""
    node, steps = doc, rng.randrange(1, 12)
    for _ in range(steps):
        if isinstance(node, dict) and node:
            k = rng.choice(list(node))
            if rng.random() < 0.4 or not isinstance(node[k], (dict, list)):
                node[k] = rng.choice(_ODD)
                return
            node = node[k]
        elif isinstance(node, list) and node:
            i = rng.randrange(len(node))
            if rng.random() < 0.4 or not isinstance(node[i], (dict, list)):
                node[i] = rng.choice(_ODD)
                return
            node = node[i]
        else:
            return


def _compress(rng: random.Random, body: bytes) -> tuple[bytes, str]:
    enc = rng.choice(["gzip", "deflate", "deflate-raw", "zstd", "x-gzip"])
    if enc in ("gzip", "x-gzip"):
        return gzip.compress(body, compresslevel=1), enc
    if enc == "deflate":
        return zlib.compress(body, 1), "deflate"
    if enc == "deflate-raw":
        c = zlib.compressobj(1, zlib.DEFLATED, -15)
        return c.compress(body) + c.flush(), "deflate"
    return zstandard.ZstdCompressor(level=1).compress(body), "zstd"


def gen_compressed(rng: random.Random, limit: int) -> Case:
    """Compressed bodies, whole or damaged, bombs, and unknown encodings."""
    req = trace_request(rng)
    what = rng.randrange(6)
    if what == 0:
        body, enc = _compress(rng, req.SerializeToString())
        return Case("compressed", "/v1/traces", body, encoding=enc, rejected=0, grpc=False)
    if what == 1:
        body, enc = _compress(rng, req.SerializeToString())
        return Case("compressed-mutated", "/v1/traces", _mutate(rng, body), encoding=enc,
                    expect=frozenset({200, 400}), grpc=False)
    if what == 2:
        body, enc = _compress(rng, req.SerializeToString())
        return Case("compressed-truncated", "/v1/traces", body[: rng.randrange(0, max(1, len(body) - 8))],
                    encoding=enc, expect=frozenset({400}), grpc=False)
    if what == 3:  # a bomb: a tiny body that inflates past the limit
        zeros = b"\0" * (limit + 1 + rng.randrange(0, 1 << 20))
        body, enc = _compress(rng, zeros)
        return Case("bomb", "/v1/traces", body, encoding=enc, expect=frozenset({413}), grpc=False)
    if what == 4:
        return Case("unknown-encoding", "/v1/traces", req.SerializeToString(),
                    encoding=rng.choice(["br", "compress", "gzip, br", "identityx", "\x00"]),
                    expect=frozenset({415}), grpc=False)
    # two gzip members, or a zstd frame followed by garbage
    a, b = req.SerializeToString(), trace_request(rng).SerializeToString()
    if rng.random() < 0.5:
        return Case("gzip-members", "/v1/traces", gzip.compress(a[:10]) + gzip.compress(a[10:]), encoding="gzip",
                    rejected=0, grpc=False)
    return Case("zstd-trailing-garbage", "/v1/traces", zstandard.ZstdCompressor().compress(a) + b[:20],
                encoding="zstd", expect=frozenset({400}), grpc=False)


def gen_headers(rng: random.Random) -> Case:
    """Wrong content types and unknown paths."""
    req = trace_request(rng)
    if rng.random() < 0.5:
        ct = rng.choice(["text/plain", "application/protobuf", "application/grpc", "", "application/json5",
                         "multipart/form-data", "application/x-protobuf\x00", "APPLICATION/X-PROTOBUF"])
        ok = ct.split(";")[0].strip().lower() in (PB, JS)
        return Case("content-type", "/v1/traces", req.SerializeToString(), ct, expect=OK if ok else frozenset({415}),
                    grpc=False)
    path = rng.choice(["/", "/v1/trace", "/v1/traces/", "/v2/traces", "/v1/../v1/traces", "/v1/traces%00", "//v1/traces"])
    # http.server itself folds a leading `//` into `/` (an open-redirect fix), so on the wire that one is served
    return Case("path", path, req.SerializeToString(), expect=frozenset({200, 404} if path == "//v1/traces" else {404}),
                grpc=False)


def _label(rng: random.Random) -> dict:
    d: dict = {"trace_id": _id(rng, 16).hex(), "value": rng.choice([0, 1, 0.5, -3.25, True, False]),
               "name": rng.choice(["user_rating", "checker", "a" * 50])}
    if rng.random() < 0.5:
        d["span_id"] = _id(rng, 8).hex()
    if rng.random() < 0.5:
        d["comment"] = rng.choice(_WORDS + ["mail me at a@b.example", "sk-" + "x1Y2" * 10])
    if rng.random() < 0.5:
        d["time"] = rng.choice(["2025-11-22T10:15:00Z", "2025-11-22T10:15:00+02:00", 1763800000, 1763800000.5])
    if rng.random() < 0.5:
        d["id"] = f"label-{rng.randrange(10**6)}"
    if rng.random() < 0.2:
        d.pop("trace_id")
        d["conversation_id"] = rng.choice(["conv-1", "日本", "x" * 200])
    return d


_BAD_LABEL_FIELDS = [
    ("value", "NaN"), ("value", math.nan), ("value", math.inf), ("value", None), ("value", "1"), ("value", [1]),
    ("value", 1e400), ("trace_id", "xyz"), ("trace_id", "00" * 15), ("trace_id", "0" * 32), ("span_id", "abc"),
    ("time", "yesterday"), ("time", 1e300), ("time", -1e300), ("time", "9999-99-99T00:00:00Z"),
    ("time", "2025-11-22T10:15:00"), ("name", ""), ("name", 5), ("comment", {"a": 1}), ("id", ""), ("id", []),
    ("reward", 1.0), ("unknown_field", 1),
]


def gen_feedback(rng: random.Random) -> Case:
    """POST /v1/feedback: valid labels accepted whole; one bad item refuses the
    request (400, every problem named); odd bodies and content types refused."""
    labels = [_label(rng) for _ in range(rng.randrange(1, 6))]
    what = rng.randrange(5)
    wrap = rng.randrange(3)

    def body_of(items: list) -> bytes:
        doc = items[0] if wrap == 0 and len(items) == 1 else ({"feedback": items} if wrap == 1 else items)
        return json.dumps(doc, allow_nan=True).encode()

    if what == 0:
        return Case("feedback-valid", "/v1/feedback", body_of(labels), JS, grpc=False)
    if what == 1:
        i = rng.randrange(len(labels))
        k, v = rng.choice(_BAD_LABEL_FIELDS)
        labels[i][k] = v
        if k == "trace_id":
            labels[i].pop("conversation_id", None)
        return Case("feedback-invalid", "/v1/feedback", body_of(labels), JS, expect=frozenset({400}), grpc=False)
    if what == 2:
        doc = body_of(labels)
        return Case("feedback-mutated", "/v1/feedback", _mutate(rng, doc), JS, expect=DECODED, grpc=False)
    if what == 3:
        doc = json.loads(body_of(labels))
        _confuse(rng, doc)
        return Case("feedback-confused", "/v1/feedback", json.dumps(doc).encode(), JS, expect=DECODED, grpc=False)
    return Case("feedback-content-type", "/v1/feedback", body_of(labels), rng.choice([PB, "text/csv", ""]),
                expect=frozenset({415}), grpc=False)


def gen_surrogates(rng: random.Random) -> Case:
    """JSON's `\\ud800` escapes: valid JSON, but text no UTF-8 can hold. A label
    carrying one is refused (400); a span or log record carrying one is refused
    alone (partial success) or with its resource; in a key, in a value, anywhere."""
    esc = rng.choice(["\\ud800", "\\udfff", "a\\ud83d", "\\udc00\\ud800"])
    if rng.random() < 0.5:
        label = _label(rng)
        field_ = rng.choice(["comment", "name", "id", "conversation_id", "key"])
        text = json.dumps(label)
        if field_ == "key":
            text = text[:-1] + f', "{esc}": 1}}'
        else:
            label[field_] = "SURR"
            if field_ == "conversation_id":
                label.pop("trace_id", None)
            text = json.dumps(label).replace("SURR", esc)
        return Case("surrogates-feedback", "/v1/feedback", text.encode(), JS, expect=frozenset({400}), grpc=False)
    msg = trace_request(rng) if rng.random() < 0.7 else log_request(rng)
    text = to_json(msg).decode()
    spots = [i for i in range(len(text)) if text.startswith('"', i) and text[i - 1] in ":[{, "]
    i = rng.choice(spots) + 1
    text = text[:i] + esc + text[i:]
    path = "/v1/traces" if isinstance(msg, ExportTraceServiceRequest) else "/v1/logs"
    return Case("surrogates-otlp", path, text.encode(), JS, expect=DECODED, grpc=False)


GENERATORS = {
    "valid": (gen_valid, 10),
    "bad_ids": (gen_bad_ids, 8),
    "timestamps": (gen_timestamps, 5),
    "deep": (gen_deep, 4),
    "many": (gen_many, 0.3),  # big: rare
    "utf8": (gen_utf8, 4),
    "mutated": (gen_mutated, 30),
    "compressed": (gen_compressed, 10),
    "headers": (gen_headers, 4),
    "feedback": (gen_feedback, 12),
    "surrogates": (gen_surrogates, 4),
}


def generate(rng: random.Random, limit: int) -> Case:
    names = list(GENERATORS)
    name = rng.choices(names, weights=[GENERATORS[n][1] for n in names])[0]
    fn = GENERATORS[name][0]
    return fn(rng, limit) if name == "compressed" else fn(rng)


def grpc_code_for(http: int) -> str:
    """What the gRPC transport must answer where HTTP answers `http`."""
    return {200: "OK", 400: "INVALID_ARGUMENT", 413: "RESOURCE_EXHAUSTED", 401: "UNAUTHENTICATED",
            429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}.get(http, "?")

