"""LangGraph 1.x programs on langchain-openai's ChatOpenAI, written as a user writes them,
traced by the LangChain instrumentation installed in the side environment and exported
over OTLP/HTTP configured by OTEL_* variables only. The model is reached through
OPENAI_BASE_URL (ChatOpenAI leaves it to the openai client; Chat Completions API).

LANGGRAPH_INSTRUMENT:
- `none` (default): no telemetry code here; run the program under `opentelemetry-instrument`
  (zero-code), which sets up the SDK and loads every installed instrumentor's entry point
  (OpenInference's and OpenLLMetry's LangChain instrumentors both register `langchain`, their
  openai instrumentors `openai`);
- a comma list, set up programmatically on a global SDK TracerProvider with an OTLP/HTTP
  exporter: `openinference` (openinference-instrumentation-langchain), `openllmetry`
  (OpenLLMetry's opentelemetry-instrumentation-langchain), `openai` (the openai-client
  instrumentor of the same family as the LangChain one named with it).

Scenarios:
- `graph`: a StateGraph writer -> checker -> rewriter, each node with its own ChatOpenAI
  instance, plain chat (3 LLM calls, each fed the previous node's output);
- `react`: `create_react_agent(model, tools=[get_weather], name="weather_agent")`: the model
  asks for the tool, the agent runs it and sends the result, the model answers (2 LLM calls);
- `react_unnamed`: the same without a name: nothing names the agent (LangGraph calls the graph
  "LangGraph" and the model's node "agent"), so each call's agent must come out null;
- `create_agent`: the same agent built with LangChain 1.x's `langchain.agents.create_agent`
  (create_react_agent's successor; needs the `langchain` distribution), which puts
  `lc_agent_name` in every run's metadata (2 LLM calls).

Prints one JSON line: the node/agent name of each LLM call in order (`agents`: the graph's
node names; for the agents the name given to create_react_agent / create_agent, read off
each AIMessage's `name`), `calls`, the answers.
Usage: `[opentelemetry-instrument] python langgraph_app.py SCENARIO`."""

import json
import os
import sys
from typing import TypedDict

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
INSTRUMENT = [s.strip() for s in os.environ.get("LANGGRAPH_INSTRUMENT", "none").split(",") if s.strip()]
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather in Paris today?"
AGENT_PROMPTS = {
    "writer": "You write a short paragraph on the topic you are given.",
    "checker": "You check a paragraph for factual errors and list them.",
    "rewriter": "You rewrite a paragraph, fixing the errors listed.",
}

shutdown = None
if INSTRUMENT != ["none"]:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    shutdown = provider.shutdown
    if "openinference" in INSTRUMENT:
        from openinference.instrumentation.langchain import LangChainInstrumentor

        LangChainInstrumentor().instrument(tracer_provider=provider)
        if "openai" in INSTRUMENT:
            from openinference.instrumentation.openai import OpenAIInstrumentor

            OpenAIInstrumentor().instrument(tracer_provider=provider)
    elif "openllmetry" in INSTRUMENT:
        from opentelemetry.instrumentation.langchain import LangchainInstrumentor

        LangchainInstrumentor().instrument(tracer_provider=provider)
        if "openai" in INSTRUMENT:
            from opentelemetry.instrumentation.openai import OpenAIInstrumentor

            OpenAIInstrumentor().instrument(tracer_provider=provider)
    else:
        raise SystemExit(f"unknown LANGGRAPH_INSTRUMENT {os.environ.get('LANGGRAPH_INSTRUMENT')!r}")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


class Article(TypedDict, total=False):
    topic: str
    draft: str
    issues: str
    final: str
    calls: list[str]  # the node of each LLM call, in order


def graph() -> dict:
    writer_llm, checker_llm, rewriter_llm = ChatOpenAI(model=MODEL), ChatOpenAI(model=MODEL), ChatOpenAI(model=MODEL)

    def writer(state: Article) -> Article:
        r = writer_llm.invoke([SystemMessage(AGENT_PROMPTS["writer"]), HumanMessage(f"Write about {state['topic']}.")])
        return {"draft": r.content, "calls": state.get("calls", []) + ["writer"]}

    def checker(state: Article) -> Article:
        r = checker_llm.invoke([SystemMessage(AGENT_PROMPTS["checker"]), HumanMessage(state["draft"])])
        return {"issues": r.content, "calls": state["calls"] + ["checker"]}

    def rewriter(state: Article) -> Article:
        r = rewriter_llm.invoke([SystemMessage(AGENT_PROMPTS["rewriter"]),
                                 HumanMessage(f"Paragraph:\n{state['draft']}\n\nErrors:\n{state['issues']}")])
        return {"final": r.content, "calls": state["calls"] + ["rewriter"]}

    builder = StateGraph(Article)
    builder.add_node("writer", writer)
    builder.add_node("checker", checker)
    builder.add_node("rewriter", rewriter)
    builder.add_edge(START, "writer")
    builder.add_edge("writer", "checker")
    builder.add_edge("checker", "rewriter")
    builder.add_edge("rewriter", END)
    out = builder.compile().invoke({"topic": "lighthouses", "calls": []})
    return {"agents": out["calls"], "calls": len(out["calls"]),
            "answers": [out["draft"], out["issues"], out["final"]]}


def react(name: str | None = "weather_agent") -> dict:
    agent = create_react_agent(ChatOpenAI(model=MODEL), tools=[get_weather], prompt=SYSTEM, name=name)
    out = agent.invoke({"messages": [HumanMessage(QUESTION)]})
    turns = [m for m in out["messages"] if isinstance(m, AIMessage)]  # one AIMessage per LLM call
    return {"agents": [m.name for m in turns], "calls": len(turns),
            "answers": [m.content or None for m in turns],
            "tool_calls": [[c["id"] for c in m.tool_calls] for m in turns]}


def create_agent() -> dict:
    from langchain.agents import create_agent as make_agent

    agent = make_agent(ChatOpenAI(model=MODEL), tools=[get_weather], system_prompt=SYSTEM, name="weather_agent")
    out = agent.invoke({"messages": [HumanMessage(QUESTION)]})
    turns = [m for m in out["messages"] if isinstance(m, AIMessage)]
    return {"agents": [m.name for m in turns], "calls": len(turns),
            "answers": [m.content or None for m in turns],
            "tool_calls": [[c["id"] for c in m.tool_calls] for m in turns]}


result = {"graph": graph, "react": react, "react_unnamed": lambda: react(None),
          "create_agent": create_agent}[sys.argv[1]]()
result["instrument"] = INSTRUMENT
if shutdown:
    shutdown()
print(json.dumps(result))
