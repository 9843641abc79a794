"""`nightshift build` end to end on span datasets written through the collector's
own conversion: credit, advantages, reward sources, selection, settling,
idempotence, and bad input that must flag rows, never crash."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import polars as pl
import pyarrow as pa
import pytest

from nightshift.collector.datasets import DatasetStore
from nightshift.schemas import feedback as feedback_schema
from nightshift.transform.build import BuildError, build
from nightshift.transform.config import TransformConfig
from traces import T0, Trace, genai_call, write_logs, write_spans

DAY = 86_400 * 10**9


def run(data, **kw) -> tuple[pl.DataFrame, object]:
    cfg = TransformConfig(data=str(data), settle=0)
    for k, v in kw.items():
        obj = cfg
        *path, last = k.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, v)
    s = build(cfg)
    path = f"{data}/transitions"
    df = pl.read_parquet(path, hive_partitioning=True) if os.path.isdir(path) and any(
        n.startswith("date=") for n in os.listdir(path)) else pl.DataFrame()
    if df.height:
        df = df.sort("trajectory_id", "step")
    return df, s


def episode(seed: str, reward: float | None, *, user: str = "task", calls: int = 3, agent: str = "solver",
            extra_reward_attrs: dict | None = None) -> Trace:
    """An agent span around `calls` chat calls, then an Agent Lightning reward span."""
    t = Trace(seed)
    root = t.span(f"invoke_agent {agent}", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent},
                  start=0, end=20)
    for i in range(calls):
        t.span("chat m1", genai_call(user if i == 0 else f"{user} step {i}", f"answer {i}"), parent=root,
               start=1 + 2 * i, end=2 + 2 * i)
    if reward is not None or extra_reward_attrs:
        a = {} if reward is None else {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": reward}
        t.span("agentlightning.annotation", {**a, **(extra_reward_attrs or {})}, parent=root, start=15, end=15.5)
    return t


# --- credit assignment, hand-computed -----------------------------------------------------


@pytest.mark.parametrize("strategy,rewards,returns", [
    ("identical", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]),
    ("discounted", [0.25, 0.5, 1.0], [0.25, 0.5, 1.0]),  # gamma 0.5
    ("last", [None, None, 1.0], [None, None, 1.0]),
])
def test_credit_strategies(tmp_path, strategy, rewards, returns):
    write_spans(tmp_path, [episode("a", 1.0)])
    df, _ = run(tmp_path, credit__strategy=strategy, credit__gamma=0.5, advantage__baseline="none")
    assert df["reward"].to_list() == rewards
    assert df["return"].to_list() == returns
    assert df["step"].to_list() == [0, 1, 2] and set(df["num_steps"]) == {3}


def test_per_step_credit_gives_intermediate_rewards_to_the_preceding_call(tmp_path):
    t = Trace("ps")
    root = t.span("invoke_agent a", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"}, start=0, end=20)
    for i in range(3):
        t.span("chat m1", genai_call(f"q{i}", "x"), parent=root, start=1 + 3 * i, end=2 + 3 * i)
    # After call 0 (ended at 2, before call 1 at 4): an intermediate reward of 0.5.
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.5},
           parent=root, start=2.5, end=2.6)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 2.0},
           parent=root, start=10, end=10.1)
    write_spans(tmp_path, [t])
    df, _ = run(tmp_path, credit__strategy="per_step", credit__gamma=0.5, advantage__baseline="none")
    # r = [0.5, 0, 2.0]; G2 = 2, G1 = 0 + .5*2 = 1, G0 = .5 + .5*1 = 1
    assert df["reward"].to_list() == [0.5, 0.0, 2.0]
    assert df["return"].to_list() == [1.0, 1.0, 2.0]


def test_group_baseline_and_trajectory_weights(tmp_path):
    # Two attempts at the same task (same first user message) and one other task.
    write_spans(tmp_path, [episode("a", 1.0, user="same", calls=2), episode("b", 0.0, user="same", calls=4),
                           episode("c", 0.6, user="other", calls=1)])
    df, _ = run(tmp_path)
    by = {r["trajectory_id"]: r for r in df.iter_rows(named=True)}
    same = df.filter(pl.col("group_id") == df.filter(pl.col("num_steps") == 2)["group_id"][0])
    assert same["trajectory_id"].n_unique() == 2
    # Each trajectory weighs 1 in total: mean of returns = (1 + 0) / 2 -> advantages +-0.5.
    assert sorted(set(same["advantage"].round(9))) == [-0.5, 0.5]
    assert df.group_by("trajectory_id").agg(pl.col("weight").sum())["weight"].round(9).to_list() == [1.0] * 3
    # A group of one falls back to the batch baseline: weighted mean of (1, 0, 0.6) = 0.5333.
    other = df.filter(pl.col("num_steps") == 1)
    assert other["advantage"][0] == pytest.approx(0.6 - (1.0 + 0.0 + 0.6) / 3)
    assert len(by) == 3


def test_normalized_advantages_and_no_spread(tmp_path):
    write_spans(tmp_path, [episode("a", 1.0, user="q"), episode("b", 0.0, user="q"), episode("c", 0.5, user="z"),
                           episode("d", 0.5, user="z")])
    df, _ = run(tmp_path, advantage__normalize=True)
    q = df.filter(pl.col("reward") != 0.5)
    assert sorted(set(q["advantage"].round(6))) == [-1.0, 1.0]  # (r - 0.5) / 0.5
    assert set(df.filter(pl.col("reward") == 0.5)["advantage"]) == {0.0}  # no spread: 0, not NaN


# --- reward sources -----------------------------------------------------------------------


def test_agent_lightning_reward_list_primary_is_element_0(tmp_path):
    t = episode("x", None, extra_reward_attrs={
        "agentlightning.reward.0.name": "acc", "agentlightning.reward.0.value": 0.75,
        "agentlightning.reward.1.name": "len", "agentlightning.reward.1.value": 0.2})
    write_spans(tmp_path, [t])
    df, s = run(tmp_path)
    assert set(df["reward"]) == {0.75} and set(df["reward_source"]) == {"span:agentlightning"}
    df, _ = run(tmp_path, reward__name="len")
    assert set(df["reward"]) == {0.2}


def test_legacy_reward_span_openinference_annotations_and_user_keys(tmp_path):
    a = Trace("legacy")
    r = a.span("agent", {"agent.name": "w"}, start=0, end=9)
    a.span("openai.chat.completion", {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
                                      "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "yo",
                                      "llm.request.type": "chat"}, parent=r, start=1, end=2)
    a.span("agentlightning.reward", {"reward": 0.3}, parent=r, start=3, end=3.1)
    b = Trace("oi")
    b.span("ChatCompletion", {"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                              "llm.input_messages.0.message.content": "hi", "llm.output_messages.0.message.role": "assistant",
                              "llm.output_messages.0.message.content": "yo",
                              "annotations.0.annotation.name": "correct", "annotations.0.annotation.score": 0.9},
           start=1, end=2)
    c = Trace("user")
    c.span("chat m1", {**genai_call("hi", "yo"), "app.score": 4.0}, start=1, end=2)
    write_spans(tmp_path, [a, b, c])
    df, s = run(tmp_path, reward__keys=["app.score"])
    got = {row["convention"]: (row["reward"], row["reward_source"]) for row in df.iter_rows(named=True)}
    assert got == {"openllmetry_legacy": (0.3, "span:agentlightning"),
                   "openinference": (0.9, "span:openinference_annotations"),
                   "otel_genai": (4.0, "span:app.score")}


def test_nan_and_text_rewards_are_counted_and_ignored(tmp_path):
    write_spans(tmp_path, [episode("n", None, extra_reward_attrs={
        "agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": float("nan")}),
        episode("t", None, extra_reward_attrs={"agentlightning.reward.0.name": "primary",
                                               "agentlightning.reward.0.value": "great"})])
    df, s = run(tmp_path)
    assert df["reward"].null_count() == df.height
    assert s.bad_rewards == 2 and s.unrated == 2
    assert any("not finite" in line for line in s.lines())


def _feedback(data, rows: list[dict], batch: str = "fb") -> None:
    cols = {f.name: [r.get(f.name) for r in rows] for f in feedback_schema.SCHEMA}
    t = pa.table({k: pa.array(v, feedback_schema.SCHEMA.field(k).type) for k, v in cols.items()},
                 schema=feedback_schema.SCHEMA)
    w = DatasetStore(str(data)).writer("feedback", batch)
    w.add(t, [r["received_time"] for r in rows])
    w.commit()


def test_feedback_overrides_span_reward_and_targets_a_call(tmp_path):
    a, b = episode("a", 0.0), episode("b", 0.0)
    write_spans(tmp_path, [a, b])
    _feedback(tmp_path, [
        {"feedback_id": "f1", "trace_id": a.hex, "name": "primary", "value": 1.0, "received_time": T0 + DAY // 2,
         "source": "http"},
        # A later label for the same trace wins.
        {"feedback_id": "f2", "trace_id": a.hex, "name": "primary", "value": 0.8, "received_time": T0 + DAY // 2 + 1,
         "source": "http"},
    ])
    df, s = run(tmp_path, reward__name="primary")
    got = {r["trace_id"]: (r["reward"], r["reward_source"]) for r in df.iter_rows(named=True)}
    assert got[a.hex] == (0.8, "feedback:primary")
    assert got[b.hex] == (0.0, "span:agentlightning")
    assert s.rewards_by_source == {"feedback": 1, "span": 1}
    df, _ = run(tmp_path, reward__name="primary", reward__prefer=["span", "feedback"])
    assert {r["reward"] for r in df.filter(pl.col("trace_id") == a.hex).iter_rows(named=True)} == {0.0}


def test_feedback_outranks_a_primary_span_reward_by_default(tmp_path):
    """No `reward.name` set: `reward.prefer` (feedback first) decides between a span's
    primary reward and a user's label posted later, whatever the label is called."""
    a, b = episode("a", 0.0), episode("b", 0.0)
    write_spans(tmp_path, [a, b])
    _feedback(tmp_path, [{"feedback_id": "u1", "trace_id": a.hex, "name": "user_rating", "value": 1.0,
                          "received_time": T0 + DAY // 2, "source": "http"}])
    df, s = run(tmp_path)
    got = {r["trace_id"]: (r["reward"], r["reward_source"]) for r in df.iter_rows(named=True)}
    assert got[a.hex] == (1.0, "feedback:user_rating")
    assert got[b.hex] == (0.0, "span:agentlightning")
    df, _ = run(tmp_path, reward__prefer=["span", "feedback"])
    assert {r["reward"] for r in df.filter(pl.col("trace_id") == a.hex).iter_rows(named=True)} == {0.0}


def test_feedback_by_conversation_id(tmp_path):
    t = episode("conv", None)
    t.spans[1].attrs["gen_ai.conversation.id"] = "session-7"
    write_spans(tmp_path, [t])
    _feedback(tmp_path, [{"feedback_id": "c", "conversation_id": "session-7", "name": "thumbs", "value": 1.0,
                          "received_time": T0 + 5, "source": "http"}])
    df, _ = run(tmp_path)
    assert set(df["reward"]) == {1.0} and set(df["reward_source"]) == {"feedback:thumbs"}


def test_reward_functions_numbers_dicts_and_errors(tmp_path, monkeypatch):
    mod = tmp_path / "myrewards.py"
    mod.write_text(
        "def length(traj):\n"
        "    return float(len(traj.steps))\n"
        "def named(traj):\n"
        "    return {'quality': 0.25, 'cost': -1}\n"
        "def broken(traj):\n"
        "    if traj.steps[0]['input_messages'][-1]['content'] == 'boom':\n"
        "        raise RuntimeError('judge unavailable')\n"
        "    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    write_spans(tmp_path, [episode("a", None, calls=2), episode("b", None, calls=3, user="boom")])
    df, s = run(tmp_path, reward__functions=["myrewards:length"])
    assert df.group_by("num_steps").agg(pl.col("reward").first()).sort("num_steps")["reward"].to_list() == [2.0, 3.0]
    assert set(df["reward_source"]) == {"function:myrewards:length"}
    df, _ = run(tmp_path, reward__functions=["myrewards:named"], reward__name="cost")
    assert set(df["reward"]) == {-1.0}
    df, s = run(tmp_path, reward__functions=["myrewards:broken"])
    assert s.reward_errors == 1
    boom = df.filter(pl.col("num_steps") == 3)
    assert boom["reward"].null_count() == 3 and all("reward_function_error" in f for f in boom["flags"])
    assert set(df.filter(pl.col("num_steps") == 2)["reward"]) == {1.0}
    with pytest.raises(BuildError, match="cannot be loaded"):
        run(tmp_path, reward__functions=["myrewards:missing"])


# --- agents, selection --------------------------------------------------------------------


def three_agents(seed: str = "3a") -> Trace:
    t = Trace(seed)
    root = t.span("workflow", {}, start=0, end=30)
    for i, name in enumerate(("writer", "checker", "rewriter")):
        a = t.span(f"invoke_agent {name}", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": name},
                   parent=root, start=1 + 5 * i, end=5 + 5 * i)
        t.span("tool lookup", {"gen_ai.operation.name": "execute_tool"}, parent=a, start=2 + 5 * i, end=2.5 + 5 * i)
        inner = t.span("step", {}, parent=a, start=2 + 5 * i, end=4 + 5 * i)
        t.span("chat m1", genai_call(f"{name} task", f"{name} out"), parent=inner, start=3 + 5 * i, end=3.5 + 5 * i)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 1.0},
           parent=root, start=29, end=29.1)
    return t


def test_agent_names_from_nearest_enclosing_agent_and_selection(tmp_path):
    write_spans(tmp_path, [three_agents()])
    df, _ = run(tmp_path)
    assert df["agent_name"].to_list() == ["writer", "checker", "rewriter"]
    df, s = run(tmp_path, agents_include="writer")  # writer and rewriter (a regex search)
    assert df["agent_name"].to_list() == ["writer", "rewriter"] and s.dropped_by_agent == 1
    assert df["step"].to_list() == [0, 2] and set(df["num_steps"]) == {3}
    df, _ = run(tmp_path, agents_include="writer", agents_exclude="^re")
    assert df["agent_name"].to_list() == ["writer"]


@pytest.mark.parametrize("attrs,expected", [
    ({"openinference.span.kind": "AGENT", "agent.name": "oi-agent"}, "oi-agent"),
    ({"traceloop.span.kind": "agent", "traceloop.entity.name": "tl-agent"}, "tl-agent"),
    ({"recipient_agent_type": "autogen-agent"}, "autogen-agent"),
    ({"langchain.chain.type": "lc-agent"}, "lc-agent"),
    ({"executor.id": "maf-agent"}, "maf-agent"),
])
def test_agent_conventions(tmp_path, attrs, expected):
    t = Trace("ag")
    a = t.span("agent", attrs, start=0, end=5)
    t.span("chat m1", genai_call("q", "a"), parent=a, start=1, end=2)
    write_spans(tmp_path, [t])
    df, _ = run(tmp_path)
    assert df["agent_name"].to_list() == [expected]


# --- producers' quirks ----------------------------------------------------------------------


def test_double_instrumentation_gives_one_row(tmp_path):
    t = Trace("dup")
    outer = t.span("ChatOpenAI", {"openinference.span.kind": "LLM", "llm.input_messages.0.message.role": "user",
                                  "llm.input_messages.0.message.content": "hi",
                                  "llm.output_messages.0.message.role": "assistant",
                                  "llm.output_messages.0.message.content": "yo"}, start=0, end=3)
    t.span("chat m1", {**genai_call("hi", "yo"), "gen_ai.response.id": "r1"}, parent=outer, start=1, end=2)
    # A sibling recording the same response id (a second client-level instrumentation).
    t.span("openai.chat", {"gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi", "llm.request.type": "chat",
                           "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "yo",
                           "gen_ai.response.id": "r1"}, parent=outer, start=1, end=2)
    write_spans(tmp_path, [t])
    df, s = run(tmp_path)
    assert df.height == 1 and df["convention"][0] == "otel_genai"
    assert s.duplicates == 2


def test_openlit_missing_tool_call_turn_is_rebuilt(tmp_path):
    t = Trace("openlit")
    t.span("chat m1", genai_call("2+2?", tool_call=("call_1", "calc", {"e": "2+2"})), start=1, end=2)
    history = [{"role": "user", "parts": [{"type": "text", "content": "2+2?"}]},
               {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "4"}]}]
    second = genai_call("x", "4")
    second["gen_ai.input.messages"] = json.dumps(history)  # no assistant turn: what openlit sends
    t.span("chat m1", second, start=3, end=4)
    write_spans(tmp_path, [t])
    df, _ = run(tmp_path)
    msgs = df["input_messages"][1].to_list()
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"]
    assert msgs[1]["tool_calls"][0]["id"] == "call_1" and msgs[2]["tool_call_id"] == "call_1"
    assert "history_rebuilt" in df["flags"][1].to_list()


def test_logfire_finish_reason_and_nested_tools_pydantic_user_tool_results(tmp_path):
    t = Trace("lf")
    tools = [{"type": "function", "function": {"name": "calc", "description": "d", "parameters": {"type": "object"}}}]
    a = genai_call("q", "a", tools=tools)
    out = json.loads(a["gen_ai.output.messages"])
    del out[0]["finish_reason"]
    a["gen_ai.output.messages"] = json.dumps(out)
    a["gen_ai.response.finish_reasons"] = '["tool_calls"]'
    a["gen_ai.input.messages"] = json.dumps([
        {"role": "user", "parts": [{"type": "text", "content": "q"}]},
        {"role": "assistant", "parts": [{"type": "tool_call", "id": "c9", "name": "calc", "arguments": {"e": 1}}]},
        {"role": "user", "parts": [{"type": "tool_call_response", "id": "c9", "response": 1}]},  # pydantic-ai v5
    ])
    t.span("chat m1", a, start=1, end=2)
    flat = genai_call("q", "a", tools=[{"type": "function", "name": "calc", "parameters": {"type": "object"}}])
    t.span("chat m1", flat, start=3, end=4)
    write_spans(tmp_path, [t])
    df, _ = run(tmp_path)
    assert df["finish_reason"][0] == "tool_call"
    assert [m["role"] for m in df["input_messages"][0].to_list()] == ["user", "assistant", "tool"]
    for tools_json in df["tools"]:
        assert json.loads(tools_json)[0]["function"]["name"] == "calc"


def test_log_events_supply_content_legacy_and_details(tmp_path):
    t = Trace("ev")
    s1 = t.span("chat m1", {"gen_ai.operation.name": "chat", "gen_ai.system": "openai"}, start=1, end=2)
    s2 = t.span("chat m1", {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai"}, start=3, end=4)
    write_spans(tmp_path, [t])
    write_logs(tmp_path, [
        {"trace": t, "span": s1, "name": "gen_ai.system.message", "body": {"content": "be brief"}},
        {"trace": t, "span": s1, "name": "gen_ai.user.message", "body": {"content": "hi"}},
        {"trace": t, "span": s1, "name": "gen_ai.choice", "body": {"index": 0, "finish_reason": "stop",
                                                                  "message": {"content": "hello"}}},
        {"trace": t, "span": s2, "name": "gen_ai.client.inference.operation.details", "attrs": {
            "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "again"}]}],
            "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "sure"}],
                                        "finish_reason": "stop"}]}},
    ])
    df, _ = run(tmp_path)
    assert df["convention"].to_list() == ["otel_genai_events_legacy", "otel_genai_event"]
    assert [m["content"] for m in df["input_messages"][0].to_list()] == ["be brief", "hi"]
    assert df["output_message"].struct.field("content").to_list() == ["hello", "sure"]
    assert df["provider"].to_list() == ["openai", "openai"]


def test_agent_lightning_token_ids_and_logprobs(tmp_path):
    t = Trace("agl")
    t.span("openai.chat.completion", {
        "gen_ai.system": "openai", "gen_ai.request.model": "q", "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": "hi", "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "yo",
        "gen_ai.completion.0.finish_reason": "stop", "prompt_token_ids": [1, 2, 3], "response_token_ids": [4, 5],
        "logprobs.content": json.dumps([{"token": "y", "logprob": -0.5}, {"token": "o", "logprob": -0.25}]),
        "gen_ai.usage.prompt_tokens": 3, "gen_ai.usage.completion_tokens": 2}, start=1, end=2)
    write_spans(tmp_path, [t])
    df, _ = run(tmp_path)
    r = df.row(0, named=True)
    assert r["convention"] == "agentlightning"
    assert r["prompt_token_ids"] == [1, 2, 3] and r["completion_token_ids"] == [4, 5]
    assert r["completion_logprobs"] == [-0.5, -0.25] and (r["input_tokens"], r["output_tokens"]) == (3, 2)


# --- bad input: flagged rows and counts, never a crash -------------------------------------------


def test_bad_input_is_flagged_not_fatal(tmp_path):
    t = Trace("bad")
    r = t.span("invoke_agent a", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"}, start=5, end=9)
    bad_json = genai_call("q", "a")
    bad_json["gen_ai.input.messages"] = "[{not json"
    t.span("chat m1", bad_json, parent=r, start=4, end=6)  # starts before its parent: clock skew
    wrong = genai_call("q", "a")
    wrong["gen_ai.output.messages"] = 42
    t.span("chat m1", wrong, parent=r, start=6, end=5.5)  # ends before it starts
    t.span("chat m1", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"}, parent=r, start=7, end=8,
           dropped=12)  # content capture off, attributes dropped
    o = Trace("orphan")
    o.span("chat m1", genai_call("q", "a"), parent=b"\x01" * 8, start=1, end=2)  # parent never arrived
    write_spans(tmp_path, [t, o])
    df, s = run(tmp_path)
    assert df.height == 4
    flags = {(r["trace_id"], r["step"]): set(r["flags"]) for r in df.iter_rows(named=True)}
    assert {"invalid_content", "clock_skew"} <= {f.split(":")[0] for f in flags[(t.hex, 0)]}
    assert "clock_skew" in flags[(t.hex, 1)] and any(f.startswith("invalid_content") for f in flags[(t.hex, 1)])
    assert "content_missing" in flags[(t.hex, 2)]
    assert df.filter(pl.col("step") == 2)["truncated"].to_list() == [True]
    assert "orphan" in flags[(o.hex, 0)]
    text = "\n".join(s.lines())
    assert "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT" in text and s.content_missing == {"otel_genai": 1}


# --- settling, windows, idempotence ----------------------------------------------------------------


def test_settle_waits_for_quiet_and_a_finished_root(tmp_path):
    done, running = episode("done", 1.0), episode("running", 1.0)
    running.spans[0].end = None  # the root span has not ended
    write_spans(tmp_path, [done, running], received_ns=T0 + 10**9)
    cfg = TransformConfig(data=str(tmp_path), settle=600)
    s = build(cfg, now_ns=T0 + 10**9 + 60 * 10**9)  # one minute later: nothing settled
    assert (s.transitions, s.waiting) == (0, 2)
    s = build(cfg, now_ns=T0 + 10**9 + 700 * 10**9)  # quiet for 10 minutes: the finished one
    assert (s.transitions, s.waiting) == (3, 1)
    s = build(cfg, now_ns=T0 + 10**9 + 3601 * 10**9)  # a root that never ends does not block forever
    assert (s.transitions, s.waiting) == (6, 0)


def test_rebuild_is_byte_identical_and_replaces_only_touched_partitions(tmp_path):
    write_spans(tmp_path, [episode("d1a", 1.0), episode("d1b", 0.0)], batch="d1")
    write_spans(tmp_path, [episode("d2a", 1.0)], batch="d2", base_ns=T0 + DAY)
    run(tmp_path)
    files = sorted(str(p) for p in (tmp_path / "transitions").rglob("*.parquet"))
    assert len(files) == 2
    first = {f: open(f, "rb").read() for f in files}
    run(tmp_path)
    assert {f: open(f, "rb").read() for f in files} == first
    # New spans on day 2 only: a window over day 2 rewrites day 2, leaves day 1 alone.
    day1 = [f for f in files if "2025-11-22" in f][0]
    mtime = os.stat(day1).st_mtime_ns
    write_spans(tmp_path, [episode("d2b", 0.5)], batch="d2b", base_ns=T0 + DAY)
    df, s = run(tmp_path, since="2025-11-23")
    assert s.partitions == ["2025-11-23"] and os.stat(day1).st_mtime_ns == mtime
    assert df.filter(pl.col("date") == pl.date(2025, 11, 23))["trajectory_id"].n_unique() == 2
    assert not [n for n in os.listdir(tmp_path / "transitions") if n.startswith(".")]


def test_interrupted_swap_is_repaired(tmp_path):
    write_spans(tmp_path, [episode("r", 1.0)])
    run(tmp_path)
    root = tmp_path / "transitions"
    (root / "date=2025-11-22").rename(root / ".old-deadbeef-date=2025-11-22")  # crash between the two renames
    (root / ".build-x").mkdir()
    df, _ = run(tmp_path)
    assert df.height == 3 and sorted(os.listdir(root)) == ["date=2025-11-22"]


def test_buckets_give_the_same_rows_as_one_pass(tmp_path):
    write_spans(tmp_path, [episode(f"e{i}", i % 2, user=f"u{i % 3}") for i in range(30)] + [three_agents()])
    one, _ = run(tmp_path)
    many, s = run(tmp_path, memory_budget=2000)
    assert s.buckets > 1
    cols = [c for c in one.columns if c != "date"]
    assert one.select(cols).sort("transition_id").equals(many.select(cols).sort("transition_id"))


def test_conversation_trajectories_span_traces(tmp_path):
    a, b = episode("c1", None, calls=1), episode("c2", 1.0, calls=2)
    for t in (a, b):
        t.spans[1].attrs["gen_ai.conversation.id"] = "conv-1"
    b.spans = [s for s in b.spans]
    write_spans(tmp_path, [a, b], base_ns=T0)
    df, _ = run(tmp_path, trajectory="conversation")
    assert df["trajectory_id"].n_unique() == 1 and df["num_steps"].to_list() == [3, 3, 3]
    assert set(df["reward"]) == {1.0} and df["trace_id"].n_unique() == 2


def test_group_by_attribute(tmp_path):
    a, b = episode("g1", 1.0, user="x"), episode("g2", 0.0, user="y")
    for t in (a, b):
        t.spans[0].attrs["task.id"] = "T-1"
    write_spans(tmp_path, [a, b])
    df, _ = run(tmp_path, group_by="attribute:task.id")
    assert df["group_id"].n_unique() == 1 and sorted(set(df["advantage"])) == [-0.5, 0.5]


# --- the command ------------------------------------------------------------------------------


def test_cli_build_prints_a_summary_and_explains_itself(tmp_path):
    write_spans(tmp_path, [episode("cli", 1.0)])
    env = {**os.environ, "NIGHTSHIFT_TRANSFORM_CREDIT_STRATEGY": "last"}
    r = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(tmp_path), "--settle", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "transitions: 3 rows from 1 trajectories" in r.stdout
    df = pl.read_parquet(tmp_path / "transitions")
    assert df["reward"].null_count() == 2  # the environment chose `last`
    h = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--help"], capture_output=True, text=True)
    assert "credit" in h.stdout and "--settle" in h.stdout and "per_step" in h.stdout
    bad = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(tmp_path), "--credit", "all"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "credit.strategy" in bad.stderr
    empty = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(tmp_path / "none")],
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "no spans dataset" in empty.stderr


def test_build_through_fsspec_object_store(tmp_path):
    import fsspec

    url = f"memory://nightshift-{tmp_path.name}"
    write_spans(url, [episode("m1", 1.0), episode("m2", 0.0)])
    s = build(TransformConfig(data=url, settle=0))
    assert s.transitions == 6
    fs = fsspec.filesystem("memory")
    files = fs.glob(f"{url.removeprefix('memory://')}/transitions/date=*/*.parquet")
    assert len(files) == 1
    with fs.open(files[0], "rb") as fh:
        assert pl.read_parquet(fh).height == 6
    s = build(TransformConfig(data=url, settle=0, memory_budget=1000))  # bucketed, rewritten in place
    assert s.buckets > 1 and s.transitions == 6
    assert len(fs.glob(f"{url.removeprefix('memory://')}/transitions/date=*/*.parquet")) == 1


def test_each_call_records_the_version_that_produced_it_and_its_temperature(tmp_path):
    """The trainer recomputes μ with the weights of the version that made each call,
    at its temperature: the build must carry both (`name@v0002` as the server
    answered it; the base model's calls carry none)."""
    t = Trace("pv")
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=20)
    a = genai_call("q1", "a1", model="agent")
    a.update({"gen_ai.response.model": "agent@v0002", "gen_ai.request.temperature": 0.7})
    b = genai_call("q2", "a2", model="world-policy")
    b["gen_ai.request.temperature"] = float("nan")  # not a temperature: left null, never NaN
    c = genai_call("q3", "a3", model="agent@v0011")
    del c["gen_ai.response.model"]
    for i, attrs in enumerate((a, b, c)):
        t.span("chat", attrs, parent=root, start=1 + 2 * i, end=2 + 2 * i)
    write_spans(str(tmp_path), [t])
    df, _ = run(tmp_path)
    assert df["policy_version"].to_list() == ["v0002", None, "v0011"]
    assert df["temperature"].to_list() == [0.7, None, None]
    # what the agent asked for and what answered, apart: users filter on the first
    assert df["request_model"].to_list() == ["agent", "world-policy", "agent@v0011"]
    assert df["response_model"].to_list() == ["agent@v0002", "world-policy", None]


def test_a_call_whose_tool_call_errored_gets_less_credit_than_its_neighbours(tmp_path):
    """Identical credit gives every call of a trajectory R; the call whose tool call
    came back as an error (the tool message the next call saw says so) is the one
    that went wrong, so its return is lowered by credit.tool_error_penalty."""
    t = Trace("te")
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=20)
    first = genai_call("look it up", tool_call=("c1", "lookup", {"q": "x"}))
    history = [{"role": "user", "parts": [{"type": "text", "content": "look it up"}]},
               {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "lookup", "arguments": {"q": "x"}}]},
               {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1",
                                           "response": "Error: no such item"}]}]
    second = genai_call("try again", "done", history=history)
    t.span("chat", first, parent=root, start=1, end=2)
    t.span("chat", second, parent=root, start=3, end=4)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                         "agentlightning.reward.0.value": 1.0}, parent=root, start=15, end=15.5)
    write_spans(str(tmp_path), [t])
    df, _ = run(tmp_path)
    assert df["return"].to_list() == [0.5, 1.0]
    assert "tool_error" in df["flags"][0].to_list() and "tool_error" not in df["flags"][1].to_list()
    df, _ = run(tmp_path, credit__tool_error_penalty=0.0)  # off: identical credit as before
    assert df["return"].to_list() == [1.0, 1.0]


def test_a_call_in_an_unknown_layout_is_counted_by_instrumentation_and_left_out(tmp_path):
    """A framework release that renamed its attributes must not crash the build nor
    produce a row with guessed content: the call is left out, counted under its
    instrumentation with an example span id, and the rest of the trajectory is built."""
    t = Trace("layout", scope="openinference.instrumentation.newframework")
    root = t.span("agent run", {"openinference.span.kind": "AGENT", "agent.name": "solver"}, start=0, end=10)
    t.span("chat", genai_call("q1", "a1"), parent=root, start=1, end=2)
    odd = t.span("NewLLM.invoke", {"openinference.span.kind": "LLM", "llm.request.v2": json.dumps({"prompt": "q2"}),
                                   "llm.reply.v2": "a2"}, parent=root, start=3, end=4)
    t.span("chat", genai_call("q3", "a3"), parent=root, start=5, end=6)
    write_spans(str(tmp_path), [t])
    df, summary = run(tmp_path)
    assert df.sort("step")["output_message"].struct.field("content").to_list() == ["a1", "a3"]
    assert df["num_steps"].to_list() == [2, 2]
    calls, unknown, example = summary.by_instrumentation["openinference.instrumentation.newframework"]
    assert (calls, unknown, example) == (3, 1, odd.hex())
    lines = "\n".join(summary.lines())
    assert "calls by instrumentation: openinference.instrumentation.newframework 3" in lines
    assert f"layout unknown (openinference.instrumentation.newframework): 1 of 3, e.g. span {odd.hex()}" in lines


def test_concurrent_rollouts_of_one_prompt_are_not_taken_for_one_call_recorded_twice(tmp_path):
    """A detached client span is merged into the framework span around the same call
    only when another instrumentation recorded it: two agents asking the same thing
    at the same time, recorded by one instrumentation, stay two calls."""
    traces = []
    for i in range(2):
        t = Trace(f"rollout{i}", scope="opentelemetry.instrumentation.openai_v2")
        if i == 0:
            root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                          start=0, end=10)
            t.span("chat", genai_call("same question", "same answer"), parent=root, start=1, end=5)
        else:  # the other rollout's call, a root of its own, inside the first one's time
            t.span("chat", genai_call("same question", "same answer"), start=2, end=4)
        traces.append(t)
    write_spans(str(tmp_path), traces)
    df, summary = run(tmp_path)
    assert df.height == 2 and df["trajectory_id"].n_unique() == 2 and summary.duplicates == 0


# --- bad input at scale: unreadable files, huge values, huge traces, ids that are not ids ------------


def _span_file(data, batch: str) -> str:
    [path] = [str(p) for p in (data / "spans").rglob(f"*{batch}*.parquet")]
    return path


@pytest.mark.parametrize("budget", [None, 2000])  # one pass, and the bucket split
def test_unreadable_span_files_are_named_and_everything_else_is_built(tmp_path, budget):
    import pyarrow.parquet as pq

    write_spans(tmp_path, [episode("good", 1.0)], batch="good")
    write_spans(tmp_path, [episode("torn", 1.0)], batch="torn")
    write_spans(tmp_path, [episode(f"rg{i}", 1.0) for i in range(2)], batch="groups")
    torn = _span_file(tmp_path, "torn")
    with open(torn, "r+b") as fh:  # a copy cut short: the footer never arrived
        fh.truncate(os.path.getsize(torn) // 2)
    groups = _span_file(tmp_path, "groups")
    table = pq.read_table(groups)
    pq.write_table(table, groups, row_group_size=table.num_rows // 2 + 1, compression="zstd")  # two row groups
    md = pq.ParquetFile(groups).metadata
    col = md.row_group(0).column(md.row_group(0).num_columns - 1)
    with open(groups, "r+b") as fh:  # flip the bytes of one column chunk of the first row group
        start = col.data_page_offset
        fh.seek(start)
        chunk = fh.read(col.total_compressed_size)
        fh.seek(start)
        fh.write(bytes(b ^ 0x5A for b in chunk))
    (tmp_path / "spans" / os.path.basename(os.path.dirname(torn)) / "junk.parquet").write_bytes(b"not parquet at all")
    df, s = run(tmp_path, **({"memory_budget": budget} if budget else {}))
    named = "\n".join(s.unreadable)
    assert os.path.basename(torn) in named and "junk.parquet" in named
    assert f"{os.path.basename(groups)}: row group 1 of 2 unreadable" in named
    # the good file and the readable row group are built; the summary says what was skipped
    assert Trace("good").hex in set(df["trace_id"]) and df.height >= 3
    assert any(line.startswith("UNREADABLE span data") for line in s.lines())


def test_token_ids_that_are_not_lists_are_counted_and_the_row_kept(tmp_path):
    t = Trace("ids")
    attrs = {"gen_ai.system": "openai", "gen_ai.prompt.0.role": "user", "gen_ai.prompt.0.content": "hi",
             "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "yo",
             "prompt_token_ids": "tokens: 1 2 3", "response_token_ids": [4, 5]}
    sid = t.span("openai.chat.completion", attrs, start=1, end=2)
    write_spans(tmp_path, [t])
    df, s = run(tmp_path)
    assert df.height == 1 and df["prompt_token_ids"].to_list() == [None] and df["completion_token_ids"].to_list() == [[4, 5]]
    assert s.bad_token_ids == [1, sid.hex()]
    assert any("not a list of integers" in line and sid.hex() in line for line in s.lines())


def test_a_50_mb_attribute_and_a_100k_span_trace_are_built(tmp_path):
    big = Trace("big")
    big.span("chat m1", genai_call("x" * (50 << 20), "short answer"), start=1, end=2)
    huge = Trace("huge")
    root = huge.span("invoke_agent a", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"},
                     start=0, end=30)
    for i in range(100_000):
        huge.span("tool step", {"gen_ai.operation.name": "execute_tool"}, parent=root, start=1 + i * 1e-4,
                  end=1 + i * 1e-4 + 5e-5)
    for i in range(50):
        huge.span("chat m1", genai_call(f"q{i}", f"a{i}"), parent=root, start=12 + i * 0.1, end=12.05 + i * 0.1)
    write_spans(tmp_path, [big], batch="big")
    write_spans(tmp_path, [huge], batch="huge")
    df, s = run(tmp_path, memory_budget=64 << 20)
    got = {r["trace_id"]: r for r in df.filter(pl.col("step") == 0).iter_rows(named=True)}
    assert len(got[big.hex]["input_messages"][0]["content"]) == 50 << 20
    assert df.filter(pl.col("trace_id") == huge.hex).height == 50 and s.spans == 100_052


# --- incremental builds ------------------------------------------------------------------------


def _mtimes(data) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (data / "transitions").rglob("*.parquet")}


def test_incremental_builds_redo_only_dates_with_new_spans_or_feedback(tmp_path):
    write_spans(tmp_path, [episode("i1", 1.0)], batch="d1")
    write_spans(tmp_path, [episode("i3", 0.0)], batch="d3", base_ns=T0 + 2 * DAY)
    write_spans(tmp_path, [episode("i5", 0.0)], batch="d5", base_ns=T0 + 4 * DAY)
    _, s = run(tmp_path, incremental=True)
    assert "full build" in s.incremental and len(s.partitions) == 3
    first = _mtimes(tmp_path)

    _, s = run(tmp_path, incremental=True)  # nothing new: nothing rewritten
    assert s.partitions == [] and "rebuilding nothing" in s.incremental and _mtimes(tmp_path) == first

    # a new trace on day 3 (a second file there): day 3 is rebuilt, the only date its trace is on
    write_spans(tmp_path, [episode("i3b", 1.0)], batch="d3late", base_ns=T0 + 2 * DAY)
    df, s = run(tmp_path, incremental=True)
    assert s.partitions == ["2025-11-24"] and s.transitions == 6
    # its rows moved the batch's mean return: the kept dates' advantages are rewritten
    assert s.repooled == ["2025-11-22", "2025-11-26"]
    # the same rows a full build gives, every column
    full, _ = run(tmp_path)
    assert df.sort("transition_id").equals(full.sort("transition_id"))

    # feedback that arrives later for the day-5 trace: that date is rebuilt with the new reward
    run(tmp_path, incremental=True)
    _feedback(tmp_path, [{"feedback_id": "late", "trace_id": Trace("i5").hex, "name": "thumbs", "value": 1.0,
                          "received_time": T0 + 6 * DAY, "source": "http"}])
    df, s = run(tmp_path, incremental=True, reward__name="thumbs")
    assert "full build" in s.incremental  # the reward's name is a setting: a new one rebuilds everything
    df, s = run(tmp_path, incremental=True, reward__name="thumbs")
    assert s.partitions == []
    _feedback(tmp_path, [{"feedback_id": "later", "trace_id": Trace("i5").hex, "name": "thumbs", "value": 0.25,
                          "received_time": T0 + 7 * DAY, "source": "http"}], batch="fb2")
    df, s = run(tmp_path, incremental=True, reward__name="thumbs")
    assert "2025-11-26" in s.partitions and "2025-11-22" not in s.partitions
    assert set(df.filter(pl.col("trace_id") == Trace("i5").hex)["reward"]) == {0.25}


def test_incremental_refuses_a_window(tmp_path):
    from nightshift.settings import SettingsError

    write_spans(tmp_path, [episode("w", 1.0)])
    with pytest.raises(SettingsError, match="incremental"):
        run(tmp_path, incremental=True, since="2025-11-22")
