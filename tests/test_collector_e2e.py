"""The collector as users run it: a real process, real OpenTelemetry SDK exporters in
subprocesses configured only by OTEL_* variables, real gRPC and HTTP on loopback."""

from __future__ import annotations

import gzip
import json
import urllib.request

import grpc
import polars as pl
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from conftest import read_logs, read_spans
from helpers import grpc_export, make_request, post, run_app

MODES = {
    "grpc": ("grpc", {}),
    "grpc-gzip": ("grpc", {"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}),
    "http-protobuf": ("http/protobuf", {}),
    "http-protobuf-gzip": ("http/protobuf", {"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip"}),
}


def _attr(row_attrs, key):
    for kv in row_attrs:
        if kv["key"] == key:
            return kv["value"]
    raise KeyError(key)


@pytest.mark.parametrize("mode", list(MODES))
def test_sdk_program_spans_logs_and_metrics_reach_parquet(collector, mode):
    protocol, env = MODES[mode]
    endpoint = collector.grpc_url if protocol == "grpc" else collector.http_url
    proc = run_app(endpoint, protocol, n=3, extra_env=env)
    assert proc.returncode == 0, proc.stderr
    created = json.loads(proc.stdout)
    assert "Failed to export" not in proc.stderr, proc.stderr

    metrics = urllib.request.urlopen(f"{collector.http_url}/metrics").read().decode()
    assert 'nightshift_accepted_total{signal="metrics"}' in metrics
    assert collector.stop() == 0  # SIGTERM drains and flushes

    spans = read_spans(collector.data)
    assert spans.height == 6  # 3 chat spans + 3 invoke_agent roots, each once
    chat = spans.filter(pl.col("gen_ai_operation_name") == "chat").sort("start_time")
    assert set(zip(chat["trace_id"], chat["span_id"])) == {(c["trace_id"], c["span_id"]) for c in created}
    row = chat.row(0, named=True)
    assert row["service_name"] == "test-agent"
    assert row["kind"] == "client"
    assert row["status_code"] == "error" and row["status_message"] == "rate limited"
    assert row["gen_ai_provider_name"] == "openai"  # from the older gen_ai.system
    assert row["gen_ai_request_model"] == "gpt-4o"
    assert row["parent_span_id"] == created[0]["root_span_id"]
    assert row["scope_name"] == "nightshift.test.app" and row["scope_version"] == "1.2.3"
    a = row["attributes"]
    assert _attr(a, "gen_ai.usage.input_tokens") == {**_attr(a, "gen_ai.usage.input_tokens"), "type": "int", "int_value": 100}
    assert _attr(a, "gen_ai.request.temperature")["double_value"] == 0.25
    assert _attr(a, "gen_ai.request.stream")["type"] == "bool" and _attr(a, "gen_ai.request.stream")["bool_value"] is False
    fr = _attr(a, "gen_ai.response.finish_reasons")
    assert fr["type"] == "array" and json.loads(fr["json_value"]) == ["stop", "length"]
    assert row["events"][0]["name"] == "gen_ai.content.prompt"
    assert _attr(row["events"][0]["attributes"], "attempt")["int_value"] == 1
    assert row["links"][0]["span_id"] == created[0]["root_span_id"]
    assert _attr(row["links"][0]["attributes"], "link.kind")["string_value"] == "root"
    assert row["end_time"] >= row["start_time"]
    assert row["date"] is not None
    roots = spans.filter(pl.col("parent_span_id").is_null())
    assert roots.height == 3 and set(roots["gen_ai_agent_name"]) == {"writer"}

    logs = read_logs(collector.data)
    assert logs.height == 3
    assert set(zip(logs["trace_id"], logs["span_id"])) == {(c["trace_id"], c["span_id"]) for c in created}
    body = logs.row(0, named=True)["body"]
    assert body["type"] == "kvlist" and json.loads(body["json_value"])["role"] == "assistant"
    assert set(logs["event_name"]) == {"gen_ai.choice"}
    # Nothing left in the log after a clean shutdown.
    assert not list(collector.wal.glob("*.sealed")) and not list(collector.wal.glob("*.active"))


def test_otlp_json_over_http_with_gzip_answers_json(collector):
    doc = {
        "resourceSpans": [{
            "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "json-svc"}}]},
            "scopeSpans": [{
                "scope": {"name": "manual"},
                "spans": [
                    {"traceId": "5B8EFFF798038103D269B633813FC60C", "spanId": "EEE19B7EC3C1B174",
                     "parentSpanId": "EEE19B7EC3C1B173", "name": "chat", "kind": 3,
                     "startTimeUnixNano": "1544712660000000000", "endTimeUnixNano": 1544712661000000000,
                     "attributes": [{"key": "n", "value": {"intValue": "42"}}],
                     "status": {"code": 2}, "someFutureField": {"x": 1}},
                    {"traceId": "not-hex", "spanId": "EEE19B7EC3C1B175", "name": "bad ids"},
                ],
            }],
        }]
    }
    status, headers, body = post(collector.http_port, "/v1/traces", json.dumps(doc).encode(), "application/json", gz=True)
    assert status == 200
    assert headers["content-type"] == "application/json"
    answer = json.loads(body)
    assert answer["partialSuccess"]["rejectedSpans"] == "1"
    assert "trace_id" in answer["partialSuccess"]["errorMessage"]
    assert collector.stop() == 0
    spans = read_spans(collector.data)
    assert spans.height == 1
    r = spans.row(0, named=True)
    assert (r["trace_id"], r["span_id"], r["parent_span_id"]) == ("5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174", "eee19b7ec3c1b173")
    assert r["status_code"] == "error" and r["service_name"] == "json-svc"
    assert str(r["date"]) == "2018-12-13"


def test_http_refusals_follow_the_spec(collector_factory):
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES": "1MiB"}).start()
    port = c.http_port
    # Undecodable protobuf: 400 with a google.rpc.Status protobuf body.
    status, h, body = post(port, "/v1/traces", b"\xff\xff\xff garbage")
    assert status == 400 and h["content-type"] == "application/x-protobuf"
    assert "not a valid protobuf" in status_pb2.Status.FromString(body).message
    # Undecodable JSON: 400 with a JSON status.
    status, h, body = post(port, "/v1/traces", b"{not json", "application/json")
    assert status == 400 and "not valid JSON" in json.loads(body)["message"]
    # Unknown content type, unknown path.
    assert post(port, "/v1/traces", b"x", "text/plain")[0] == 415
    assert post(port, "/v1/nothing", b"")[0] == 404
    # Over the size limit: declared, and after decompression (a gzip bomb).
    assert post(port, "/v1/traces", b"\0" * (2 << 20))[0] == 413
    bomb = gzip.compress(b"\0" * (64 << 20))
    assert len(bomb) < (1 << 20)
    assert post(port, "/v1/traces", bomb, headers={"Content-Encoding": "gzip"})[0] == 413
    assert post(port, "/v1/traces", b"abc", headers={"Content-Encoding": "brotli-x"})[0] == 415
    # Empty request: success with an empty partial_success.
    status, _, body = post(port, "/v1/traces", b"")
    assert status == 200 and not ExportTraceServiceResponse.FromString(body).HasField("partial_success")
    # One bad span among good ones: partial success, the good ones stored.
    req, ids = make_request(4, bad=1)
    status, _, body = post(port, "/v1/traces", req.SerializeToString())
    resp = ExportTraceServiceResponse.FromString(body)
    assert status == 200 and resp.partial_success.rejected_spans == 1
    assert "trace_id must be 16" in resp.partial_success.error_message
    # Duplicates: the same request twice (a client resending after a slow ack).
    req2, ids2 = make_request(5)
    for _ in range(2):
        assert post(port, "/v1/traces", req2.SerializeToString())[0] == 200
    # The server still answers after all of that.
    assert c.health()["status"] == "ok"
    metrics = urllib.request.urlopen(f"{c.http_url}/metrics").read().decode()
    assert 'nightshift_refused_requests_total{reason="too_large",signal="traces"} 2.0' in metrics
    assert c.stop() == 0
    spans = read_spans(c.data)
    assert sorted(zip(spans["trace_id"], spans["span_id"])) == sorted(ids + ids2)


def test_grpc_refusals_follow_the_spec(collector_factory):
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES": "1MiB"}).start()
    _, err = grpc_export(c.grpc_port, b"\xff\xff\xff garbage")
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    req, _ = make_request(1, content="x" * (2 << 20))
    _, err = grpc_export(c.grpc_port, req.SerializeToString())
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    resp, err = grpc_export(c.grpc_port, b"")
    assert err is None and not ExportTraceServiceResponse.FromString(resp).HasField("partial_success")
    req, ids = make_request(3, bad=2)
    resp, err = grpc_export(c.grpc_port, req.SerializeToString())
    assert err is None and ExportTraceServiceResponse.FromString(resp).partial_success.rejected_spans == 2
    for _ in range(2):  # resent: stored once
        assert grpc_export(c.grpc_port, req.SerializeToString())[1] is None
    assert c.stop() == 0
    spans = read_spans(c.data)
    assert sorted(zip(spans["trace_id"], spans["span_id"])) == sorted(ids)


def test_metrics_show_flusher_progress_without_a_health_check(collector):
    req, ids = make_request(7)
    assert post(collector.http_port, "/v1/traces", req.SerializeToString())[0] == 200
    import time

    deadline = time.time() + 30
    text = ""
    while time.time() < deadline:
        text = urllib.request.urlopen(f"{collector.http_url}/metrics").read().decode()
        if 'nightshift_flushed{signal="traces"} 7.0' in text:
            break
        time.sleep(0.2)
    else:
        pytest.fail("flushed count never reached /metrics:\n" + text[-2000:])
    assert 'nightshift_accepted_total{signal="traces"} 7.0' in text
    assert "nightshift_wal_bytes" in text and "nightshift_flush_lag_seconds" in text
    assert "nightshift_ack_seconds_bucket" in text
