import polars as pl
import pytest

from nightshift.transform.classify import agent_name, enclosing_agent, is_inference


def test_only_inference_spans_are_calls():
    assert is_inference("chat gpt-4o", {"gen_ai.operation.name": "chat"})
    assert is_inference("generate_content gemini", {"gen_ai.operation.name": "generate_content"})
    assert not is_inference("invoke_agent writer", {"gen_ai.operation.name": "invoke_agent", "gen_ai.input.messages": "[]"})
    assert not is_inference("execute_tool calc", {"gen_ai.operation.name": "execute_tool"})
    assert is_inference("ChatCompletion", {"openinference.span.kind": "LLM"})
    assert not is_inference("Agent", {"openinference.span.kind": "AGENT"})
    assert is_inference("openai.chat", {"llm.request.type": "chat"})
    assert is_inference("openai.chat.completion", {})
    assert not is_inference("GET /", {"http.method": "GET"})


def test_agent_names_from_every_convention():
    assert agent_name("invoke_agent writer", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "writer"}) == "writer"
    assert agent_name("invoke_agent checker", {"gen_ai.operation.name": "invoke_agent"}) == "checker"
    assert agent_name("Planner", {"openinference.span.kind": "AGENT"}) == "Planner"
    assert agent_name("x", {"openinference.span.kind": "AGENT", "agent.name": "router"}) == "router"
    assert agent_name("x.agent", {"traceloop.span.kind": "agent", "traceloop.entity.name": "rewriter"}) == "rewriter"
    assert agent_name("team", {"recipient_agent_type": "coder"}) == "coder"
    assert agent_name("chain", {"langchain.chain.type": "AgentExecutor"}) == "AgentExecutor"
    assert agent_name("chat", {"gen_ai.operation.name": "chat"}) is None


def test_nearest_enclosing_agent():
    parent = {"call": "tool", "tool": "inner", "inner": "outer", "outer": None, "loop1": "loop2", "loop2": "loop1"}
    agents = {"inner": "checker", "outer": "writer"}
    assert enclosing_agent("call", parent, agents) == "checker"
    assert enclosing_agent("outer", parent, agents) == "writer"
    assert enclosing_agent("orphan", parent, agents) is None
    assert enclosing_agent("loop1", parent, agents) is None  # a cycle ends, it does not hang


@pytest.mark.parametrize("text,want", [
    ("[1,2,3]", [1, 2, 3]), ("[]", []), ("[-5,0]", [-5, 0]),  # the collector's own form: split and cast
    ("[ 1, 2 ]", [1, 2]), ("[[1,2],[3]]", [1, 2]),  # JSON text from elsewhere; a list per choice: the first
    ("[1,2,3000000000]", None), ("[1,2", None), ("abc", None), ("[1,,2]", None), ("[1,2]x", None),  # not ids
])
def test_token_id_lists_are_read_whatever_their_text_and_never_guessed(text, want):
    import pyarrow as pa

    from nightshift.schemas.common import ATTRIBUTES
    from nightshift.transform.calls import token_columns

    def attr(v):
        return [{"key": "prompt_token_ids", "value": {"type": "string", "string_value": v, "int_value": None,
                 "double_value": None, "bool_value": None, "bytes_value": None, "json_value": None}}]

    df = pl.from_arrow(pa.table({"attributes": pa.array([attr(text), attr("[4,5]"), []], ATTRIBUTES)}))
    got = token_columns(df)
    assert got["prompt_token_ids"].to_list() == [want, [4, 5], None]
    # a value that is there but not ids is counted, so the build can report it
    assert got["bad_token_ids"].to_list() == [want is None, False, False]
