"""Request builders and raw clients shared by the end-to-end tests."""

from __future__ import annotations

import gzip
import http.client
import os
import subprocess
import sys
from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

APP = Path(__file__).parent.parent / "examples" / "otel_app.py"


def make_request(n: int = 3, *, content: str = "hello", service: str = "svc", bad: int = 0, start_ns: int = 1_763_800_000_000_000_000) -> tuple[ExportTraceServiceRequest, list[tuple[str, str]]]:
    """A request of `n` valid spans with random ids (+ `bad` spans with a short trace id)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=service)))
    ss = rs.scope_spans.add()
    ss.scope.name = "test"
    ids = []
    for i in range(n):
        s = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=f"chat {i}", kind=3,
                 start_time_unix_nano=start_ns + i, end_time_unix_nano=start_ns + i + 1000)
        s.attributes.append(KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat")))
        s.attributes.append(KeyValue(key="content", value=AnyValue(string_value=content)))
        ss.spans.append(s)
        ids.append((s.trace_id.hex(), s.span_id.hex()))
    for i in range(bad):
        ss.spans.append(Span(trace_id=b"short", span_id=os.urandom(8), name=f"bad {i}"))
    return req, ids


def post(port: int, path: str, body: bytes, content_type: str = "application/x-protobuf", headers: dict | None = None,
         gz: bool = False) -> tuple[int, dict, bytes]:
    h = {"Content-Type": content_type, **(headers or {})}
    if gz:
        body = gzip.compress(body)
        h["Content-Encoding"] = "gzip"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def grpc_export(port: int, body: bytes, service: str = "opentelemetry.proto.collector.trace.v1.TraceService",
                metadata=None, timeout: float = 30):
    """Calls Export with raw bytes; returns (response bytes or None, error or None)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 256 << 20)]) as ch:
        call = ch.unary_unary(f"/{service}/Export")
        try:
            return call(body, metadata=metadata, timeout=timeout), None
        except grpc.RpcError as e:
            return None, e


def run_app(endpoint: str, protocol: str, n: int = 3, extra_env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    # requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override the exporter's own
    # certificate setting; an agent's environment would not have them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k not in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
    env.update({
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_SERVICE_NAME": "test-agent",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_BLRP_SCHEDULE_DELAY": "100",
        **(extra_env or {}),
    })
    return subprocess.run([sys.executable, str(APP), str(n)], env=env, capture_output=True, text=True, timeout=timeout)
