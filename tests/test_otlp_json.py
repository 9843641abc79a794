"""OTLP/JSON decoding (the spec's deviations from proto3 JSON) and request
decompression / content-type handling."""

from __future__ import annotations

import base64
import gzip
import json
import tracemalloc
import zlib

import pytest
import zstandard
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from nightshift.collector import decode, errors, otlp_json, validate

TRACE_HEX = "5B8EFFF798038103D269B633813FC60C"
SPAN_HEX = "EEE19B7EC3C1B174"
PARENT_HEX = "eee19b7ec3c1b173"
LINK_TRACE_HEX = "0af7651916cd43dd8448eb211c80319c"
LINK_SPAN_HEX = "B7AD6B7169203331"


def _span(name: str = "s", **extra) -> dict:
    d = {
        "traceId": TRACE_HEX,
        "spanId": SPAN_HEX,
        "name": name,
        "kind": 1,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001000000000",
    }
    d.update(extra)
    return d


def _traces(*spans: dict, **top) -> bytes:
    doc = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "svc"}}]},
                "scopeSpans": [{"scope": {"name": "lib", "version": "1.0"}, "spans": list(spans)}],
            }
        ]
    }
    doc.update(top)
    return json.dumps(doc).encode()


def _spans_of(req) -> list:
    return [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]


def _logs_of(req) -> list:
    return [r for rl in req.resource_logs for sl in rl.scope_logs for r in sl.log_records]


# --- ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [str.upper, str.lower], ids=["upper", "lower"])
def test_hex_ids_become_raw_bytes(case):
    body = _traces(
        _span(
            traceId=case(TRACE_HEX),
            spanId=case(SPAN_HEX),
            parentSpanId=case(PARENT_HEX),
            links=[{"traceId": case(LINK_TRACE_HEX), "spanId": case(LINK_SPAN_HEX)}],
        )
    )
    d = otlp_json.decode_traces(body)
    assert d.rejected == 0 and d.error == ""
    (s,) = _spans_of(d.message)
    assert s.trace_id == bytes.fromhex(TRACE_HEX)
    assert len(s.trace_id) == 16
    assert s.span_id == bytes.fromhex(SPAN_HEX)
    assert s.parent_span_id == bytes.fromhex(PARENT_HEX)
    assert s.links[0].trace_id == bytes.fromhex(LINK_TRACE_HEX)
    assert s.links[0].span_id == bytes.fromhex(LINK_SPAN_HEX)
    assert validate.filter_traces(d.message) == (1, 0, "")


def test_ids_are_not_read_as_base64():
    # "AAAAAAAAAAAAAAAAAAAAAA==" is valid base64 for 16 zero bytes but not hex: it
    # must not be accepted as a trace id.
    d = otlp_json.decode_traces(_traces(_span(traceId="AAAAAAAAAAAAAAAAAAAAAA==")))
    (s,) = _spans_of(d.message)
    assert s.trace_id != bytes(16)
    kept, rejected, msg = validate.filter_traces(d.message)
    assert (kept, rejected) == (0, 1)
    assert "trace_id" in msg


# --- 64-bit integers and enums --------------------------------------------------------------


def test_int64_as_strings_and_as_numbers():
    span = _span(
        startTimeUnixNano="1700000000000000001",
        endTimeUnixNano=1700000000000000002,
        attributes=[
            {"key": "as_string", "value": {"intValue": "-9223372036854775808"}},
            {"key": "as_number", "value": {"intValue": 9007199254740993}},
        ],
        events=[{"timeUnixNano": 1700000000000000003, "name": "e1"}, {"timeUnixNano": "1700000000000000004", "name": "e2"}],
        droppedAttributesCount=3,
    )
    d = otlp_json.decode_traces(_traces(span))
    assert d.rejected == 0
    (s,) = _spans_of(d.message)
    assert s.start_time_unix_nano == 1700000000000000001
    assert s.end_time_unix_nano == 1700000000000000002
    assert [e.time_unix_nano for e in s.events] == [1700000000000000003, 1700000000000000004]
    attrs = {kv.key: kv.value.int_value for kv in s.attributes}
    assert attrs == {"as_string": -(1 << 63), "as_number": 9007199254740993}
    assert s.dropped_attributes_count == 3


def test_integer_enums():
    spans = [
        _span("server", kind=2, status={"code": 1}),
        _span("client", kind=3, status={"code": 2, "message": "boom"}),
        _span("consumer", kind=5),
    ]
    d = otlp_json.decode_traces(_traces(*spans))
    by_name = {s.name: s for s in _spans_of(d.message)}
    assert by_name["server"].kind == Span.SPAN_KIND_SERVER
    assert by_name["server"].status.code == Status.STATUS_CODE_OK
    assert by_name["client"].kind == Span.SPAN_KIND_CLIENT
    assert by_name["client"].status.code == Status.STATUS_CODE_ERROR
    assert by_name["client"].status.message == "boom"
    assert by_name["consumer"].kind == Span.SPAN_KIND_CONSUMER


def test_unknown_fields_are_ignored_at_every_level():
    span = _span(
        futureSpanField={"x": 1},
        attributes=[{"key": "a", "value": {"stringValue": "v", "futureValueField": 1}, "futureKvField": True}],
        events=[{"name": "ev", "timeUnixNano": "1", "futureEventField": [1, 2]}],
        links=[{"traceId": LINK_TRACE_HEX, "spanId": LINK_SPAN_HEX, "futureLinkField": "x"}],
        status={"code": 1, "futureStatusField": 0},
    )
    doc = {
        "futureTopField": 1,
        "resourceSpans": [
            {
                "futureResourceSpansField": "x",
                "resource": {"attributes": [], "futureResourceField": {"deep": [1]}},
                "scopeSpans": [
                    {"futureScopeSpansField": None, "scope": {"name": "lib", "futureScopeField": 1}, "spans": [span]}
                ],
            }
        ],
    }
    d = otlp_json.decode_traces(json.dumps(doc))
    assert d.rejected == 0, d.error
    (s,) = _spans_of(d.message)
    assert s.attributes[0].key == "a" and s.attributes[0].value.string_value == "v"
    assert s.events[0].name == "ev"
    assert s.links[0].span_id == bytes.fromhex(LINK_SPAN_HEX)
    assert s.status.code == Status.STATUS_CODE_OK
    assert d.message.resource_spans[0].scope_spans[0].scope.name == "lib"


def test_unknown_fields_ignored_in_logs():
    doc = {
        "resourceLogs": [
            {
                "resource": {"attributes": [], "zzz": 1},
                "zzz": 2,
                "scopeLogs": [{"scope": {"zzz": 3}, "logRecords": [{"body": {"stringValue": "hi"}, "zzz": 4}], "zzz": 5}],
            }
        ],
        "zzz": 6,
    }
    d = otlp_json.decode_logs(json.dumps(doc))
    assert d.rejected == 0
    assert [r.body.string_value for r in _logs_of(d.message)] == ["hi"]


# --- partial success --------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"startTimeUnixNano": "abc"},
        {"attributes": 5},
        {"status": {"message": ["not", "a", "string"]}},
        {"events": [{"timeUnixNano": "soon"}]},
        {"traceId": 12345},
    ],
    ids=["time-not-int", "attributes-not-list", "status-message-list", "event-time", "id-not-string"],
)
def test_one_badly_typed_span_is_rejected_alone(bad):
    spans = [_span("good1"), _span("bad", **bad), _span("good2")]
    d = otlp_json.decode_traces(_traces(*spans))
    assert d.rejected == 1
    assert "span" in d.error
    assert [s.name for s in _spans_of(d.message)] == ["good1", "good2"]


def test_badly_typed_log_record_is_rejected_alone():
    doc = {
        "resourceLogs": [
            {
                "scopeLogs": [
                    {
                        "logRecords": [
                            {"body": {"stringValue": "one"}},
                            {"body": {"stringValue": "two"}, "timeUnixNano": "yesterday"},
                            {"body": {"stringValue": "three"}},
                        ]
                    }
                ]
            }
        ]
    }
    d = otlp_json.decode_logs(json.dumps(doc))
    assert d.rejected == 1
    assert [r.body.string_value for r in _logs_of(d.message)] == ["one", "three"]


def test_bad_resource_rejects_only_its_own_spans():
    doc = {
        "resourceSpans": [
            {"resource": {"attributes": 7}, "scopeSpans": [{"spans": [_span("lost1"), _span("lost2")]}]},
            {"resource": {}, "scopeSpans": [{"spans": [_span("kept")]}]},
        ]
    }
    d = otlp_json.decode_traces(json.dumps(doc))
    assert d.rejected == 2
    assert "resource" in d.error
    assert [s.name for s in _spans_of(d.message)] == ["kept"]


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("traceId", "zz8efff798038103d269b633813fc60c", "trace_id"),
        ("traceId", "5b8efff798038103d269b633813fc60", "trace_id"),  # odd length
        ("traceId", "5b8efff798038103", "trace_id"),  # valid hex, 8 bytes
        ("spanId", "not-hex!", "span_id"),
        ("parentSpanId", "xyz", "parent_span_id"),
    ],
)
def test_invalid_hex_id_is_rejected_by_validation_with_a_message(field, value, expect):
    spans = [_span("ok"), _span("broken", **{field: value})]
    d = otlp_json.decode_traces(_traces(*spans))
    assert d.rejected == 0  # decoding keeps it; validation refuses it with a reason
    kept, rejected, msg = validate.filter_traces(d.message)
    assert (kept, rejected) == (1, 1)
    assert expect in msg and "broken" in msg
    assert [s.name for s in _spans_of(d.message)] == ["ok"]


def test_invalid_link_id_is_rejected_by_validation():
    d = otlp_json.decode_traces(_traces(_span("l", links=[{"traceId": "nothex", "spanId": LINK_SPAN_HEX}])))
    kept, rejected, msg = validate.filter_traces(d.message)
    assert (kept, rejected) == (0, 1)
    assert "link" in msg


@pytest.mark.parametrize(
    "body",
    [b"not json", b"{", b"[1, 2]", b"42", b'"a string"', b"null", b"\xff\xfe\x00", b""],
    ids=["text", "truncated", "array", "number", "string", "null", "binary", "empty"],
)
def test_not_json_or_not_object_raises(body):
    with pytest.raises(otlp_json.JsonDecodeError):
        otlp_json.decode_traces(body)
    with pytest.raises(otlp_json.JsonDecodeError):
        otlp_json.decode_logs(body)
    with pytest.raises(errors.BadRequest):
        decode.parse("traces", body, decode.JSON)


@pytest.mark.parametrize(
    "doc",
    [{"resourceSpans": 5}, {"resourceSpans": [5]}, {"resourceSpans": [{"scopeSpans": "x"}]}],
)
def test_structurally_wrong_request_raises(doc):
    with pytest.raises(otlp_json.JsonDecodeError):
        otlp_json.decode_traces(json.dumps(doc))


def test_logs_with_trace_and_span_ids():
    doc = {
        "resourceLogs": [
            {
                "scopeLogs": [
                    {
                        "logRecords": [
                            {
                                "timeUnixNano": "1700000000000000000",
                                "observedTimeUnixNano": 1700000000000000001,
                                "severityNumber": 17,
                                "severityText": "ERROR",
                                "traceId": TRACE_HEX,
                                "spanId": SPAN_HEX.lower(),
                                "eventName": "gen_ai.choice",
                                "body": {"stringValue": "x"},
                            },
                            {"body": {"stringValue": "uncorrelated"}},
                            {"traceId": "nothex", "body": {"stringValue": "bad id"}},
                        ]
                    }
                ]
            }
        ]
    }
    d = otlp_json.decode_logs(json.dumps(doc))
    assert d.rejected == 0
    recs = _logs_of(d.message)
    assert recs[0].trace_id == bytes.fromhex(TRACE_HEX)
    assert recs[0].span_id == bytes.fromhex(SPAN_HEX)
    assert recs[0].severity_number == 17
    assert recs[0].time_unix_nano == 1700000000000000000
    assert recs[0].observed_time_unix_nano == 1700000000000000001
    assert recs[0].event_name == "gen_ai.choice"
    assert recs[1].trace_id == b"" and recs[1].span_id == b""
    kept, rejected, msg = validate.filter_logs(d.message)
    assert (kept, rejected) == (2, 1)
    assert "trace_id" in msg


# --- values and round trips -------------------------------------------------------------------


def test_all_anyvalue_kinds_decode():
    raw = b"\x00\x01\xfe\xff"
    attrs = [
        {"key": "s", "value": {"stringValue": "text"}},
        {"key": "i", "value": {"intValue": "7"}},
        {"key": "d", "value": {"doubleValue": 2.5}},
        {"key": "b", "value": {"boolValue": True}},
        {"key": "by", "value": {"bytesValue": base64.b64encode(raw).decode()}},
        {"key": "arr", "value": {"arrayValue": {"values": [{"stringValue": "x"}, {"intValue": 1}, {"arrayValue": {}}]}}},
        {
            "key": "kv",
            "value": {"kvlistValue": {"values": [{"key": "inner", "value": {"doubleValue": "NaN"}}, {"key": "e", "value": {}}]}},
        },
        {"key": "empty", "value": {}},
    ]
    d = otlp_json.decode_traces(_traces(_span(attributes=attrs)))
    assert d.rejected == 0, d.error
    (s,) = _spans_of(d.message)
    v = {kv.key: kv.value for kv in s.attributes}
    assert v["s"].string_value == "text"
    assert v["i"].WhichOneof("value") == "int_value" and v["i"].int_value == 7
    assert v["d"].double_value == 2.5
    assert v["b"].WhichOneof("value") == "bool_value" and v["b"].bool_value is True
    assert v["by"].bytes_value == raw
    arr = v["arr"].array_value.values
    assert [x.WhichOneof("value") for x in arr] == ["string_value", "int_value", "array_value"]
    assert arr[0].string_value == "x" and arr[1].int_value == 1
    kv = v["kv"].kvlist_value.values
    assert kv[0].key == "inner" and kv[0].value.double_value != kv[0].value.double_value  # NaN
    assert kv[1].value.WhichOneof("value") is None
    assert v["empty"].WhichOneof("value") is None


def _full_trace_request() -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.schema_url = "https://opentelemetry.io/schemas/1.26.0"
    rs.resource.attributes.add(key="service.name").value.string_value = "agent"
    ss = rs.scope_spans.add()
    ss.scope.name = "lib"
    ss.scope.version = "2"
    s = ss.spans.add()
    s.trace_id = bytes.fromhex(TRACE_HEX)
    s.span_id = bytes.fromhex(SPAN_HEX)
    s.parent_span_id = bytes.fromhex(PARENT_HEX)
    s.name = "chat gpt-4o"
    s.kind = Span.SPAN_KIND_CLIENT
    s.start_time_unix_nano = 1_700_000_000_123_456_789
    s.end_time_unix_nano = 1_700_000_001_123_456_789
    s.flags = 0x301
    s.trace_state = "vendor=value"
    s.status.code = Status.STATUS_CODE_ERROR
    s.status.message = "rate limited"
    s.attributes.append(KeyValue(key="i", value=AnyValue(int_value=-5)))
    s.attributes.append(KeyValue(key="by", value=AnyValue(bytes_value=b"\x00\xff")))
    arr = s.attributes.add(key="arr").value.array_value.values
    arr.add().double_value = 1.5
    arr.add().bool_value = True
    ev = s.events.add()
    ev.name = "gen_ai.choice"
    ev.time_unix_nano = 1_700_000_000_500_000_000
    ev.attributes.add(key="k").value.string_value = "v"
    ln = s.links.add()
    ln.trace_id = bytes.fromhex(LINK_TRACE_HEX)
    ln.span_id = bytes.fromhex(LINK_SPAN_HEX)
    ln.attributes.add(key="rel").value.string_value = "follows"
    root = ss.spans.add()
    root.trace_id = bytes.fromhex(TRACE_HEX)
    root.span_id = bytes.fromhex(PARENT_HEX)
    root.name = "root"
    return req


def test_encode_round_trip_traces():
    req = _full_trace_request()
    text = otlp_json.encode(req)
    doc = json.loads(text)
    span = doc["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert span["traceId"] == TRACE_HEX.lower()
    assert span["spanId"] == SPAN_HEX.lower()
    assert span["parentSpanId"] == PARENT_HEX
    assert span["links"][0]["spanId"] == LINK_SPAN_HEX.lower()
    assert span["kind"] == 3  # integer enum
    assert span["status"]["code"] == 2
    back = otlp_json.decode_traces(text)
    assert back.rejected == 0
    assert back.message == req


def test_encode_round_trip_logs():
    req = ExportLogsServiceRequest()
    r = req.resource_logs.add().scope_logs.add().log_records.add()
    r.trace_id = bytes.fromhex(TRACE_HEX)
    r.span_id = bytes.fromhex(SPAN_HEX)
    r.time_unix_nano = 1_700_000_000_000_000_001
    r.severity_number = 9
    r.body.kvlist_value.values.add(key="role").value.string_value = "user"
    text = otlp_json.encode(req)
    rec = json.loads(text)["resourceLogs"][0]["scopeLogs"][0]["logRecords"][0]
    assert rec["traceId"] == TRACE_HEX.lower() and rec["spanId"] == SPAN_HEX.lower()
    assert rec["severityNumber"] == 9
    assert otlp_json.decode_logs(text).message == req


def test_metrics_decode_and_count():
    doc = {
        "resourceMetrics": [
            {
                "unknown": 1,
                "scopeMetrics": [
                    {"metrics": [{"name": "m", "gauge": {"dataPoints": [{"asInt": "3"}, {"asDouble": 1.5}]}}]}
                ],
            }
        ]
    }
    d = otlp_json.decode_metrics(json.dumps(doc))
    assert validate.count_metric_points(d.message) == 2
    with pytest.raises(otlp_json.JsonDecodeError):
        otlp_json.decode_metrics(json.dumps({"resourceMetrics": 3}))


def test_parse_protobuf_and_garbage():
    req = _full_trace_request()
    raw = req.SerializeToString()
    p = decode.parse("traces", raw, decode.PROTOBUF)
    assert p.message == req and p.raw == raw
    with pytest.raises(errors.BadRequest):
        decode.parse("traces", b"\xff\xff\xff\xff", decode.PROTOBUF)


# --- decompression --------------------------------------------------------------------------

PAYLOAD = _full_trace_request().SerializeToString() * 50


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(wbits=-15)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    "encoding,compress",
    [
        ("gzip", gzip.compress),
        ("x-gzip", gzip.compress),
        ("GZIP", gzip.compress),
        ("deflate", zlib.compress),  # RFC 9110: zlib-wrapped
        ("deflate", _raw_deflate),  # what some clients send
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
        (None, lambda b: b),
        ("identity", lambda b: b),
    ],
    ids=["gzip", "x-gzip", "GZIP", "deflate-zlib", "deflate-raw", "zstd", "none", "identity"],
)
def test_decompress_round_trip(encoding, compress):
    assert decode.decompress(compress(PAYLOAD), encoding, 1 << 20) == PAYLOAD


def test_decompress_zstd_stream_without_content_size():
    cctx = zstandard.ZstdCompressor()
    co = cctx.compressobj()
    body = co.compress(PAYLOAD) + co.flush()
    assert decode.decompress(body, "zstd", 1 << 20) == PAYLOAD


def test_identity_over_limit_is_too_large():
    with pytest.raises(errors.TooLarge):
        decode.decompress(b"x" * 1025, None, 1024)


def test_output_just_over_limit_is_too_large_for_every_encoding():
    data = b"a" * 4097
    for enc, body in [("gzip", gzip.compress(data)), ("deflate", zlib.compress(data)),
                      ("zstd", zstandard.ZstdCompressor().compress(data))]:
        with pytest.raises(errors.TooLarge):
            decode.decompress(body, enc, 4096)
        assert decode.decompress(body, enc, 4097) == data


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    c = zlib.compressobj(level=9, wbits=31)
    zeros = bytes(1 << 20)
    parts = [c.compress(zeros) for _ in range(200)]  # 200 MiB of zeros
    parts.append(c.flush())
    return b"".join(parts)


def _peak_alloc(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_gzip_bomb_is_refused_without_inflating_it(gzip_bomb):
    assert len(gzip_bomb) < 1 << 20  # a small body...

    def run():
        with pytest.raises(errors.TooLarge):
            decode.decompress(gzip_bomb, "gzip", 1 << 20)

    # ...refused having held a few MiB at most, not the 200 MiB it expands to
    assert _peak_alloc(run) < 16 << 20


def test_deflate_bomb_is_refused_without_inflating_it():
    c = zlib.compressobj(level=9)
    zeros = bytes(1 << 20)
    body = b"".join(c.compress(zeros) for _ in range(64)) + c.flush()

    def run():
        with pytest.raises(errors.TooLarge):
            decode.decompress(body, "deflate", 1 << 20)

    assert _peak_alloc(run) < 16 << 20


def test_zstd_bomb_is_refused_without_inflating_it():
    body = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    assert len(body) < 16384  # one slice holds the whole bomb

    def run():
        with pytest.raises(errors.TooLarge):
            decode.decompress(body, "zstd", 1 << 20)

    assert _peak_alloc(run) < 16 << 20


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_truncated_body_is_bad_request(encoding):
    body = gzip.compress(PAYLOAD) if encoding == "gzip" else zlib.compress(PAYLOAD)
    with pytest.raises(errors.BadRequest, match="truncated"):
        decode.decompress(body[: len(body) // 2], encoding, 1 << 20)


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "zstd"])
def test_garbage_body_is_bad_request(encoding):
    with pytest.raises(errors.BadRequest):
        decode.decompress(b"this is not compressed at all" * 3, encoding, 1 << 20)


def test_truncated_zstd_is_bad_request():
    body = zstandard.ZstdCompressor().compress(PAYLOAD)
    with pytest.raises(errors.BadRequest):
        decode.decompress(body[: len(body) // 2], "zstd", 1 << 20)


def test_multi_member_gzip_is_fully_decoded():
    body = gzip.compress(b"first;") + gzip.compress(b"second")
    assert decode.decompress(body, "gzip", 1 << 20) == b"first;second"


def test_multi_frame_zstd_is_fully_decoded():
    c = zstandard.ZstdCompressor()
    body = c.compress(b"first;") + c.compress(b"second")
    assert decode.decompress(body, "zstd", 1 << 20) == b"first;second"


@pytest.mark.parametrize("encoding", ["br", "compress", "lz4", "gzip, br"])
def test_unknown_encoding_is_unsupported(encoding):
    with pytest.raises(errors.UnsupportedMediaType):
        decode.decompress(b"abc", encoding, 1 << 20)


@pytest.mark.parametrize(
    "content_type,expect",
    [
        ("application/json; charset=utf-8", decode.JSON),
        ("application/json", decode.JSON),
        ("Application/JSON ;charset=UTF-8", decode.JSON),
        ("application/x-protobuf", decode.PROTOBUF),
        ("application/x-protobuf; proto=opentelemetry", decode.PROTOBUF),
    ],
)
def test_media_type(content_type, expect):
    assert decode.media_type(content_type) == expect


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/grpc", "application/jsonx"])
def test_media_type_refuses_others(content_type):
    with pytest.raises(errors.UnsupportedMediaType):
        decode.media_type(content_type)
