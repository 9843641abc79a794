"""AutoGen agentchat 0.7 programs, written as a user writes them, traced with the
instrumentors named in AUTOGEN_INSTRUMENT and exported over OTLP/HTTP configured by
OTEL_* variables. The model is reached through OPENAI_BASE_URL (autogen-ext's
`OpenAIChatCompletionClient`, which builds an `openai.AsyncOpenAI`).

AUTOGEN_INSTRUMENT is a comma list:
- `autogen`: openinference-instrumentation-autogen-agentchat (`AutogenAgentChatInstrumentor`);
- `openai`: openinference-instrumentation-openai (`OpenAIInstrumentor`).
The tracer provider is always made the global one (as `phoenix.otel.register()` and
most quick starts do), so AutoGen's own GenAI spans (`create_agent`, `invoke_agent`,
`execute_tool`) and its runtime spans are exported too, whatever is listed.
AUTOGEN_DISABLE_RUNTIME_TRACING=true is AutoGen's own switch for the runtime spans.
AUTOGEN_ROOT_SPAN=NAME wraps the run in a span of the user's own (without one, and without
the autogen instrumentor's `run_stream` span, each runtime message starts its own trace).

Scenarios:
- `assistant`: an AssistantAgent "math_agent" with a `calculator` tool and
  `reflect_on_tool_use=True`: the model asks for the tool, the agent runs it, then asks
  the model again with the result (2 LLM calls).
- `roundrobin`: a RoundRobinGroupChat of "writer" and "critic" (no tools) ending on
  MaxMessageTermination(5): the task and 4 agent turns (4 LLM calls).

Prints one JSON line: the agent of each LLM call in order (`agents`), `calls`, and
what the run produced. Usage: `python autogen_app.py SCENARIO`."""

import asyncio
import json
import os
import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination
from autogen_agentchat.teams import RoundRobinGroupChat
from autogen_ext.models.openai import OpenAIChatCompletionClient
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
INSTRUMENT = {s.strip() for s in os.environ.get("AUTOGEN_INSTRUMENT", "autogen").split(",") if s.strip()}

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
if "autogen" in INSTRUMENT:
    from openinference.instrumentation.autogen_agentchat import AutogenAgentChatInstrumentor

    AutogenAgentChatInstrumentor().instrument(tracer_provider=provider)
if "openai" in INSTRUMENT:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=provider)


def calculator(expression: str = "6 * 7") -> str:
    """Evaluate an arithmetic expression such as '6 * 7'."""
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only arithmetic is allowed"
    return str(eval(expression))  # noqa: S307 - digits and operators only


CALLS: list = []  # the agent of each model call, in order


def client_for(agent: str) -> OpenAIChatCompletionClient:
    """One model client per agent (api_key and base_url from OPENAI_API_KEY / OPENAI_BASE_URL),
    its `create` noting the agent on the instance so the class (and its span names) stay AutoGen's."""
    client = OpenAIChatCompletionClient(model=MODEL)
    original = client.create

    async def create(*args, **kwargs):
        CALLS.append(agent)
        return await original(*args, **kwargs)

    client.create = create
    return client


async def assistant() -> dict:
    agent = AssistantAgent(
        "math_agent", model_client=client_for("math_agent"), tools=[calculator], reflect_on_tool_use=True,
        system_message="You are a math assistant. Use the calculator tool for arithmetic.")
    result = await agent.run(task="What is 6 times 7?")
    return {"messages": [(m.source, type(m).__name__) for m in result.messages],
            "answer": result.messages[-1].to_text()}


async def roundrobin() -> dict:
    writer = AssistantAgent("writer", model_client=client_for("writer"),
                            system_message="You write a short paragraph on the topic you are given.")
    critic = AssistantAgent("critic", model_client=client_for("critic"),
                            system_message="You criticise the last paragraph in one sentence.")
    team = RoundRobinGroupChat([writer, critic], termination_condition=MaxMessageTermination(5))
    result = await team.run(task="Write about lighthouses.")
    return {"messages": [(m.source, type(m).__name__) for m in result.messages], "stop_reason": result.stop_reason}




async def main(scenario: str) -> dict:
    run = {"assistant": assistant, "roundrobin": roundrobin}[scenario]
    if not os.environ.get("AUTOGEN_ROOT_SPAN"):
        return await run()
    with trace.get_tracer("autogen_app").start_as_current_span(os.environ["AUTOGEN_ROOT_SPAN"]):
        return await run()


out = asyncio.run(main(sys.argv[1]))
provider.shutdown()
print(json.dumps({"agents": CALLS, "calls": len(CALLS), "instrument": sorted(INSTRUMENT), **out}))
