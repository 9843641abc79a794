"""A small instrumented program, configured only through OTEL_* environment variables
(endpoint, protocol, compression, headers, certificate, service name), the way a
user's agent is. It emits GenAI-shaped spans (every attribute type, events,
links, an error status), correlated log records and a metric, then prints the ids
of what it created as JSON on stdout."""

import json
import os
import sys

from opentelemetry import metrics, trace
from opentelemetry._logs import SeverityNumber
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
if protocol == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
else:
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
resource = Resource.create()  # service.name from OTEL_SERVICE_NAME
tp = TracerProvider(resource=resource)
tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
lp = LoggerProvider(resource=resource)
lp.add_log_record_processor(BatchLogRecordProcessor(OTLPLogExporter()))
mp = MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=60_000)])
tracer = tp.get_tracer("nightshift.test.app", "1.2.3")
logger = lp.get_logger("nightshift.test.app")
counter = mp.get_meter("nightshift.test.app").create_counter("agent.calls")

out = []
for i in range(N):
    with tracer.start_as_current_span("invoke_agent writer", kind=trace.SpanKind.INTERNAL) as root:
        root.set_attribute("gen_ai.operation.name", "invoke_agent")
        root.set_attribute("gen_ai.agent.name", "writer")
        with tracer.start_as_current_span(
            "chat gpt-4o",
            kind=trace.SpanKind.CLIENT,
            links=[trace.Link(root.get_span_context(), {"link.kind": "root"})],
        ) as span:
            span.set_attribute("gen_ai.operation.name", "chat")
            span.set_attribute("gen_ai.system", "openai")
            span.set_attribute("gen_ai.request.model", "gpt-4o")
            span.set_attribute("gen_ai.usage.input_tokens", 100 + i)
            span.set_attribute("gen_ai.request.temperature", 0.25)
            span.set_attribute("gen_ai.request.stream", False)
            span.set_attribute("gen_ai.response.finish_reasons", ["stop", "length"])
            span.set_attribute("gen_ai.input.messages", json.dumps([{"role": "user", "parts": [{"type": "text", "content": f"question {i}"}]}]))
            span.add_event("gen_ai.content.prompt", {"gen_ai.prompt": f"question {i}", "attempt": 1})
            span.set_status(trace.Status(trace.StatusCode.ERROR, "rate limited"))
            logger.emit(
                body={"content": f"answer {i}", "role": "assistant"},
                severity_number=SeverityNumber.INFO,
                event_name="gen_ai.choice",
                attributes={"gen_ai.system": "openai"},
            )
            counter.add(1)
            ctx = span.get_span_context()
            out.append({"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                        "root_span_id": f"{root.get_span_context().span_id:016x}"})

tp.shutdown()
lp.shutdown()
mp.shutdown()
print(json.dumps(out))
