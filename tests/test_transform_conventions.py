"""Recovering one LLM call from each instrumentation layout's attributes (the layouts
as documented in shared/research/otel.md; live instrumentation tests come with
`nightshift build`)."""

from __future__ import annotations

import json

from nightshift.transform.conventions import indexed, read_call

EXPECTED_INPUT = [
    {"role": "system", "content": "You are terse.", "name": None, "tool_calls": [], "tool_call_id": None},
    {"role": "user", "content": "2+2?", "name": None, "tool_calls": [], "tool_call_id": None},
    {"role": "assistant", "content": None, "name": None,
     "tool_calls": [{"id": "c1", "name": "calc", "arguments": '{"expr":"2+2"}'}], "tool_call_id": None},
    {"role": "tool", "content": "4", "name": None, "tool_calls": [], "tool_call_id": "c1"},
]
EXPECTED_OUTPUT = {"role": "assistant", "content": "4", "name": None, "tool_calls": [], "tool_call_id": None}


def test_indexed_groups_flattened_keys_in_index_order_and_skips_gaps():
    attrs = {"p.10.a": 3, "p.0.a": 1, "p.0.b.c": 2, "p.2.a": 5, "other": 0, "p.x.a": 9}
    assert indexed(attrs, "p") == [{"a": 1, "b.c": 2}, {"a": 5}, {"a": 3}]


def test_otel_genai_json_attributes():
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.system_instructions": json.dumps([{"type": "text", "content": "You are terse."}]),
        "gen_ai.input.messages": json.dumps([
            {"role": "user", "parts": [{"type": "text", "content": "2+2?"}]},
            {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "calc", "arguments": {"expr": "2+2"}}]},
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "4"}]},
        ]),
        "gen_ai.output.messages": json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": "4"}], "finish_reason": "stop"}]),
        "gen_ai.tool.definitions": json.dumps([{"type": "function", "name": "calc", "parameters": {"type": "object"}}]),
    }
    call = read_call(attrs)
    assert call.convention == "otel_genai" and not call.problems
    assert call.input_messages == EXPECTED_INPUT
    assert call.output_message == EXPECTED_OUTPUT
    assert call.finish_reason == "stop"
    assert json.loads(call.tools_json())[0]["name"] == "calc"


def test_openinference_flattened_attributes():
    attrs = {
        "openinference.span.kind": "LLM",
        "llm.input_messages.0.message.role": "system", "llm.input_messages.0.message.content": "You are terse.",
        "llm.input_messages.1.message.role": "user", "llm.input_messages.1.message.content": "2+2?",
        "llm.input_messages.2.message.role": "assistant",
        "llm.input_messages.2.message.tool_calls.0.tool_call.id": "c1",
        "llm.input_messages.2.message.tool_calls.0.tool_call.function.name": "calc",
        "llm.input_messages.2.message.tool_calls.0.tool_call.function.arguments": '{"expr":"2+2"}',
        "llm.input_messages.3.message.role": "tool", "llm.input_messages.3.message.content": "4",
        "llm.input_messages.3.message.tool_call_id": "c1",
        "llm.output_messages.0.message.role": "assistant", "llm.output_messages.0.message.content": "4",
        "llm.tools.0.tool.json_schema": json.dumps({"type": "function", "function": {"name": "calc"}}),
        "llm.finish_reason": "stop",
    }
    call = read_call(attrs)
    assert call.convention == "openinference" and not call.problems
    assert call.input_messages == EXPECTED_INPUT
    assert call.output_message == EXPECTED_OUTPUT
    assert call.tools[0]["function"]["name"] == "calc"
    assert call.finish_reason == "stop"


def test_openinference_falls_back_to_the_raw_request_and_response():
    attrs = {
        "openinference.span.kind": "LLM",
        "input.value": json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        "output.value": json.dumps({"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]}),
    }
    call = read_call(attrs)
    assert [m["content"] for m in call.input_messages] == ["hi"]
    assert call.output_message["tool_calls"] == [{"id": "t", "name": "f", "arguments": "{}"}]
    assert call.finish_reason == "tool_call"


def test_openllmetry_legacy_indexed_attributes():
    attrs = {
        "llm.request.type": "chat",
        "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "You are terse.",
        "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "2+2?",
        "gen_ai.prompt.2.role": "assistant",
        "gen_ai.prompt.2.tool_calls.0.id": "c1", "gen_ai.prompt.2.tool_calls.0.name": "calc",
        "gen_ai.prompt.2.tool_calls.0.arguments": '{"expr":"2+2"}',
        "gen_ai.prompt.3.role": "tool", "gen_ai.prompt.3.content": "4", "gen_ai.prompt.3.tool_call_id": "c1",
        "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "4", "gen_ai.completion.0.finish_reason": "stop",
        "llm.request.functions.0.name": "calc", "llm.request.functions.0.parameters": '{"type": "object"}',
    }
    call = read_call(attrs)
    assert call.convention == "openllmetry_legacy" and not call.problems
    assert call.input_messages == EXPECTED_INPUT
    assert call.output_message == EXPECTED_OUTPUT
    assert call.tools == [{"type": "function", "name": "calc", "description": None, "parameters": {"type": "object"}}]


def test_bad_content_is_flagged_not_fatal():
    call = read_call({"gen_ai.input.messages": "{broken", "gen_ai.output.messages": "[]", "gen_ai.tool.definitions": "nope"})
    assert call.convention == "otel_genai"
    assert any("input messages" in p for p in call.problems) and any("tool definitions" in p for p in call.problems)
    assert call.output_message is None


def test_spans_without_any_llm_layout_give_nothing():
    assert read_call({"http.method": "GET", "gen_ai.operation.name": "invoke_agent"}) is None


def test_legacy_per_message_log_events():
    from nightshift.transform.conventions import read_events

    events = [
        {"event_name": "gen_ai.system.message", "body": {"content": "You are terse."}},
        {"event_name": "gen_ai.user.message", "body": {"content": "2+2?"}},
        {"event_name": "gen_ai.assistant.message", "body": {"tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expr":"2+2"}'}}]}},
        {"event_name": "gen_ai.tool.message", "body": {"content": "4", "id": "c1"}},
        {"event_name": "gen_ai.choice", "body": {"index": 0, "finish_reason": "stop", "message": {"content": "4", "role": "assistant"}}},
        {"event_name": "gen_ai.choice", "body": {"index": 1, "finish_reason": "stop", "message": {"content": "four"}}},
    ]
    call = read_events(events)
    assert call.convention == "otel_genai_events_legacy" and not call.problems
    assert call.input_messages == EXPECTED_INPUT
    assert call.output_message == EXPECTED_OUTPUT  # the first choice, not the second
    assert call.finish_reason == "stop"


def test_operation_details_event_with_structured_values():
    from nightshift.transform.conventions import read_events

    events = [{"event_name": "gen_ai.client.inference.operation.details", "body": None, "attributes": {
        "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]}],
        "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "4"}], "finish_reason": "stop"}],
    }}]
    call = read_events(events)
    assert call.convention == "otel_genai_event"
    assert [m["content"] for m in call.input_messages] == ["2+2?"]
    assert call.output_message == EXPECTED_OUTPUT and call.finish_reason == "stop"
    assert read_events([{"event_name": "something.else", "body": "x"}]) is None
