"""The canonical message shape, read from the GenAI parts layout and the OpenAI chat
layout; and the transitions schema those messages land in."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from nightshift.schemas import SCHEMA_VERSION, transitions
from nightshift.transform.messages import (
    MessageError,
    from_genai_messages,
    from_openai_messages,
    from_system_instructions,
    normalize_finish_reason,
    tool_call_ids,
)

TOOL_LOOP_GENAI = [
    {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
    {"role": "assistant", "parts": [
        {"type": "reasoning", "content": "need a tool"},
        {"type": "tool_call", "id": "call_1", "name": "get_weather", "arguments": {"city": "Paris"}},
    ]},
    {"role": "tool", "parts": [
        {"type": "tool_call_response", "id": "call_1", "response": {"temp_c": 21}},
    ]},
]


def test_genai_parts_become_chat_messages():
    msgs = from_genai_messages(json.dumps(TOOL_LOOP_GENAI))  # JSON text, as on spans
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[0]["content"] == "Weather in Paris?"
    assert msgs[1]["content"] is None  # reasoning is not text the policy says
    assert msgs[1]["tool_calls"] == [{"id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'}]
    assert msgs[2] == {"role": "tool", "content": '{"temp_c":21}', "name": None, "tool_calls": [], "tool_call_id": "call_1"}
    assert tool_call_ids(msgs) == {"call_1"}
    # Structured values (log events) read the same as JSON text (spans).
    assert from_genai_messages(TOOL_LOOP_GENAI) == msgs


def test_one_tool_message_answering_two_calls_becomes_two_tool_turns():
    msgs = from_genai_messages([{"role": "tool", "parts": [
        {"type": "tool_call_response", "id": "a", "response": "1"},
        {"type": "tool_call_response", "id": "b", "result": "2"},  # the spec's example spelling
    ]}])
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in msgs] == [("tool", "a", "1"), ("tool", "b", "2")]


def test_tool_results_sent_with_role_user_still_become_tool_turns():
    # pydantic-ai sends tool results in a `user` message
    msgs = from_genai_messages([{"role": "user", "parts": [{"type": "tool_call_response", "id": "x", "response": "ok"}]}])
    assert msgs == [{"role": "tool", "content": "ok", "name": None, "tool_calls": [], "tool_call_id": "x"}]


def test_tool_results_the_user_sends_with_more_text_stay_next_to_the_calls_they_answer():
    """A user message holding tool results and then text (Anthropic's tool_result blocks
    with a note, Gemini's function responses): the results come first, in the parts'
    order, so each still follows the assistant's call; the text was put before them."""
    msgs = from_genai_messages([
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "a", "name": "f", "arguments": {}},
                                        {"type": "tool_call", "id": "b", "name": "g", "arguments": {}}]},
        {"role": "user", "parts": [{"type": "tool_call_response", "id": "a", "response": "1"},
                                   {"type": "tool_call_response", "id": "b", "response": "2"},
                                   {"type": "text", "content": "and now the total?"}]}])
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in msgs[1:]] == [
        ("tool", "a", "1"), ("tool", "b", "2"), ("user", None, "and now the total?")]
    said_first = from_genai_messages([{"role": "user", "parts": [
        {"type": "text", "content": "before"}, {"type": "tool_call_response", "id": "a", "response": "1"}]}])
    assert [m["role"] for m in said_first] == ["user", "tool"]


def test_system_instructions_are_parts():
    assert from_system_instructions('[{"type":"text","content":"Be brief."},{"type":"text","content":" Be kind."}]')["content"] == "Be brief. Be kind."
    assert from_system_instructions("null") is None


def test_openai_chat_layout():
    msgs = from_openai_messages([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "function_call": {"name": "old", "arguments": {"a": 1}}},
    ])
    assert msgs[1]["content"] == "hi there"
    assert msgs[2]["tool_calls"] == [{"id": "c1", "name": "calc", "arguments": '{"x": 1}'}]  # model's text kept verbatim
    assert msgs[3]["tool_call_id"] == "c1" and msgs[3]["role"] == "tool"
    assert msgs[4]["tool_calls"] == [{"id": None, "name": "old", "arguments": '{"a":1}'}]


@pytest.mark.parametrize("bad", ["{not json", '{"role": "user"}', "[1, 2]", '[{"parts": []}]',
                                 '[{"role": "user", "parts": "text"}]', '[{"role": "user", "parts": [3]}]'])
def test_unreadable_content_raises_a_clear_error(bad):
    with pytest.raises(MessageError):
        from_genai_messages(bad)


@pytest.mark.parametrize("raw,expected", [
    ("tool_calls", "tool_call"), (["tool_call"], "tool_call"), ('["tool_calls"]', "tool_call"), ("TOOL_USE", "tool_call"),
    ("end_turn", "stop"), ("STOP", "stop"), ("max_tokens", "length"), (["length", "stop"], "length"),
    ("SAFETY", "content_filter"), (None, None), ([], None), ("something_new", "something_new"),
])
def test_finish_reasons_are_normalized(raw, expected):
    assert normalize_finish_reason(raw) == expected


def test_messages_fit_the_transitions_schema():
    msgs = from_genai_messages(TOOL_LOOP_GENAI)
    arr = pa.array([msgs], pa.list_(transitions.MESSAGE))
    assert arr.to_pylist()[0] == msgs
    schema = transitions.SCHEMA
    # the transitions dataset has its own version (2: the prompt template columns, 3: prompt_seen); the others stay at 1
    assert schema.metadata[b"nightshift.schema_version"] == transitions.VERSION.encode() == b"4"
    assert SCHEMA_VERSION == "1"
    for col in ("transition_id", "trace_id", "span_id", "trajectory_id", "group_id", "step", "num_steps", "agent_name",
                "service_name", "model", "provider", "input_messages", "output_message", "tools", "finish_reason",
                "prompt_token_ids", "completion_token_ids", "completion_logprobs", "input_tokens", "output_tokens",
                "reward", "reward_source", "return", "advantage", "start_time", "end_time", "convention", "truncated",
                "schema_version", "prompt_name", "prompt_version"):
        assert col in schema.names, col
    tc = schema.field("output_message").type.field("tool_calls").type.value_type
    assert [f.name for f in tc] == ["id", "name", "arguments"]


# What opentelemetry-instrumentation-openai-agents-v2 0.1.0 wrote for a tool-call answer and
# for the tool result after it (span attributes of a live run, tests/test_instrumentation_live.py).
OPENAI_AGENTS_V2_OUTPUT = (
    '[{"role":"assistant","parts":[{"type":"text","content":"{\'content\': None, \'refusal\': None, \'role\': '
    '\'assistant\', \'annotations\': None, \'audio\': None, \'function_call\': None, \'tool_calls\': [{\'id\': '
    '\'call_07da\', \'function\': {\'arguments\': \'{\\"city\\": \\"Paris\\"}\', \'name\': \'get_weather\'}, '
    '\'type\': \'function\'}]}"}]}]')
OPENAI_AGENTS_V2_TOOL = (
    '[{"role":"tool","parts":[{"type":"text","content":"{\\"sky\\": \\"sunny\\"}"},'
    '{"type":"tool_call_response","id":"call_07da","result":"{\\"sky\\": \\"sunny\\"}"}]}]')


def test_an_assistant_message_printed_as_the_clients_object_is_read_as_the_tool_call_it_was():
    (out,) = from_genai_messages(OPENAI_AGENTS_V2_OUTPUT)
    assert out["role"] == "assistant" and out["content"] is None
    assert out["tool_calls"] == [{"id": "call_07da", "name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize("text", ["{'content': 'hi', 'role': 'assistant'}",  # not the client's full shape
                                  "{'content': None, 'role': 'assistant', 'tool_calls': [], 'function_call': __import__('os')}",
                                  "{'a': 1} 'tool_calls': "])
def test_text_that_only_looks_like_a_printed_message_stays_text(text):
    (out,) = from_genai_messages(json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": text}]}]))
    assert out["content"] == text and out["tool_calls"] == []


def test_a_tool_result_written_as_text_and_as_its_response_part_is_one_message():
    (msg,) = from_genai_messages(OPENAI_AGENTS_V2_TOOL)
    assert msg == {"role": "tool", "content": '{"sky": "sunny"}', "name": None, "tool_calls": [], "tool_call_id": "call_07da"}
