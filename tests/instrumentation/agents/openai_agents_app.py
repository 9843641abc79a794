"""OpenAI Agents SDK programs traced with OpenInference's bridge
(`OpenAIAgentsInstrumentor`, which replaces the SDK's own exporter to OpenAI's
backend), exported over OTLP/HTTP configured by OTEL_* variables. The model is
reached through OPENAI_BASE_URL with the Chat Completions API.

With ALSO_INSTRUMENT_OPENAI=1 the `openai` client is instrumented too
(`OpenAIInstrumentor`), as `phoenix.otel.register(auto_instrument=True)` does when
both packages are installed: every LLM call is then recorded twice.

Scenarios: `one_call` (an agent without tools), `tool_loop` (an agent with a
function tool: tool call, tool run, answer), `three_agents` (writer, checker and
rewriter Agents run one after the other inside one `trace()`).
Usage: `python openai_agents_app.py SCENARIO`."""

import asyncio
import json
import os
import sys

from agents import Agent, Runner, function_tool, set_default_openai_api, trace as agents_trace
from openinference.instrumentation.openai_agents import OpenAIAgentsInstrumentor
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
OpenAIAgentsInstrumentor().instrument(tracer_provider=provider)
if os.environ.get("ALSO_INSTRUMENT_OPENAI") == "1":
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=provider)
set_default_openai_api("chat_completions")


@function_tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


async def one_call() -> dict:
    agent = Agent(name="greeter", instructions="You are a helpful assistant. Answer briefly.", model=MODEL)
    r = await Runner.run(agent, "Say hello.")
    return {"calls": 1, "answers": [r.final_output]}


async def tool_loop() -> dict:
    agent = Agent(name="weather_agent", instructions="You are a helpful assistant. Answer briefly.", model=MODEL,
                  tools=[get_weather])
    r = await Runner.run(agent, "What is the weather in Paris today?")
    return {"calls": 2, "answers": [None, r.final_output]}


async def three_agents() -> dict:
    writer = Agent(name="writer", instructions="You write a short paragraph on the topic you are given.", model=MODEL)
    checker = Agent(name="checker", instructions="You check a paragraph for factual errors and list them.", model=MODEL)
    rewriter = Agent(name="rewriter", instructions="You rewrite a paragraph, fixing the errors listed.", model=MODEL)
    answers = []
    with agents_trace("article"):
        text = "Write about lighthouses."
        for agent in (writer, checker, rewriter):
            r = await Runner.run(agent, text)
            text = r.final_output
            answers.append(text)
    return {"calls": 3, "answers": answers}


result = asyncio.run({"one_call": one_call, "tool_loop": tool_loop, "three_agents": three_agents}[sys.argv[1]]())
provider.shutdown()
print(json.dumps(result))
