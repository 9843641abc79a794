"""pydantic-ai 2.x programs, written as a user writes them, traced and exported over
OTLP/HTTP configured by OTEL_* variables only. The model is `openai-chat:<model>`
(OpenAIChatModel, Chat Completions API) reached through OPENAI_BASE_URL; in 2.x a
bare `openai:` prefix means the Responses API, which the stub does not serve.

PYDANTIC_AI_INSTRUMENT:
- `builtin` (default): pydantic-ai's own instrumentation, `Agent.instrument_all()`,
  on a global OTel SDK TracerProvider with an OTLP/HTTP exporter
  (PYDANTIC_AI_INSTRUMENT_VERSION=6: `InstrumentationSettings(version=6)`);
- `logfire`: `logfire.configure(send_to_logfire=False)` (exports to
  OTEL_EXPORTER_OTLP_ENDPOINT by itself) + `logfire.instrument_pydantic_ai()`.

Scenarios:
- `tool`: `Agent(name="weather_agent")` with a `get_weather` tool: the model asks for
  the tool, pydantic-ai runs it and sends the result, the model answers (2 LLM calls);
- `three_agents`: agents "writer", "checker" and "rewriter" run one after another,
  each fed the previous output, inside one caller span `article` (3 LLM calls);
- `three_agents_nospan`: the same without a caller span (each run its own trace);
- `three_agents_conversation`: as `three_agents_nospan`, every run given `conversation_id="article-1"`.

Prints one JSON line: the agent name of each LLM call in order (`agents`, from each
run's own message history: one ModelResponse per request), `calls`, the answers.
Usage: `python pydantic_ai_app.py SCENARIO`."""

import json
import os
import sys

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
INSTRUMENT = os.environ.get("PYDANTIC_AI_INSTRUMENT", "builtin")
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather in Paris today?"
AGENT_PROMPTS = {
    "writer": ("You write a short paragraph on the topic you are given.", "Write about lighthouses."),
    "checker": ("You check a paragraph for factual errors and list them.", None),
    "rewriter": ("You rewrite a paragraph, fixing the errors listed.", None),
}

if INSTRUMENT == "logfire":
    import logfire

    logfire.configure(send_to_logfire=False, console=False)
    logfire.instrument_pydantic_ai()
    shutdown = logfire.shutdown
    caller_span = logfire.span
else:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    shutdown = provider.shutdown
    caller_span = trace.get_tracer("nightshift.live.app").start_as_current_span

from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelResponse  # noqa: E402

if INSTRUMENT != "logfire":
    if os.environ.get("PYDANTIC_AI_INSTRUMENT_VERSION"):  # data-format version (default 5; 6 = tool results as role tool)
        from pydantic_ai.models.instrumented import InstrumentationSettings

        Agent.instrument_all(InstrumentationSettings(version=int(os.environ["PYDANTIC_AI_INSTRUMENT_VERSION"])))
    else:
        Agent.instrument_all()

CALLS: list[str | None] = []


def run(agent: Agent, prompt: str, **kw) -> str:
    r = agent.run_sync(prompt, **kw)
    CALLS.extend(agent.name for m in r.new_messages() if isinstance(m, ModelResponse))
    return r.output


def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


def tool() -> dict:
    agent = Agent(f"openai-chat:{MODEL}", name="weather_agent", instructions=SYSTEM, tools=[get_weather])
    return {"answers": [run(agent, QUESTION)]}


def _three(**kw) -> list[str]:
    text, answers = None, []
    for name, (system, task) in AGENT_PROMPTS.items():
        agent = Agent(f"openai-chat:{MODEL}", name=name, instructions=system)
        text = run(agent, task or text, **kw)
        answers.append(text)
    return answers


def three_agents() -> dict:
    with caller_span("article"):
        return {"answers": _three()}


def three_agents_nospan() -> dict:
    return {"answers": _three()}


def three_agents_conversation() -> dict:
    return {"answers": _three(conversation_id="article-1")}


out = {"tool": tool, "three_agents": three_agents, "three_agents_nospan": three_agents_nospan,
       "three_agents_conversation": three_agents_conversation}[sys.argv[1]]()
shutdown()
print(json.dumps({"agents": CALLS, "calls": len(CALLS), "instrument": INSTRUMENT, **out}))
