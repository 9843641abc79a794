"""The scenarios every agent program runs, written the way a user of the plain
`openai` client writes them. Imports nothing from nightshift: the programs run in
side virtualenvs that don't have it.

- `one_call`: one chat completion, its own trace.
- `tool_loop`: under an `invoke_agent weather_agent` span, the model asks for a
  tool, the program runs it (`execute_tool` span), sends the result, gets the answer.
- `three_agents`: under one `invoke_workflow` span, `writer`, `checker` and
  `rewriter` agent spans, one chat call each, each feeding the next.

Agent spans follow the OTel GenAI agent-span conventions (`gen_ai.operation.name`,
`gen_ai.agent.name`), created with the OpenTelemetry API on the global provider.
"""

from __future__ import annotations

import json
import os

MODEL = os.environ.get("AGENT_MODEL", "gpt-4o-mini")
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the weather in Paris today?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    },
}
AGENT_PROMPTS = {
    "writer": ("You write a short paragraph on the topic you are given.", "Write about lighthouses."),
    "checker": ("You check a paragraph for factual errors and list them.", None),
    "rewriter": ("You rewrite a paragraph, fixing the errors listed.", None),
}


def get_weather(city: str, unit: str = "celsius") -> str:
    return json.dumps({"city": city, "temperature": 21, "unit": unit, "sky": "sunny"})


def _trace_id(span) -> str:
    return f"{span.get_span_context().trace_id:032x}"


def _agent_span(tracer, name: str):
    from opentelemetry import trace

    return tracer.start_as_current_span(
        f"invoke_agent {name}", kind=trace.SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name, "gen_ai.provider.name": "openai"},
    )


def one_call(client, tracer) -> dict:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}])
    return {"calls": 1, "answers": [r.choices[0].message.content]}


def tool_loop(client, tracer) -> dict:
    from opentelemetry import trace

    with _agent_span(tracer, "weather_agent") as root:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        r1 = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
        msg = r1.choices[0].message
        call = msg.tool_calls[0]
        messages.append(msg.model_dump(exclude_none=True))
        with tracer.start_as_current_span(
            f"execute_tool {call.function.name}", kind=trace.SpanKind.INTERNAL,
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.function.name,
                        "gen_ai.tool.call.id": call.id, "gen_ai.tool.type": "function"},
        ):
            result = get_weather(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
        return {"calls": 2, "trace_id": _trace_id(root), "tool_call_id": call.id,
                "answers": [None, r2.choices[0].message.content]}


def three_agents(client, tracer) -> dict:
    from opentelemetry import trace

    with tracer.start_as_current_span(
        "invoke_workflow article", kind=trace.SpanKind.INTERNAL,
        attributes={"gen_ai.operation.name": "invoke_workflow", "gen_ai.workflow.name": "article"},
    ) as root:
        text = None
        answers = []
        for name, (system, task) in AGENT_PROMPTS.items():
            with _agent_span(tracer, name):
                r = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "system", "content": system}, {"role": "user", "content": task or text}])
                text = r.choices[0].message.content
                answers.append(text)
        return {"calls": 3, "trace_id": _trace_id(root), "answers": answers}


SCENARIOS = {"one_call": one_call, "tool_loop": tool_loop, "three_agents": three_agents}
