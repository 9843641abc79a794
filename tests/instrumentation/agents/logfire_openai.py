"""The plain `openai` scenarios with Pydantic Logfire: `logfire.configure(
send_to_logfire=False)` exports to OTEL_EXPORTER_OTLP_ENDPOINT by itself (service
name from OTEL_SERVICE_NAME), and `logfire.instrument_openai()`.
Usage: `python logfire_openai.py SCENARIO`."""

import json
import sys

import logfire
from openai import OpenAI
from opentelemetry import trace

from scenarios import SCENARIOS

logfire.configure(send_to_logfire=False, console=False)
logfire.instrument_openai()

result = SCENARIOS[sys.argv[1]](OpenAI(), trace.get_tracer("nightshift.live.app"))
logfire.shutdown()
print(json.dumps(result))
