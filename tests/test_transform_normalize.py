"""The normalizer in bulk (`transform/normalize.py`) against its definition, the
Python reader `calls.read_record`: the same record, field for field, for every call
of every recorded real run, of the benchmark's generated layouts, and of generated
odd spans (missing fields, nulls, non-JSON, multimodal parts, tool calls, values of
other types, huge strings). A call only Python reads goes there and is counted."""

from __future__ import annotations

import glob
import json
import random
import sys
from pathlib import Path

import fsspec
import polars as pl
import pytest

from nightshift.transform import attrs as A
from nightshift.transform import build as B
from nightshift.transform import calls as C
from nightshift.transform import normalize as N
from nightshift.transform.config import TransformConfig
from traces import Trace, genai_call, write_logs, write_spans

FIXTURES = Path(__file__).parent / "fixtures"
RECORDED = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*/*") if (p / "spans").is_dir()) + sorted(
    str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("doctor/*") if (p / "spans").is_dir())


def _calls(root: str) -> tuple[pl.DataFrame, dict]:
    """The call rows and their events of a span dataset, as `build.process` hands them
    to the normalizer."""
    fs, _ = fsspec.core.url_to_fs(root)
    files = sorted(glob.glob(f"{root}/spans/date=*/*.parquet"))
    df = B._prepare(B._read(fs, [B._Source(f, "") for f in files], B.SPAN_COLUMNS), B.Summary())
    logs = B._log_events(fs, [B._Source(f, "") for f in sorted(glob.glob(f"{root}/logs/date=*/*.parquet"))])
    rows = df.filter(C.classify(df, (), None)["is_call"]).drop("parent_span_id", "name")
    log_events, span_events = B._events_by_span(logs, rows["trace_id"].unique()), C.events_of(rows)
    return rows, {k: log_events.get(k, []) + span_events.get(k, []) for k in log_events.keys() | span_events.keys()}


def _oracle(rows: pl.DataFrame, events: dict) -> list[dict]:
    meta = rows.select("trace_id", "span_id", "start_ns", "end_ns", "service_name", "gen_ai_operation_name",
                       "scope_name", "dropped_attributes_count", "scope_schema_url", "resource_schema_url").to_dicts()
    out = []
    for i, (row, attrs) in enumerate(zip(meta, A.to_dicts_without(rows["attributes"], C.TOKEN_KEYS))):
        rec = C.read_record(row, attrs, events.get((row["trace_id"], row["span_id"]), []))
        rec["_call"] = i
        out.append(rec)
    return out


def _same(root: str) -> N.Normalized:
    rows, events = _calls(root)
    got = N.read_records(rows, events)
    want = _oracle(rows, events)
    assert len(got.records) == len(want) == rows.height
    for w, g in zip(want, got.records):
        diff = {k: (w.get(k, "<absent>"), g.get(k, "<absent>")) for k in w.keys() | g.keys() if w.get(k, 0) != g.get(k, 0)}
        assert not diff, f"{root}: span {w['span_id']}: {diff}"
    return got


@pytest.mark.parametrize("case", RECORDED)
def test_every_recorded_run_reads_the_same_in_bulk_as_call_by_call(case):
    _same(str(FIXTURES / case))


def test_the_benchmark_layouts_read_in_bulk_with_no_call_left_to_python(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import synth_traces as st

    p = st.Params(spans=2400, mix=True, prompt_chars=300, days=1)
    st.write_dataset(p, str(tmp_path), chunk_spans=2400, row_group_spans=1000, jobs=1)
    got = _same(str(tmp_path))
    assert not got.python  # Agent Lightning's, OpenInference's and GenAI JSON layouts: all expressions
    assert {r["convention"] for r in got.records} == {"agentlightning", "openinference", "otel_genai"}


def _odd_calls(rng: random.Random) -> list[dict]:
    """Attributes of calls in every layout, each with some field missing, null, of
    another type, not JSON, multimodal, a tool call, or very long."""
    texts = ["hi", "", "é ü 😀", "x" * 20_000, '{"not": "a message"}', "__REDACTED__", "line\nbreak", "{'role': 1}"]
    out = []
    for i in range(160):
        t = rng.choice(texts)
        kind = i % 4
        if kind == 0:  # GenAI JSON
            parts = rng.choice([
                [{"type": "text", "content": t}],
                [{"type": "text", "content": t}, {"type": "image", "url": "http://x/y.png"}],
                [{"type": "tool_call", "id": f"c{i}", "name": "f", "arguments": rng.choice(['{"a":1}', {"a": 1}, None, 5])}],
                [{"type": "generic", "generic_type": "citation", "content": {"k": t}}],
                [{"type": "text"}],
                [{"type": "text", "content": None}],
                # tool results sent as the user's, with more to say (Anthropic, Gemini): in the parts' order
                [{"type": "tool_call_response", "id": f"c{i}", "response": t}, {"type": "text", "content": t}],
                [{"type": "text", "content": t}, {"type": "tool_call_response", "id": f"c{i}", "response": "r"},
                 {"type": "tool_call", "id": f"d{i}", "name": "f", "arguments": "{}"},
                 {"type": "tool_call_response", "id": f"d{i}", "result": "s"}],
            ])
            msgs = [{"role": rng.choice(["user", "system", "developer", "assistant", None]), "parts": parts}]
            if rng.random() < 0.3:
                msgs.append({"role": "tool", "parts": [{"type": "tool_call_response", "id": f"c{i}",
                                                        rng.choice(["response", "result"]): rng.choice([t, {"ok": 1}])}]})
            a = genai_call(t, rng.choice([t, None]), tool_call=rng.choice([None, (f"c{i}", "f", {"x": 1})]))
            a["gen_ai.input.messages"] = rng.choice([json.dumps(msgs), json.dumps(msgs)[:-3], "not json", "[]", "{}"])
            if rng.random() < 0.3:
                a["gen_ai.system_instructions"] = rng.choice(
                    [json.dumps([{"type": "text", "content": t}]), json.dumps("plain"), "[bad", json.dumps([{"type": "x"}])])
            if rng.random() < 0.3:
                a["gen_ai.tool.definitions"] = rng.choice(
                    [json.dumps([{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
                     json.dumps({"name": "g"}), "nope"])
            if rng.random() < 0.3:
                a["gen_ai.output.messages"] = rng.choice(
                    [json.dumps([{"role": "assistant", "parts": [{"type": "text", "content": t}]}]),
                     json.dumps([{"role": "assistant", "parts": []}]), "[", json.dumps([{"role": "tool", "parts": [
                         {"type": "tool_call_response", "id": "z", "response": "r"}]}])])
                a.pop("gen_ai.response.finish_reasons", None)
            if rng.random() < 0.2:
                a["gen_ai.response.finish_reasons"] = rng.choice([["length"], ["tool_calls", "stop"], '["stop"]', 3])
        elif kind == 1:  # OpenInference
            a = {"openinference.span.kind": "LLM", "llm.model_name": rng.choice(["m@v0002", "m", ""]),
                 "llm.input_messages.0.message.role": rng.choice(["user", "developer", "function"]),
                 "llm.output_messages.0.message.role": "assistant",
                 "llm.token_count.prompt": rng.choice([3, "4", 2.5, True])}
            if rng.random() < 0.7:
                a["llm.input_messages.0.message.content"] = rng.choice([t, 7])
            else:
                a["llm.input_messages.0.message.contents.0.message_content.type"] = rng.choice(["text", "image"])
                a["llm.input_messages.0.message.contents.0.message_content.text"] = t
                a["llm.input_messages.0.message.contents.1.message_content.text"] = "more"
            if rng.random() < 0.5:
                a["llm.output_messages.0.message.tool_calls.0.tool_call.id"] = f"c{i}"
                a["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] = "f"
                if rng.random() < 0.5:
                    a["llm.output_messages.0.message.tool_calls.0.tool_call.function.arguments"] = '{"q": 1}'
            else:
                a["llm.output_messages.0.message.content"] = t
            if rng.random() < 0.3:
                a["llm.tools.0.tool.json_schema"] = rng.choice([json.dumps({"type": "function", "function": {"name": "f"}}), "{bad"])
            if rng.random() < 0.3:
                a["llm.invocation_parameters"] = rng.choice(['{"model": "asked"}', '{"model": 3}', "[1]", "nope"])
            if rng.random() < 0.3:
                a["output.value"] = rng.choice(['{"finish_reason": "function_calls"}', "[]", "text"])
            if rng.random() < 0.2:
                a["llm.input_messages.1.function.0"] = json.dumps({"content": "r", "call_id": "c"})
                a["llm.input_messages.1.message.role"] = "function"
        elif kind == 2:  # OpenLLMetry before 0.55 / Agent Lightning
            a = {"gen_ai.system": "openai", "llm.request.type": "chat", "gen_ai.prompt.0.role": "user",
                 "gen_ai.prompt.0.content": t, "gen_ai.completion.0.role": "assistant",
                 "gen_ai.request.temperature": rng.choice([0.7, "0.5", -1.0, "nan", 1])}
            if rng.random() < 0.5:
                a["gen_ai.completion.0.content"] = t
                a["gen_ai.completion.0.finish_reason"] = rng.choice(["stop", "TOOL_USE", "length"])
            else:
                a["gen_ai.completion.0.tool_calls.0.name"] = "f"
                a["gen_ai.completion.0.tool_calls.0.arguments"] = '{"x":1}'
                a["gen_ai.completion.0.tool_calls.1.id"] = "second"
            if rng.random() < 0.3:
                a["llm.request.functions.0.name"] = "f"
                a["llm.request.functions.0.parameters"] = rng.choice(['{"type":"object"}', "not json"])
            if rng.random() < 0.3:
                a["gen_ai.prompt.01.content"] = "leading zero"
            if rng.random() < 0.3:
                a["response_token_ids"] = [1, 2, 3]
                a["logprobs.content"] = rng.choice([json.dumps([{"logprob": -0.5}, {"logprob": -1}]), "bad"])
            if rng.random() < 0.3:
                a["gen_ai.prompt.name"] = "greet"
                a["gen_ai.prompt.version"] = "3"
        else:  # no content: capture off, token ids only, or an unknown layout
            a = rng.choice([
                {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 5, "gen_ai.request.model": "m",
                 "gen_ai.prompt.name": "p"},
                {"prompt_token_ids": [1, 2], "response_token_ids": [3]},
                {"llm.request.type": "chat", "mystery.content": t},
                {"openinference.span.kind": "LLM", "input.value": json.dumps({"messages": [{"role": "user", "content": t}]}),
                 "output.value": json.dumps({"choices": [{"message": {"role": "assistant", "content": t},
                                                          "finish_reason": "stop"}]})},
            ])
        out.append(a)
    return out


def test_generated_odd_calls_read_the_same_in_bulk_and_the_rest_in_python(tmp_path):
    rng = random.Random(28)
    traces = []
    for i, attrs in enumerate(_odd_calls(rng)):
        t = Trace(f"odd{i}", scope=rng.choice(["openinference.instrumentation.openai_agents", "x", ""]))
        root = t.span("agent", {"agent.name": "a"}, start=0, end=9)
        t.span("openai.chat.completion" if "llm.request.type" in attrs else "chat m", attrs, parent=root, start=1, end=2,
               dropped=rng.choice([0, 0, 3]))
        traces.append(t)
    write_spans(str(tmp_path), traces)
    write_logs(str(tmp_path), [{"trace": traces[3], "span": traces[3].spans[1].span_id, "name": "gen_ai.user.message",
                                "body": {"content": "from a log event"}}])
    got = _same(str(tmp_path))
    assert got.python["content in log or span events"] == 1
    assert sum(got.python.values()) < len(traces) // 2  # the rest in bulk


def test_the_build_summary_counts_the_calls_python_read(tmp_path):
    t = Trace("sum")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=9)
    first = t.span("chat m", genai_call("q1", "a1"), parent=root, start=1, end=2)
    t.span("chat m", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}, parent=root, start=3, end=4)
    t.span("reward", {"agentlightning.reward.0.value": 1.0}, parent=root, start=5, end=5.5)
    write_spans(str(tmp_path), [t])
    write_logs(str(tmp_path), [{"trace": t, "span": t.spans[2].span_id, "name": "gen_ai.user.message",
                                "body": {"content": "q2"}}])
    s = B.build(TransformConfig(data=str(tmp_path), settle=0))
    assert s.transitions == 2 and first
    assert dict(s.python_reader) == {"content in log or span events": 1}
    assert "calls read by the Python reader: 1 (content in log or span events 1)" in s.lines()


def test_a_key_twice_on_one_call_goes_to_python_and_reads_as_the_last(tmp_path):
    # the (row, key) duplicate check runs on the key's number, not its text: a key twice
    # in one call is found, the same key once in each of two calls is not, nor a key
    # twice that the records never read
    traces = []
    for i in range(3):
        t = Trace(f"dup{i}")
        root = t.span("agent", {"agent.name": "a"}, start=0, end=9)
        t.span("chat m1", {**genai_call(f"question {i}", f"answer {i}"), "x.other": "y"}, parent=root, start=1, end=2)
        traces.append(t)
    write_spans(str(tmp_path), traces)
    rows, events = _calls(str(tmp_path))
    assert rows.height == 3
    attrs = rows["attributes"].to_list()
    model = next(a for a in attrs[0] if a["key"] == "gen_ai.request.model")
    attrs[0].append({**model, "value": {**model["value"], "string_value": "m2"}})  # read: the last one wins
    attrs[1].append(next(a for a in attrs[1] if a["key"] == "x.other"))  # never read: not a reason
    rows = rows.with_columns(pl.Series("attributes", attrs, dtype=rows.schema["attributes"]))
    got = N.read_records(rows, events)
    assert dict(got.python) == {"repeated attribute keys": 1}
    want = _oracle(rows, events)
    assert got.records == want
    assert got.records[0]["request_model"] == "m2" and got.records[1]["request_model"] == "m1"


def test_tool_results_the_user_sends_with_text_read_in_bulk_in_the_parts_order(tmp_path):
    """Anthropic's and Gemini's tool results come in a user message, often with text
    after them: read in bulk, the results first, as `from_genai_message` reads them."""
    history = [{"role": "user", "parts": [{"type": "text", "content": "sum 2 and 3, then double"}]},
               {"role": "assistant", "parts": [{"type": "tool_call", "id": "a", "name": "add", "arguments": "{\"x\": 2}"}]},
               {"role": "user", "parts": [{"type": "tool_call_response", "id": "a", "response": "5"},
                                          {"type": "text", "content": "now double it"}]}]
    assert _one_call_in_bulk(tmp_path, history) == [
        ("user", "sum 2 and 3, then double"), ("assistant", None), ("tool", "5"), ("user", "now double it")]


def _one_call_in_bulk(tmp_path, history: list[dict], **attrs) -> list[tuple[str, str | None]]:
    """One call with this input, read in bulk (no call left to Python) and the same as
    call by call: its input messages' roles and contents."""
    t = Trace("one")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=9)
    a = genai_call("go on", "10") | attrs
    a["gen_ai.input.messages"] = json.dumps(history)
    t.span("chat m", a, parent=root, start=1, end=2)
    write_spans(str(tmp_path), [t])
    got = _same(str(tmp_path))
    assert sum(got.python.values()) == 0
    (rec,) = got.records
    return [(m["role"], m["content"]) for m in rec["input_messages"]]


def test_a_compacted_history_reads_as_the_summary_the_model_saw_in_bulk_and_in_python(tmp_path):
    """The conventions' CompactionPart (`{"type": "compaction", "content": ...}`): a
    provider's summary in place of the turns it compacted. Dropped, the row's state
    lost the only account of the conversation so far; it is text the model read."""
    history = [{"role": "user", "parts": [{"type": "compaction", "id": "cmp_1",
                                           "content": "Summary: the user wants the total of 2 and 3, doubled."}]},
               {"role": "user", "parts": [{"type": "text", "content": "so?"}]}]
    assert _one_call_in_bulk(tmp_path, history, **{"gen_ai.conversation.compacted": True}) == [
        ("user", "Summary: the user wants the total of 2 and 3, doubled."), ("user", "so?")]


def test_the_spans_finish_reasons_win_over_the_output_messages_own(tmp_path):
    """The GenAI conventions deprecated an output message's `finish_reason` (2026, #363):
    `gen_ai.response.finish_reasons` is the one to read; the message's only without it."""
    t = Trace("finish")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=9)
    both = genai_call("q", "a cut-off answer")  # its output message says `stop`
    both["gen_ai.response.finish_reasons"] = ["length"]
    t.span("chat m", both, parent=root, start=1, end=2)
    t.span("chat m", genai_call("q", "a whole answer"), parent=root, start=3, end=4)  # the message's alone
    write_spans(str(tmp_path), [t])
    got = _same(str(tmp_path))
    assert sum(got.python.values()) == 0
    assert [r["finish_reason"] for r in sorted(got.records, key=lambda r: r["start_ns"])] == ["length", "stop"]
