"""A plain `openai` program with no telemetry code of its own beyond agent spans
through the OpenTelemetry API: run it under `opentelemetry-instrument` (zero-code),
configured only by OTEL_* variables, with OPENAI_BASE_URL/OPENAI_API_KEY for the
client. Usage: `opentelemetry-instrument python plain_openai.py SCENARIO`."""

import json
import sys

from openai import OpenAI
from opentelemetry import trace

from scenarios import SCENARIOS

scenario = sys.argv[1]
client = OpenAI()
tracer = trace.get_tracer("nightshift.live.app")
print(json.dumps(SCENARIOS[scenario](client, tracer)))
