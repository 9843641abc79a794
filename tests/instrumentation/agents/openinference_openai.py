"""The plain `openai` scenarios with Arize OpenInference's documented programmatic
setup: an SDK TracerProvider with an OTLP/HTTP exporter (endpoint, service name and
the rest from OTEL_* variables) and `OpenAIInstrumentor().instrument()`.
Usage: `python openinference_openai.py SCENARIO`."""

import json
import sys

from openinference.instrumentation.openai import OpenAIInstrumentor
from openai import OpenAI
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from scenarios import SCENARIOS

provider = TracerProvider()  # resource from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
OpenAIInstrumentor().instrument(tracer_provider=provider)

result = SCENARIOS[sys.argv[1]](OpenAI(), trace.get_tracer("nightshift.live.app"))
provider.shutdown()
print(json.dumps(result))
