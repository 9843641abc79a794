"""The GenAI conventions as they move (issue 28, item 7): they left the core
repository for open-telemetry/semantic-conventions-genai, whose pending changes
are read here beside every older layout: input deltas per conversation, named
prompt templates, `generic` parts, output messages without `finish_reason`, the
renamed agent and inference spans; and a span's schema URL says which generation
of the conventions it follows."""

from __future__ import annotations

import json
import os

import polars as pl
import pyarrow.parquet as pq

from nightshift.collector.convert import SpanBuilder
from nightshift.collector.datasets import DatasetStore
from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig
from traces import T0, Trace, request, write_spans

DAY = 86_400 * 10**9
SYSTEM = [{"type": "text", "content": "You answer about the weather."}]


def _rows(data) -> pl.DataFrame:
    return pl.read_parquet(f"{data}/transitions", hive_partitioning=True).sort("start_time")


def _text(role: str, text: str) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": text}]}


# One conversation of three calls over two traces (two user turns), as the delta
# proposal (semantic-conventions-genai issue #364 / PR #365) describes it: the same
# schema as `gen_ai.input.messages`, only the messages appended since the conversation's
# previous call, correlated by `gen_ai.conversation.id`, the first call's delta its
# whole input. No instrumentation on the package index emits it yet (loongsuite-util-genai
# 0.5.0, loongsuite-otel-util-genai 0.9.1 and opentelemetry-util-genai 1.3b0 do not), so
# these spans are made from the proposal's description, not recorded.
U1 = _text("user", "Weather in Paris?")
A1 = {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "get_weather",
                                      "arguments": '{"city":"Paris"}'}]}
T1 = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "rainy, 57F"}]}
A2 = _text("assistant", "Rainy, 57F.")
U2 = _text("user", "And tomorrow?")
A3 = _text("assistant", "Sunny.")
HISTORIES = [[U1], [U1, A1, T1], [U1, A1, T1, A2, U2]]
DELTAS = [[U1], [A1, T1], [A2, U2]]
OUTPUTS = [A1, A2, A3]


def _conversation(data, delta: bool, seed: str) -> None:
    turns = [Trace(seed + "turn1"), Trace(seed + "turn2")]
    at = 0.0
    for i, (history, new, out) in enumerate(zip(HISTORIES, DELTAS, OUTPUTS)):
        t = turns[0 if i < 2 else 1]
        if not t.spans:
            t.span("invoke_agent weather", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather",
                                            "gen_ai.conversation.id": "conv-1"}, start=at, end=at + 10)
        a = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m",
             "gen_ai.conversation.id": "conv-1", "gen_ai.system_instructions": json.dumps(SYSTEM),
             "gen_ai.output.messages": json.dumps([out])}
        a["gen_ai.input.messages_delta" if delta else "gen_ai.input.messages"] = json.dumps(new if delta else history)
        t.span("chat m", a, parent=t.spans[0].span_id, start=at + 1 + i, end=at + 1.5 + i)
        at += 0.01
    for t in turns:
        t.span("reward", {"agentlightning.reward.0.value": 1.0}, parent=t.spans[0].span_id, start=9, end=9.5)
    write_spans(str(data), turns)


def test_input_deltas_are_rebuilt_into_the_whole_history_per_conversation(tmp_path):
    _conversation(tmp_path / "full", False, "f")
    _conversation(tmp_path / "delta", True, "d")
    s_full = build(TransformConfig(data=str(tmp_path / "full"), settle=0))
    s_delta = build(TransformConfig(data=str(tmp_path / "delta"), settle=0))
    full, delta = _rows(tmp_path / "full"), _rows(tmp_path / "delta")
    assert full.height == delta.height == 3
    assert delta["input_messages"].to_list() == full["input_messages"].to_list()
    assert [len(m) for m in delta["input_messages"].to_list()] == [2, 4, 6]  # the system prompt heads each
    assert delta["input_messages"][2][0]["role"] == "system" and delta["input_messages"][2][5]["content"] == "And tomorrow?"
    assert all("history_from_delta" in f for f in delta["flags"].to_list())
    assert s_delta.flagged["history_from_delta"] == 3 and not s_full.flagged.get("history_from_delta")
    assert dict(s_delta.python_reader) == {"GenAI input deltas": 3}


def test_a_whole_input_after_deltas_starts_the_history_again(tmp_path):
    """A compaction: the emitter falls back to `gen_ai.input.messages`, and the deltas
    after it build on that."""
    t = Trace("compact")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=10)
    summary = _text("user", "Summary so far: Paris is rainy.")
    inputs = [("gen_ai.input.messages_delta", [U1]), ("gen_ai.input.messages", [summary, U2]),
              ("gen_ai.input.messages_delta", [A3, _text("user", "Thanks")])]
    for i, (key, msgs) in enumerate(inputs):
        t.span("chat m", {"gen_ai.operation.name": "chat", "gen_ai.conversation.id": "c2", key: json.dumps(msgs),
                          "gen_ai.output.messages": json.dumps([A3])}, parent=root, start=1 + i, end=1.5 + i)
    write_spans(str(tmp_path), [t])
    build(TransformConfig(data=str(tmp_path), settle=0))
    texts = [[m["content"] for m in ms] for ms in _rows(tmp_path)["input_messages"].to_list()]
    assert texts == [["Weather in Paris?"], ["Summary so far: Paris is rainy.", "And tomorrow?"],
                     ["Summary so far: Paris is rainy.", "And tomorrow?", "Sunny.", "Thanks"]]


def test_the_named_prompt_template_is_carried_into_its_rows(tmp_path):
    t = Trace("prompt")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=10)
    base = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 9,
            "gen_ai.prompt.name": "analyze-code", "gen_ai.prompt.version": "2025-05-01"}
    t.span("chat m", {**base, "gen_ai.input.messages": json.dumps([U1]), "gen_ai.output.messages": json.dumps([A2])},
           parent=root, start=1, end=2)
    t.span("chat m", base, parent=root, start=3, end=4)  # content capture off: only the template's name
    t.span("reward", {"agentlightning.reward.0.value": 1.0}, parent=root, start=5, end=5.5)
    write_spans(str(tmp_path), [t])
    s = build(TransformConfig(data=str(tmp_path), settle=0))
    rows = _rows(tmp_path)
    # the second call is a call without content, not a layout no reader knows (left out)
    assert rows.height == 2 and not any(v[1] for v in s.by_instrumentation.values())
    assert rows["prompt_name"].to_list() == ["analyze-code"] * 2
    assert rows["prompt_version"].to_list() == ["2025-05-01"] * 2
    assert rows["flags"][1].to_list() == ["content_missing"]
    assert rows["schema_version"].unique().to_list() == ["4"]  # 4 since system_id and tools_id
    f = next(os.path.join(r, n) for r, _, ns in os.walk(tmp_path / "transitions") for n in ns if n.endswith(".parquet"))
    assert pq.read_schema(f).metadata[b"nightshift.schema_version"] == b"4"


def test_generic_parts_and_output_messages_without_a_finish_reason(tmp_path):
    t = Trace("generic")
    root = t.span("agent", {"agent.name": "a"}, start=0, end=10)
    out = [{"role": "assistant", "parts": [{"type": "text", "content": "See "},
                                          {"type": "generic", "generic_type": "citation", "content": {"url": "u"}},
                                          {"type": "text", "content": "the docs."}]}]
    inp = [{"role": "user", "parts": [{"type": "text", "content": "Where?"},
                                      {"type": "generic", "generic_type": "audio_ref", "content": "ref-1"}]}]
    t.span("chat m", {"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(inp),
                      "gen_ai.output.messages": json.dumps(out), "gen_ai.response.finish_reasons": ["length"]},
           parent=root, start=1, end=2)
    write_spans(str(tmp_path), [t])
    build(TransformConfig(data=str(tmp_path), settle=0))
    row = _rows(tmp_path).row(0, named=True)
    assert row["output_message"]["content"] == "See the docs." and row["input_messages"][0]["content"] == "Where?"
    assert row["finish_reason"] == "length" and "finish_reason_inferred" not in row["flags"]


def test_the_renamed_turn_and_agent_spans(tmp_path):
    """`handle_conversation_turn` (a runner's entry point, `invoke_workflow` before) is
    neither an agent nor a call; the `invoke_agent` span inside it names the agent of
    the inference spans (`gen_ai.client.inference`, named `{operation} {model}`)."""
    t = Trace("renamed")
    turn = t.span("handle_conversation_turn", {"gen_ai.operation.name": "handle_conversation_turn",
                                               "gen_ai.agent.name": "Triage", "gen_ai.conversation.id": "c3"},
                  start=0, end=10)
    agent = t.span("invoke_agent Weather", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "Weather"},
                   parent=turn, start=1, end=9)
    t.span("chat gpt-4o", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o",
                           "gen_ai.input.messages": json.dumps([U1]), "gen_ai.output.messages": json.dumps([A2])},
           parent=agent, start=2, end=3)
    write_spans(str(tmp_path), [t])
    build(TransformConfig(data=str(tmp_path), settle=0))
    rows = _rows(tmp_path)
    assert rows.height == 1 and rows["agent_name"].to_list() == ["Weather"]


def _with_schema_url(data, t: Trace, url: str) -> None:
    req = request([t])
    req.resource_spans[0].scope_spans[0].schema_url = url
    sb = SpanBuilder()
    sb.add_request(req, T0 + 10**10)
    w = DatasetStore(str(data)).writer("spans", "b1")
    w.add(sb.table(), sb.dates)
    w.commit()


def test_the_schema_url_says_where_a_call_without_content_had_it(tmp_path):
    """Capture off: a span of the conventions before 1.37 (per-message log events)
    and one of 1.37 and later (messages on the span) need different switches."""
    for url, convention, switch in (("https://opentelemetry.io/schemas/1.28.0", "otel_genai_events_legacy", "=true"),
                                    ("https://opentelemetry.io/schemas/1.37.0", "otel_genai", "SPAN_ONLY"),
                                    ("", "otel_genai", "SPAN_ONLY")):
        data = tmp_path / (url.rsplit("/", 1)[-1] or "none")
        t = Trace("s" + url, scope="opentelemetry.instrumentation.openai_v2")
        t.span("chat m", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m", "gen_ai.usage.input_tokens": 3},
               start=1, end=2)
        _with_schema_url(data, t, url)
        s = build(TransformConfig(data=str(data), settle=0))
        assert _rows(data)["convention"].to_list() == [convention], url
        assert s.content_missing == {convention: 1}
        assert any(switch in line for line in s.lines() if line.startswith("rows without content")), (url, s.lines())


def _task(seed: str, reward: float, start: int) -> Trace:
    t = Trace(seed)
    root = t.span("agent", {"agent.name": "a"}, start=0, end=10)
    t.span("chat m", {"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps([U1]),
                      "gen_ai.output.messages": json.dumps([A2])}, parent=root, start=1, end=2)
    t.span("reward", {"agentlightning.reward.0.value": reward}, parent=root, start=5, end=5.5)
    return t


def test_a_kept_partition_of_the_older_version_is_repooled_with_the_new_columns_null(tmp_path):
    """Version 1 partitions (no prompt columns) stay readable: when an incremental build's
    new rows move their advantages, the kept partition is rewritten (`pool.rewrite`) with
    the new columns, null, and its rows keep the version that built them."""
    import fsspec
    import pyarrow as pa

    from nightshift.transform import pool

    write_spans(str(tmp_path), [_task("v1a", 1.0, T0)])
    build(TransformConfig(data=str(tmp_path), settle=0))
    (old,) = [os.path.join(r, n) for r, _, ns in os.walk(tmp_path / "transitions") for n in ns if n.endswith(".parquet")]
    t = pq.read_table(old).drop_columns(["prompt_name", "prompt_version"])
    t = t.set_column(t.schema.get_field_index("schema_version"), "schema_version", pa.array(["1"] * t.num_rows))
    pq.write_table(t.replace_schema_metadata({b"nightshift.schema_version": b"1"}), old)
    fs, _ = fsspec.core.url_to_fs(str(tmp_path))
    out_root = str(tmp_path / "transitions")
    kept = pool.read_kept(fs, out_root, "2025-11-22")
    adv = kept.select(*pool.ID, pl.lit(0.25).alias("advantage"))
    assert pool.rewrite(fs, out_root, "2025-11-22", adv) == 1
    new = pq.read_table(old)
    assert new.column("prompt_name").null_count == new.num_rows == 1
    assert new.column("schema_version").to_pylist() == ["1"] and new.column("advantage").to_pylist() == [0.25]


# The same conversation as a client of a stateful API records it (OpenAI's Responses
# API with `previous_response_id`, Gemini's interactions): each call sends only its new
# items and names the response it continues (`gen_ai.request.previous_response.id`,
# opentelemetry-util-genai's attribute); the provider puts the rest back. Made from the
# convention's description, as the deltas above.
NEW_ITEMS = [[U1], [T1], [U2]]


def _continued(data, seed: str, first_known: bool = True) -> None:
    t = Trace(seed + "cont")
    t.span("invoke_agent weather", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather"},
           start=0, end=10)
    for i, (new, out) in enumerate(zip(NEW_ITEMS, OUTPUTS)):
        a = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": "m",
             "gen_ai.system_instructions": json.dumps(SYSTEM), "gen_ai.input.messages": json.dumps(new),
             "gen_ai.output.messages": json.dumps([out]), "gen_ai.response.id": f"resp_{seed}{i}"}
        if i:
            a["gen_ai.request.previous_response.id"] = f"resp_{seed}{i - 1}" if first_known or i > 1 else "resp_gone"
        t.span("chat m", a, parent=t.spans[0].span_id, start=1 + i, end=1.5 + i)
    t.span("reward", {"agentlightning.reward.0.value": 1.0}, parent=t.spans[0].span_id, start=9, end=9.5)
    write_spans(str(data), [t])


def test_calls_that_continue_a_stored_response_get_the_history_the_model_saw(tmp_path):
    _conversation(tmp_path / "full", False, "f")
    _continued(tmp_path / "cont", "c")
    build(TransformConfig(data=str(tmp_path / "full"), settle=0))
    s = build(TransformConfig(data=str(tmp_path / "cont"), settle=0))
    full, cont = _rows(tmp_path / "full"), _rows(tmp_path / "cont")
    assert cont["input_messages"].to_list() == full["input_messages"].to_list()
    assert [("history_from_previous_response" in f) for f in cont["flags"].to_list()] == [False, True, True]
    assert s.flagged["history_from_previous_response"] == 2


def test_a_call_continuing_a_response_the_lake_lacks_is_flagged_and_not_trained_on(tmp_path):
    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.select import select

    _continued(tmp_path, "x", first_known=False)
    s = build(TransformConfig(data=str(tmp_path), settle=0))
    said = next(line for line in s.lines() if "history_incomplete" in line)
    assert said.startswith("rows flagged history_incomplete: 2; each continued a stored response") and \
        "made outside the lake, or before midnight UTC" in said  # what the user can tell from it
    rows = _rows(tmp_path)
    flags = rows["flags"].to_list()
    assert ["history_incomplete" in f for f in flags] == [False, True, True]  # the third continues the second
    # as sent, but for the tool-call turn the build puts back before its result (`history_rebuilt`)
    assert [m["content"] for m in rows["input_messages"][1]] == ["You answer about the weather.", None, "rainy, 57F"]
    sel = select(TrainConfig(data=str(tmp_path)))
    assert sorted(r["transition_id"] for r in sel.rows) == [rows["transition_id"][0]]
    assert [n for why, n in sel.excluded.items() if "history_incomplete" in why] == [2]
