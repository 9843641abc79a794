"""CrewAI 1.x programs, written as a user writes them, traced with the instrumentors
named in CREWAI_INSTRUMENT and exported over OTLP/HTTP configured by OTEL_* variables.
The model is reached through OPENAI_BASE_URL (CrewAI's native OpenAI provider, Chat
Completions API; no litellm).

CREWAI_INSTRUMENT:
- `openinference`: openinference-instrumentation-crewai (`CrewAIInstrumentor`) and
  openinference-instrumentation-openai (`OpenAIInstrumentor`) for the LLM calls;
  CREWAI_OI_EVENT_LISTENER=1 passes `use_event_listener=True` (its event-bus mode,
  which makes LLM spans of its own from CrewAI's LLM events);
- `openllmetry`: OpenLLMetry's opentelemetry-instrumentation-crewai and
  opentelemetry-instrumentation-openai (`CrewAIInstrumentor`, `OpenAIInstrumentor`).
The tracer provider is made the global one before crewai is imported. CrewAI's own
telemetry and tracing are turned off by CREWAI_DISABLE_TELEMETRY=true,
CREWAI_DISABLE_TRACKING=true and CREWAI_TRACING_ENABLED=false (set here if unset).

Scenarios:
- `crew`: a sequential crew, agents "researcher" and "writer", one task each (the
  writer's task gets the researcher's output as context); no tools.
- `tool`: one agent "weather reporter" with a `get_weather` tool: the model asks for
  the tool, CrewAI runs it and sends the result, the model answers.
Every agent has max_iter=3 (CrewAI's own cap) in case the stub's answers make it loop.

Prints one JSON line: the agent role of each LLM call in order (`agents`, from
CrewAI's LLMCallStartedEvent), `calls`, and the crew's output.
Usage: `python crewai_app.py SCENARIO`."""

import json
import os
import sys

for _k, _v in (("CREWAI_DISABLE_TELEMETRY", "true"), ("CREWAI_DISABLE_TRACKING", "true"),
               ("CREWAI_TRACING_ENABLED", "false")):
    os.environ.setdefault(_k, _v)

from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
INSTRUMENT = os.environ.get("CREWAI_INSTRUMENT", "openinference")

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
if INSTRUMENT == "openinference":
    from openinference.instrumentation.crewai import CrewAIInstrumentor
    from openinference.instrumentation.openai import OpenAIInstrumentor

    CrewAIInstrumentor().instrument(tracer_provider=provider,
                                    use_event_listener=os.environ.get("CREWAI_OI_EVENT_LISTENER") == "1")
    OpenAIInstrumentor().instrument(tracer_provider=provider)
elif INSTRUMENT == "openllmetry":
    from opentelemetry.instrumentation.crewai import CrewAIInstrumentor
    from opentelemetry.instrumentation.openai import OpenAIInstrumentor

    CrewAIInstrumentor().instrument(tracer_provider=provider)
    OpenAIInstrumentor().instrument(tracer_provider=provider)
else:
    raise SystemExit(f"unknown CREWAI_INSTRUMENT {INSTRUMENT!r}")

from crewai import LLM, Agent, Crew, Process, Task  # noqa: E402
from crewai.events import LLMCallStartedEvent, crewai_event_bus  # noqa: E402
from crewai.tools import tool  # noqa: E402

STARTED: list = []  # (timestamp, agent role) per LLM call


@crewai_event_bus.on(LLMCallStartedEvent)
def _started(source, event):
    STARTED.append((str(event.timestamp), getattr(event, "agent_role", None)))


@tool("get_weather")
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


def llm() -> LLM:
    return LLM(model=MODEL)  # api key and base URL from OPENAI_API_KEY / OPENAI_BASE_URL


def crew() -> Crew:
    researcher = Agent(role="researcher", goal="Find three facts about the topic.",
                       backstory="You research topics carefully.", llm=llm(), max_iter=3, verbose=False)
    writer = Agent(role="writer", goal="Write a short paragraph from the facts.",
                   backstory="You write clear prose.", llm=llm(), max_iter=3, verbose=False)
    research = Task(description="Find three facts about lighthouses.", expected_output="Three facts.",
                    agent=researcher)
    write = Task(description="Write a short paragraph about lighthouses from the facts.",
                 expected_output="One paragraph.", agent=writer, context=[research])
    return Crew(agents=[researcher, writer], tasks=[research, write], process=Process.sequential, verbose=False)


def tool_crew() -> Crew:
    reporter = Agent(role="weather reporter", goal="Report the weather for the city asked about.",
                     backstory="You always check the weather tool.", llm=llm(), tools=[get_weather], max_iter=3,
                     verbose=False)
    report = Task(description="What is the weather in Paris today?", expected_output="One sentence.",
                  agent=reporter)
    return Crew(agents=[reporter], tasks=[report], process=Process.sequential, verbose=False)


result = {"crew": crew, "tool": tool_crew}[sys.argv[1]]().kickoff()
crewai_event_bus.flush()
provider.shutdown()
agents = [role for _, role in sorted(STARTED, key=lambda x: x[0])]
print(json.dumps({"agents": agents, "calls": len(agents), "instrument": INSTRUMENT,
                  "outputs": [t.raw for t in result.tasks_output]}))
