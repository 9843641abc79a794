"""Prompt versions from the lake: which system prompts and tools each agent used, with
the production figures `nightshift versions` gives adapters. On recorded real runs
(the ids must equal what the same request on the wire hashes to: a router sees only
the wire) and on generated transitions (the statistics)."""

from __future__ import annotations

import datetime as dt
import json
import math
import shutil
from pathlib import Path

import polars as pl
import pytest

from nightshift.cli.main import main
from nightshift.schemas import transitions
from nightshift.schemas.prompt_identity import PromptVersion, canonical_tools, leading_system
from nightshift.prompts.versions import by_agent, interval, lines
from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig
from traces import Trace, genai_call, write_spans
from transitions_data import msg, row, write

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"
T0 = dt.datetime(2026, 11, 20, 8, tzinfo=dt.timezone.utc)


def _built(case: str, tmp_path: Path) -> Path:
    data = tmp_path / "data"
    shutil.copytree(FIXTURES / case / "spans", data / "spans")
    build(TransformConfig(data=str(data), settle=0))
    return data


@pytest.mark.parametrize("case", ["pydantic_ai/builtin/three_agents", "pydantic_ai/builtin/tool"])
def test_recorded_runs_give_each_agent_the_version_its_requests_hash_to(case, tmp_path):
    data = _built(case, tmp_path)
    program = json.loads((FIXTURES / case / "program.json").read_text())
    wire = json.loads((FIXTURES / case / "stub_calls.json").read_text())
    table = by_agent(str(data))
    agents = program["result"]["agents"] or sorted({a.agent for a in table})
    assert sorted(a.agent for a in table) == sorted(set(agents))
    # what each request on the wire hashes to, computed from the request alone
    expected = {PromptVersion.of(leading_system(c["request"]["messages"]), canonical_tools(c["request"].get("tools"))).id
                for c in wire}
    got = {v.id for a in table for v in a.versions}
    assert got == expected
    for a in table:
        assert len(a.versions) == 1 and a.current is a.versions[0] and a.versions[0].mean is None
    text = "\n".join(lines(table))
    for c in wire:
        assert leading_system(c["request"]["messages"])[0][:40] in text


def _world(rewards: list[float | None], *, agent: str = "solver", prompt: str = "Use one tool, then answer.",
           start: int = 0, tools=None) -> list[dict]:
    out = []
    for i, r in enumerate(rewards):
        k = start + i
        when = T0 + dt.timedelta(minutes=k)
        sysmsg = f"Today is {when:%Y-%m-%d}. {prompt}"
        out.append(row([msg("system", sysmsg), msg("user", f"question {k}")], "The answer is red.", r,
                       trajectory=f"{agent}{k:026d}", agent=agent, tools=tools, when=when))
    return out


def test_reward_interval_and_what_is_left_out(tmp_path):
    rows = _world([1.0] * 24 + [0.0] * 16 + [None] * 3 + [math.nan])
    write(tmp_path, rows)
    a = by_agent(str(tmp_path), min_trajectories=30).agent("solver")
    (v,) = a.versions
    assert (v.calls, v.trajectories, v.rated, v.nonfinite) == (44, 44, 40, 1)
    assert v.binary and v.mean == pytest.approx(0.6)
    from nightshift.judge.versions import interval as adapters_interval

    assert (v.low, v.high) == pytest.approx(adapters_interval([1.0] * 24 + [0.0] * 16, True))
    assert (v.low, v.high) == pytest.approx(interval([1.0] * 24 + [0.0] * 16, True))
    assert (v.low, v.high) == pytest.approx((0.4460, 0.7365), abs=1e-4)  # Wilson's, 24 of 40, worked by hand
    out = "\n".join(lines(by_agent(str(tmp_path))))
    assert "success 0.600  [" in out and "3 unrated, 1 with a NaN/inf reward" in out
    # below min_trajectories: a count, no interval
    few = by_agent(str(tmp_path), min_trajectories=41).agent("solver").versions[0]
    assert few.low is None and "too few rated trajectories" in few.figure(41)


def test_a_trajectory_counts_once_for_its_first_calls_version_with_the_outcome_of_its_last_rated_step(tmp_path):
    """A second agent (a judge) closes the trajectory with the reward: it still counts for
    the solver's prompt, and the judge's own version separately."""
    rows = []
    for k in range(4):
        when = T0 + dt.timedelta(minutes=k)
        tid = f"t{k:031d}"
        rows.append(row([msg("system", "Solve it."), msg("user", "q")], "a", None, trajectory=tid, step=0,
                        num_steps=2, agent="solver", when=when))
        rows.append(row([msg("system", "Judge the answer."), msg("user", "a")], "ok", float(k % 2), trajectory=tid,
                        step=1, num_steps=2, agent="judge", when=when + dt.timedelta(seconds=5)))
    write(tmp_path, rows)
    t = by_agent(str(tmp_path), min_trajectories=1)
    solver, judge = t.agent("solver").versions[0], t.agent("judge").versions[0]
    assert (solver.trajectories, solver.rated, solver.mean) == (4, 4, 0.5)
    assert (judge.trajectories, judge.rated, judge.mean) == (4, 4, 0.5)
    assert solver.id != judge.id


def test_a_new_deploy_is_a_new_current_version_and_per_request_dates_are_not(tmp_path):
    rows = _world([1.0, 0.0] * 10) + _world([1.0] * 10, prompt="Use one tool, read its result, then answer.", start=20)
    write(tmp_path, rows)
    a = by_agent(str(tmp_path)).agent("solver")
    assert [v.calls for v in a.versions] == [20, 10]
    assert [v.current for v in a.versions] == [False, True]
    assert "{{date}}" in a.versions[0].version.text
    # the API the later stages use: resolve one request's prompt to its version
    req = f"Today is {dt.date(2027, 1, 5)}. Use one tool, read its result, then answer."
    assert a.resolve([req], None).id == a.versions[1].id


def test_two_agents_sharing_one_prompt_keep_their_own_figures_and_are_told(tmp_path):
    rows = _world([1.0] * 5, agent="billing") + _world([0.0] * 5, agent="refunds", start=5)
    write(tmp_path, rows)
    t = by_agent(str(tmp_path), min_trajectories=1)
    b, r = t.agent("billing").versions[0], t.agent("refunds").versions[0]
    assert b.id == r.id and (b.mean, r.mean) == (1.0, 0.0)
    assert b.shared_with == ["refunds"] and r.shared_with == ["billing"]
    assert "the same prompt is sent by agent(s) refunds" in "\n".join(lines(t))


def test_calls_without_their_messages_are_counted_in_no_version(tmp_path):
    rows = _world([1.0] * 3)
    for r in rows[:2]:
        r["input_messages"], r["flags"] = [], ["content_missing"]
    write(tmp_path, rows)
    a = by_agent(str(tmp_path)).agent("solver")
    assert a.no_content == 2 and [v.calls for v in a.versions] == [1]


def test_a_prompt_name_and_version_recorded_on_the_call_span_is_shown(tmp_path):
    traces = []
    for k, version in enumerate(["3", "3", "4"]):
        t = Trace(seed=f"named{k}")
        root = t.span("invoke_agent helper", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"})
        a = genai_call("hi", "hello", history=[{"role": "system", "parts": [{"type": "text", "content": f"Prompt {version}."}]}])
        a.update({"gen_ai.prompt.name": "support", "gen_ai.prompt.version": version})
        t.span("chat m1", a, parent=root)
        traces.append(t)
    write_spans(str(tmp_path), traces)
    build(TransformConfig(data=str(tmp_path), settle=0))
    a = by_agent(str(tmp_path)).agent("helper")
    assert sorted(v.names[0] for v in a.versions) == ["support@3", "support@4"]
    assert "recorded as support@3" in "\n".join(lines(by_agent(str(tmp_path))))


def test_names_from_every_recording_instrumentation_and_only_of_the_calls_listed(tmp_path):
    # Langfuse records its version as an integer, OpenInference as text; a tool span naming a
    # prompt is no call, and its name must not reach a version (the reader reads only the row
    # groups where a listed call's span has one of the keys)
    traces = []
    for k, attrs in enumerate([{"langfuse.observation.prompt.name": "triage", "langfuse.observation.prompt.version": 7},
                               {"llm.prompt_template.version": "v2"}]):
        t = Trace(seed=f"named-elsewhere{k}")
        root = t.span("invoke_agent helper", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"})
        a = genai_call("hi", "hello", history=[{"role": "system", "parts": [{"type": "text", "content": f"Prompt {k}."}]}])
        t.span("chat m1", {**a, **attrs}, parent=root)
        t.span("execute_tool lookup", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                                       "gen_ai.prompt.name": "not-a-call"}, parent=root)
        traces.append(t)
    write_spans(str(tmp_path), traces)
    build(TransformConfig(data=str(tmp_path), settle=0))
    a = by_agent(str(tmp_path)).agent("helper")
    assert sorted(n for v in a.versions for n in v.names) == ["?@v2", "triage@7"]


def test_the_lean_rows_name_every_call_as_a_frame_with_each_calls_texts_does(tmp_path):
    # `lake.calls` carries a prompt's text on the first call that sent it only; a frame
    # with the texts on every row (as callers may build one) must give each call the same version
    from nightshift.prompts import lake
    from nightshift.prompts.versions import assign

    write(tmp_path, _world([1.0, 0.0] * 4) + _world([0.0, 1.0, None], agent="other", prompt="Be brief.", start=20)
          + _world([1.0] * 3, tools=[{"type": "function", "function": {"name": "lookup"}}], start=40))
    lean = lake.calls(str(tmp_path))
    assert lean["system"].is_not_null().sum() < lean.height  # the texts are not on every row
    full = lake._scan(str(tmp_path), "transitions", None).with_columns(lake.agent_expr()).select(
        "transition_id", "trajectory_id", "trace_id", "span_id", "step", "agent", lake.system_expr(), "tools",
        pl.lit(True).alias("content"), "model", "reward", "start_time", "prompt_seen").collect()
    got = {mode: assign(rows)[0].select("transition_id", "version").sort("transition_id")
           for mode, rows in (("lean", lean), ("full", full))}
    assert got["lean"].equals(got["full"]) and got["lean"]["version"].n_unique() == 3


def test_the_build_names_each_calls_prompt_as_a_router_hashes_the_request(tmp_path):
    """Transitions version 4: each row's `system_id` is what `nightshift route` computes
    from the request on the wire, and `tools_id` its canonical tools' id."""
    from nightshift.schemas.prompt_identity import system_id, tools_id

    case = "pydantic_ai/builtin/three_agents"
    data = _built(case, tmp_path)
    wire = json.loads((FIXTURES / case / "stub_calls.json").read_text())
    rows = pl.read_parquet(f"{data}/transitions", hive_partitioning=True)
    assert rows["system_id"].null_count() == 0 and rows["tools_id"].null_count() == 0
    assert set(rows["system_id"]) == {system_id(leading_system(c["request"]["messages"])) for c in wire}
    assert set(rows["tools_id"]) == {tools_id(canonical_tools(c["request"].get("tools"))) for c in wire}


def test_a_lake_with_the_prompt_ids_lists_as_one_without_them_and_reads_no_message(tmp_path, monkeypatch):
    """Partitions older than version 4 (no ids) list as before; a lake the build wrote
    with ids lists the same without hashing a message: the ids of the rows (a
    content-missing call's null) come from the columns, and only the first call of each
    prompt is read for its text."""
    from nightshift.prompts import lake
    from nightshift.schemas import prompt_ids

    rows = (_world([1.0, 0.0] * 4) + _world([0.0, 1.0, None], agent="other", prompt="Be brief.", start=20)
            + _world([1.0] * 3, tools=[{"type": "function", "function": {"name": "lookup"}}], start=40))
    rows[3]["flags"] = ["content_missing"]
    write(tmp_path / "old", rows)
    frame = pl.from_dicts(rows, schema=pl.from_arrow(transitions.SCHEMA.empty_table()).schema)
    ids = prompt_ids.ids(frame, prompt_ids.system_texts(), pl.col("tools"),
                         ~pl.col("flags").list.contains("content_missing"))
    for r, (s, t) in zip(rows, ids.iter_rows()):
        r["system_id"], r["tools_id"] = s, t
    assert rows[3]["system_id"] is None and rows[0]["system_id"] is not None
    write(tmp_path / "new", rows)
    old = by_agent(str(tmp_path / "old"), names=False)
    hashed = []
    real = prompt_ids.ids
    monkeypatch.setattr(prompt_ids, "ids", lambda *a: hashed.append(1) or real(*a))
    new = by_agent(str(tmp_path / "new"), names=False)
    assert hashed == []
    assert lines(new) == lines(old) and len([v for a in new for v in a.versions]) == 3
    by_agent(str(tmp_path / "old"), names=False)
    assert hashed  # (the spy sees the old lake's hashing)


def test_cli_lists_versions_as_json_and_says_what_is_missing(tmp_path, capsys):
    write(tmp_path, _world([1.0, 0.0, 1.0]))
    assert main(["prompts", "--data", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (agent,) = doc["agents"]
    assert agent["agent"] == "solver" and agent["versions"][0]["calls"] == 3
    assert agent["versions"][0]["slots"] == ["date"] and agent["candidates"] == []
    assert main(["prompts", "--data", str(tmp_path), "--agent", "nobody"]) == 1
    assert "no agent named 'nobody' (agents: 'solver')" in capsys.readouterr().err
    assert main(["prompts", "--data", str(tmp_path / "empty")]) == 1
    assert "no transitions under" in capsys.readouterr().err
