"""LlamaIndex programs (llama-index-core 0.14 agent workflows), written as a user writes
them, traced with openinference-instrumentation-llama-index (`LlamaIndexInstrumentor`,
programmatic) and exported over OTLP/HTTP configured by OTEL_* variables. The model is
llama-index-llms-openai's `OpenAI` LLM; it does NOT read OPENAI_BASE_URL (it takes
`api_base` or OPENAI_API_BASE, else api.openai.com), so the program passes
OPENAI_BASE_URL as `api_base`. FunctionAgent streams by default (`stream: true`
requests): it needs a stub that streams.

LLAMAINDEX_INSTRUMENT (comma-separated, default `llama_index`): `llama_index` for
`LlamaIndexInstrumentor`, `openai` for openinference-instrumentation-openai's
`OpenAIInstrumentor` too (every LLM call then recorded twice, nested).

Scenarios:
- `function_agent`: `FunctionAgent(name="weather_agent")` with a `FunctionTool`
  (`get_weather`): the model asks for the tool, the agent runs it and sends the result,
  the model answers (2 LLM calls), events streamed with `handler.stream_events()`;
- `function_agent_nostream`: the same with `FunctionAgent(streaming=False)` (plain requests);
- `three_agents`: FunctionAgents "writer", "checker" and "rewriter" (no tools) run one
  after another, each fed the previous output (3 LLM calls), no caller span.

Prints one JSON line: the agent name of each LLM call in order (`agents`, from the
workflow's own `AgentOutput` events, one per LLM call), `calls`, the answers.
Usage: `python llamaindex_app.py SCENARIO`."""

import asyncio
import json
import os
import sys

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from openinference.instrumentation.llama_index import LlamaIndexInstrumentor

provider = TracerProvider()
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
trace.set_tracer_provider(provider)
INSTRUMENT = set(os.environ.get("LLAMAINDEX_INSTRUMENT", "llama_index").split(","))
if "llama_index" in INSTRUMENT:
    LlamaIndexInstrumentor().instrument(tracer_provider=provider)
if "openai" in INSTRUMENT:  # as phoenix.otel.register(auto_instrument=True) does with both installed
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument(tracer_provider=provider)

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.openai import OpenAI  # noqa: E402

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather in Paris today?"
AGENT_PROMPTS = {
    "writer": ("You write a short paragraph on the topic you are given.", "Write about lighthouses."),
    "checker": ("You check a paragraph for factual errors and list them.", None),
    "rewriter": ("You rewrite a paragraph, fixing the errors listed.", None),
}
CALLS: list[str | None] = []


def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


def llm() -> OpenAI:
    return OpenAI(model=MODEL, api_base=os.environ.get("OPENAI_BASE_URL"), max_retries=0)


async def run(agent: FunctionAgent, prompt: str) -> str:
    handler = agent.run(user_msg=prompt)
    async for ev in handler.stream_events():
        if isinstance(ev, AgentOutput):  # one per LLM call
            CALLS.append(ev.current_agent_name)
    return str(await handler)


async def function_agent(streaming: bool = True) -> dict:
    agent = FunctionAgent(name="weather_agent", description="Answers weather questions.", system_prompt=SYSTEM,
                          tools=[FunctionTool.from_defaults(get_weather)], llm=llm(), streaming=streaming)
    return {"answers": [await run(agent, QUESTION)]}


async def function_agent_nostream() -> dict:
    return await function_agent(streaming=False)


async def three_agents() -> dict:
    text, answers = None, []
    for name, (system, task) in AGENT_PROMPTS.items():
        agent = FunctionAgent(name=name, description=f"The {name}.", system_prompt=system, tools=[], llm=llm())
        text = await run(agent, task or text)
        answers.append(text)
    return {"answers": answers}


out = asyncio.run({"function_agent": function_agent, "function_agent_nostream": function_agent_nostream,
                   "three_agents": three_agents}[sys.argv[1]]())
provider.shutdown()
print(json.dumps({"agents": CALLS, "calls": len(CALLS), "instrument": sorted(INSTRUMENT), **out}))
