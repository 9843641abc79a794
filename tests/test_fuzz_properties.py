"""Property tests (hypothesis) on the collector's decoders: whatever bytes or JSON
arrive, each raises only its own refusal, which the transports map to the
spec's codes; never anything else (which would be a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nightshift.collector import decode, feedback, otlp_json
from nightshift.collector.errors import BadRequest, TooLarge
from nightshift.collector.http_server import make_post

LIMIT = 1 << 16
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=20,
)
OTLP_KEYS = ["resourceSpans", "scopeSpans", "spans", "traceId", "spanId", "name", "attributes", "key", "value",
             "stringValue", "arrayValue", "values", "kvlistValue", "startTimeUnixNano", "resourceLogs", "scopeLogs",
             "logRecords", "body", "resource", "scope", "events", "links", "status", "intValue", "doubleValue"]
otlp_like = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.text(max_size=40)
    | st.sampled_from(["5b8efff798038103d269b633813fc60c", "5b8efff798038103", "NaN", "-1", "zz"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(OTLP_KEYS), kids, max_size=5),
    max_leaves=30,
)


@FAST
@given(st.binary(max_size=2048), st.sampled_from(["gzip", "deflate", "zstd", "identity", None]))
def test_decompress_raises_only_refusals(body, encoding):
    try:
        out = decode.decompress(body, encoding, LIMIT)
        assert len(out) <= LIMIT
    except (BadRequest, TooLarge):
        pass


@FAST
@given(st.binary(max_size=2048), st.sampled_from(["traces", "logs", "metrics"]),
       st.sampled_from([decode.PROTOBUF, decode.JSON]))
def test_parse_raises_only_bad_request(body, signal, media):
    try:
        decode.parse(signal, body, media)
    except BadRequest:
        pass


@FAST
@given(st.dictionaries(st.sampled_from(["resourceSpans", "resourceLogs", "resourceMetrics"]), otlp_like, min_size=1),
       st.sampled_from(["traces", "logs", "metrics"]))
def test_otlp_json_shaped_documents_raise_only_decode_errors(doc, signal):
    try:
        d = otlp_json.DECODERS[signal](json.dumps(doc))
        assert d.rejected >= 0
    except otlp_json.JsonDecodeError:
        pass


@FAST
@given(json_values)
def test_any_feedback_body_is_stored_whole_or_refused_with_reasons(doc):
    try:
        records = feedback.parse_request(json.dumps(doc).encode())
    except feedback.InvalidFeedback as e:
        assert str(e)
        return
    for r in records:  # what is accepted is what the dataset can hold
        assert r["value"] == r["value"] and abs(r["value"]) != float("inf")
        feedback.encode([r]).decode("utf-8")


@pytest.fixture(scope="module")
def post(tmp_path_factory):
    """The HTTP POST handler over a real log (no fsync), as the server runs it."""
    from nightshift.collector import wal
    from nightshift.collector.metrics import Metrics
    from nightshift.collector.pipeline import Pipeline
    from nightshift.collector.redact import Redactor

    log = wal.WriteAheadLog(tmp_path_factory.mktemp("wal"), sync=False)
    log.open()
    yield make_post(Pipeline(log, Redactor.from_config(["api_key", "bearer"], [], []), Metrics(), 8), token="", limit=LIMIT)
    log.close()


@FAST
@given(st.binary(max_size=1024), st.sampled_from(["/v1/traces", "/v1/logs", "/v1/metrics", "/v1/feedback", "/x"]),
       st.sampled_from(["application/x-protobuf", "application/json", "text/plain", ""]),
       st.sampled_from([None, "gzip", "zstd", "br"]))
def test_the_http_handler_answers_every_body_with_a_spec_code(post, body, path, ctype, encoding):
    headers = {"content-type": ctype}
    if encoding:
        headers["content-encoding"] = encoding
    r = post(path, headers, lambda: body, "client")
    assert r.code in (200, 400, 404, 413, 415), (r.code, r.body)
