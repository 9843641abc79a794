"""A plain `openai` scenario inside an `episode` span that records its outcome as
the attribute `episode.reward`, the way an application scores its own runs (the
demo's agent does the same). Nightshift reads a reward from it only when told the
key (`--reward-keys episode.reward`): what `nightshift doctor` must point out.
Run it under `opentelemetry-instrument` like `plain_openai.py`.
Usage: `opentelemetry-instrument python episode_app.py SCENARIO`."""

import json
import sys

from openai import OpenAI
from opentelemetry import trace

from scenarios import SCENARIOS

scenario = sys.argv[1]
tracer = trace.get_tracer("nightshift.live.app")
with tracer.start_as_current_span("episode") as episode:
    result = SCENARIOS[scenario](OpenAI(), tracer)
    episode.set_attribute("episode.reward", 1.0 if result["answers"][-1] else 0.0)
print(json.dumps(result))
