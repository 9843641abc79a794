"""OpenAI Agents SDK programs traced with OpenTelemetry's own bridge,
opentelemetry-instrumentation-openai-agents-v2 (`OpenAIAgentsInstrumentor`: a
TracingProcessor that turns the SDK's traces into GenAI spans), exported over
OTLP/HTTP configured by OTEL_* variables. Content capture in span-only mode:
OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only (set here if unset).
The model is reached through OPENAI_BASE_URL with the Chat Completions API.

Unlike OpenInference's bridge, this instrumentor ADDS its processor next to the
SDK's default one, which exports every trace to OpenAI's backend with
OPENAI_API_KEY; the program drops that one first (`set_trace_processors([])`) so
nothing leaves the machine.

Scenarios (as openai_agents_app.py): `one_call` (an agent without tools),
`tool_loop` (agent "weather_agent" with a function tool: tool call, tool run,
answer), `three_agents` (writer, checker and rewriter Agents run one after the
other inside one `trace("article")`), `three_agents_nospan` (the same without it:
each Runner.run is its own SDK trace).

Prints one JSON line: the agent name of each LLM call in order (`agents`, from the
SDK's own `RunHooks.on_llm_start`), `calls`, the answers.
Usage: `python openai_agents_otel_app.py SCENARIO`."""

import asyncio
import json
import os
import sys

os.environ.setdefault("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "span_only")

from agents import (  # noqa: E402
    Agent, RunHooks, Runner, function_tool, set_default_openai_api, set_trace_processors, trace as agents_trace)
from opentelemetry import trace  # noqa: E402
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: E402
from opentelemetry.instrumentation.openai_agents import OpenAIAgentsInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
set_trace_processors([])  # no export to OpenAI's tracing backend
OpenAIAgentsInstrumentor().instrument(tracer_provider=provider)
set_default_openai_api("chat_completions")

CALLS: list[str | None] = []


class Hooks(RunHooks):
    async def on_llm_start(self, context, agent, system_prompt, input_items) -> None:
        CALLS.append(agent.name)


HOOKS = Hooks()


@function_tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


async def one_call() -> dict:
    agent = Agent(name="greeter", instructions="You are a helpful assistant. Answer briefly.", model=MODEL)
    r = await Runner.run(agent, "Say hello.", hooks=HOOKS)
    return {"answers": [r.final_output]}


async def tool_loop() -> dict:
    agent = Agent(name="weather_agent", instructions="You are a helpful assistant. Answer briefly.", model=MODEL,
                  tools=[get_weather])
    r = await Runner.run(agent, "What is the weather in Paris today?", hooks=HOOKS)
    return {"answers": [r.final_output]}


async def _three() -> list[str]:
    writer = Agent(name="writer", instructions="You write a short paragraph on the topic you are given.", model=MODEL)
    checker = Agent(name="checker", instructions="You check a paragraph for factual errors and list them.", model=MODEL)
    rewriter = Agent(name="rewriter", instructions="You rewrite a paragraph, fixing the errors listed.", model=MODEL)
    answers, text = [], "Write about lighthouses."
    for agent in (writer, checker, rewriter):
        r = await Runner.run(agent, text, hooks=HOOKS)
        text = r.final_output
        answers.append(text)
    return answers


async def three_agents() -> dict:
    with agents_trace("article"):
        return {"answers": await _three()}


async def three_agents_nospan() -> dict:
    return {"answers": await _three()}


SCENARIOS = {"one_call": one_call, "tool_loop": tool_loop, "three_agents": three_agents,
             "three_agents_nospan": three_agents_nospan}
out = asyncio.run(SCENARIOS[sys.argv[1]]())
provider.shutdown()
print(json.dumps({"agents": CALLS, "calls": len(CALLS), **out}))
