"""Traces whose calls need each other's history are built in one bucket, and a
history is carried within a day only (`transform.chains`).

A client of a stateful API (OpenAI's Responses API with `previous_response_id`,
Gemini's interactions) records each call with only its new items and the response it
continues; a conversation sent as deltas (`gen_ai.input.messages_delta`) records only
the messages appended since its previous call. Each user turn is a trace of its own
here, as in most agents, and the build reads its window in buckets of traces: these
tests build the same lake in one bucket, in buckets cut by the split, and in buckets
streamed from the files, and compare. The spans are made from the conventions'
descriptions (as in test_transform_genai_moving.py), not recorded: no instrumentation
on the package index emits the delta form yet."""

from __future__ import annotations

import json

import fsspec
import polars as pl
import pytest

from nightshift.transform import build as B
from nightshift.transform import chains
from nightshift.transform.config import TransformConfig
from traces import T0, Trace, genai_call, write_spans

S = 10**9
#: T0 is 08:26:40 UTC: seconds to the next midnight
TO_MIDNIGHT = 24 * 3600 - (8 * 3600 + 26 * 60 + 40)


def _turn(seed: str, at: float, attrs: dict, reward: float = 1.0) -> Trace:
    t = Trace(seed)
    root = t.span("invoke_agent helper", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"},
                  start=at, end=at + 5)
    t.span("chat m1", attrs, parent=root, start=at + 1, end=at + 2)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "r", "agentlightning.reward.0.value": reward},
           parent=root, start=at + 3, end=at + 3.5)
    return t


def _user(text: str) -> list[dict]:
    return [{"role": "user", "parts": [{"type": "text", "content": text}]}]


def _answer(text: str) -> list[dict]:
    return [{"role": "assistant", "parts": [{"type": "text", "content": text}]}]


def continued(c: int, at: float, turns: int = 3, first_continues: str | None = None) -> list[Trace]:
    """Conversation `c` through a stateful API: a trace per turn, each call sending its
    user turn alone and naming the response before it."""
    out = []
    for k in range(turns):
        a = genai_call(f"c{c} turn {k}", f"c{c} answer {k}")
        a["gen_ai.input.messages"] = json.dumps(_user(f"c{c} turn {k}"))
        a["gen_ai.response.id"] = f"resp-c{c}-{k}"
        previous = f"resp-c{c}-{k - 1}" if k else first_continues
        if previous:
            a["gen_ai.request.previous_response.id"] = previous
        out.append(_turn(f"cont-{c}-{k}", at + 60 * k, a))
    return out


def deltas(c: int, at: float, turns: int = 3, opens_with_answer: bool = False) -> list[Trace]:
    """Conversation `d{c}` sent as deltas: a trace per turn, each call sending the
    answer before it and its user turn."""
    out = []
    for k in range(turns):
        a = genai_call(f"d{c} turn {k}", f"d{c} answer {k}")
        before = _answer(f"d{c} answer {k - 1}") if k else (_answer("said before") if opens_with_answer else [])
        a["gen_ai.input.messages_delta"] = json.dumps(before + _user(f"d{c} turn {k}"))
        del a["gen_ai.input.messages"]
        a["gen_ai.conversation.id"] = f"d{c}"
        out.append(_turn(f"delta-{c}-{k}", at + 60 * k, a))
    return out


def lake(data, n: int = 12) -> None:
    """`n` conversations of each kind among `4 n` plain runs, their turns minutes apart
    and written in separate batches, as a collector files traces that end apart."""
    plain = [_turn(f"plain-{i}", 10 * i, genai_call(f"task {i}", f"done {i}"), reward=float(i % 2)) for i in range(4 * n)]
    convs = [t for c in range(n) for t in continued(c, 7 * c) + deltas(c, 7 * c + 3)]
    for k in range(3):  # turn k of every conversation, then a share of the plain runs
        write_spans(str(data), [t for t in convs if t.seed.endswith(f"-{k}")] + plain[k::3], batch=f"b{k}")


def rows(data) -> pl.DataFrame:
    return pl.read_parquet(f"{data}/transitions", hive_partitioning=True).sort("transition_id").select(
        "transition_id", "input_messages", "flags", "advantage")


def flags(df: pl.DataFrame) -> dict[str, int]:
    out: dict[str, int] = {}
    for fs in df["flags"].to_list():
        for f in fs:
            out[f] = out.get(f, 0) + 1
    return out


def cfg(data, **kw) -> TransformConfig:
    c = TransformConfig(data=str(data), settle=0)
    for k, v in kw.items():
        setattr(c, k, v)
    return c


def test_calls_continuing_other_traces_build_the_same_in_any_number_of_buckets(tmp_path):
    one = tmp_path / "one"
    lake(one)
    assert B.build(cfg(one)).buckets == 1
    want = rows(one)
    f = flags(want)
    # turns 2 and 3 of each conversation, their histories back; none left incomplete
    assert f.get("history_from_previous_response") == 24 and f.get("history_from_delta") == 36
    assert "history_incomplete" not in f
    for name, kw in [("split", {}), ("stream", {"memory_budget": 60_000})]:
        data = tmp_path / name
        lake(data)
        c = cfg(data, **kw)
        if name == "split":
            c.build.buckets = 5
        s = B.build(c)
        assert s.buckets > 2, name
        assert s.grouped == [72, 24]  # 12 conversations of each kind, 3 traces each
        assert "traces bucketed with the traces they continue or share a trajectory with: 72 in 24 group(s)" in s.lines()
        got = rows(data)
        assert got.equals(want), name


def test_without_the_groups_a_bucketed_build_loses_the_histories(tmp_path, monkeypatch):
    """What the groups are for: the same lake in five buckets, each trace by its own hash."""
    monkeypatch.setattr(chains, "together", lambda fs, sources, how="trace": {})
    lake(tmp_path)
    c = cfg(tmp_path)
    c.build.buckets = 5
    B.build(c)
    assert flags(rows(tmp_path)).get("history_incomplete", 0) > 10


def _sources(data) -> list[B._Source]:
    return [B._Source(p, "") for p in sorted(str(x) for x in (data / "spans").rglob("*.parquet"))]


def test_the_groups_are_the_traces_that_continue_each_others_calls(tmp_path, monkeypatch):
    write_spans(str(tmp_path), continued(1, 0) + deltas(2, 10) + deltas(3, 20, turns=1)
                + [_turn("plain", 30, genai_call("q", "a"))])
    fs = fsspec.filesystem("file")
    got = chains.together(fs, _sources(tmp_path))
    cont = sorted(Trace(f"cont-1-{k}").hex for k in range(3))
    delta = sorted(Trace(f"delta-2-{k}").hex for k in range(3))
    # each trace to its group's first (the first itself needs no entry); a one-trace conversation: none
    assert got == {**{t: cont[0] for t in cont[1:]}, **{t: delta[0] for t in delta[1:]}}
    # a trace read only for some of its date's traces keeps to them
    src = _sources(tmp_path)
    src[0].only = pl.Series([cont[0], cont[1]])
    assert chains.together(fs, src) == {cont[1]: cont[0]}


def test_a_lake_where_no_call_continues_another_reads_no_attribute(tmp_path, monkeypatch):
    write_spans(str(tmp_path), [_turn(f"p{i}", i, genai_call("q", "a")) for i in range(5)] + deltas(1, 10, turns=1))
    read = []
    monkeypatch.setattr(chains, "_continued", lambda *a: read.append(a))
    assert chains.together(fsspec.filesystem("file"), _sources(tmp_path)) == {}
    assert read == []


@pytest.mark.parametrize("kind", ["continued", "deltas"])
def test_a_history_is_not_carried_across_midnight(tmp_path, kind):
    """The second turn starts the next day: an incremental build redoes days, so a full
    one carries no history between them either, and the turn is flagged incomplete."""
    make = continued if kind == "continued" else deltas
    write_spans(str(tmp_path), make(1, TO_MIDNIGHT - 90, turns=3))  # turns at 23:58:30, 23:59:30, 00:00:30
    B.build(cfg(tmp_path))
    df = pl.read_parquet(f"{tmp_path}/transitions", hive_partitioning=True).sort("start_time")
    assert [str(d) for d in df["date"].to_list()] == ["2025-11-22", "2025-11-22", "2025-11-23"]
    got = [sorted(f) for f in df["flags"].to_list()]
    whole = "history_from_previous_response" if kind == "continued" else "history_from_delta"
    assert got[1] == [whole] and got[2] == ["history_incomplete"]
    assert got[0] == ([] if kind == "continued" else ["history_from_delta"])


def test_a_delta_that_opens_with_an_answer_made_elsewhere_is_incomplete(tmp_path):
    """A conversation's first call in the lake whose delta opens with the model's answer
    is not the conversation's first: it and the calls built on it are not passed off as
    whole (the trainer leaves them out)."""
    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.select import select

    write_spans(str(tmp_path), deltas(1, 0, turns=2, opens_with_answer=True) + deltas(2, 10, turns=2))
    B.build(cfg(tmp_path))
    df = pl.read_parquet(f"{tmp_path}/transitions", hive_partitioning=True)
    by = {r["trace_id"]: sorted(r["flags"]) for r in df.select("trace_id", "flags").iter_rows(named=True)}
    assert [by[Trace(f"delta-1-{k}").hex] for k in range(2)] == [["history_incomplete"]] * 2
    assert [by[Trace(f"delta-2-{k}").hex] for k in range(2)] == [["history_from_delta"]] * 2
    kept = {r["transition_id"] for r in select(TrainConfig(data=str(tmp_path))).rows}
    assert kept == set(df.filter(pl.col("trace_id").is_in([Trace(f"delta-2-{k}").hex for k in range(2)]))["transition_id"])


# --- trajectories of several traces: a conversation's, linked ones' ---------------------------------------


def conversations(data, n: int = 8) -> None:
    """`n` conversations of three traces each, named by each way a span names its
    conversation (on the call or on the root), among plain runs, written turn by turn."""
    ways = [("gen_ai.conversation.id", lambda c: f"conv-{c}"), ("session.id", lambda c: f"sess-{c}"),
            ("traceloop.association.properties.session_id", lambda c: f"tl-{c}"), ("session.id", lambda c: 9000 + c)]
    plain = [_turn(f"solo-{i}", 10 * i, genai_call(f"task {i}", f"done {i}"), reward=float(i % 2)) for i in range(3 * n)]
    turns: list[list[Trace]] = [[], [], []]
    for c in range(n):
        key, value = ways[c % len(ways)]
        for k in range(3):
            t = _turn(f"conv-{c}-{k}", 7 * c + 60 * k, genai_call(f"c{c} turn {k}", f"c{c} answer {k}"),
                      reward=float((c + k) % 2))
            t.spans[0 if k % 2 else 1].attrs[key] = value(c)  # the root for some turns, the call for others
            turns[k].append(t)
    for k in range(3):
        write_spans(str(data), turns[k] + plain[k::3], batch=f"b{k}")


def test_conversation_trajectories_build_the_same_in_buckets_as_in_one(tmp_path):
    """`trajectory: conversation` read the whole window in one bucket (memory without a
    bound); its traces are now bucketed by conversation, whichever key names it."""
    one = tmp_path / "one"
    conversations(one)
    assert B.build(cfg(one, trajectory="conversation")).buckets == 1
    want = pl.read_parquet(f"{one}/transitions", hive_partitioning=True).sort("transition_id")
    assert want.filter(pl.col("trace_id").is_in([Trace(f"conv-{c}-0").hex for c in range(8)]))["num_steps"].unique().to_list() == [3]
    for name, kw in [("split", {}), ("stream", {"memory_budget": 40_000})]:
        data = tmp_path / name
        conversations(data)
        c = cfg(data, trajectory="conversation", **kw)
        if name == "split":
            c.build.buckets = 5
        assert B.build(c).buckets > 2, name
        got = pl.read_parquet(f"{data}/transitions", hive_partitioning=True).sort("transition_id")
        assert got.drop("date").equals(want.drop("date")), name


def test_without_the_groups_a_conversation_is_cut_by_the_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(chains, "together", lambda fs, sources, how="trace": {})
    conversations(tmp_path)
    c = cfg(tmp_path, trajectory="conversation")
    c.build.buckets = 5
    B.build(c)
    got = pl.read_parquet(f"{tmp_path}/transitions", hive_partitioning=True)
    convs = got.filter(pl.col("trace_id").is_in([Trace(f"conv-{c}-{k}").hex for c in range(8) for k in range(3)]))
    assert convs["num_steps"].min() < 3  # (a conversation's id is its own either way: its steps are not)


def test_linked_traces_of_a_recorded_autogen_run_are_one_trajectory_in_any_bucket_count(tmp_path):
    """AutoGen starts a trace per message delivered, linked to the span that sent it
    (tests/test_framework_recordings.py): in five buckets, still one trajectory."""
    import shutil
    from pathlib import Path

    src = Path(__file__).parent / "fixtures" / "frameworks" / "autogen" / "genai_openai" / "roundrobin"
    rows = {}
    for n in (0, 5):
        data = tmp_path / f"b{n}"
        shutil.copytree(src / "spans", data / "spans")
        c = cfg(data, trajectory="linked")
        c.build.buckets = n
        assert B.build(c).buckets == max(n, 1)
        rows[n] = pl.read_parquet(f"{data}/transitions", hive_partitioning=True).sort("transition_id")
    assert rows[5]["trajectory_id"].n_unique() == 1 and rows[5].height == 4
    assert rows[5].drop("date").equals(rows[0].drop("date"))
