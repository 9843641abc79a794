"""The build's rows made as frames (`transform/columnar.py`) equal those of the Python
path (`build._trajectory_rows`), bit for bit, on the cases credit and selection
branch on: every strategy, gamma 0 and 1, negative, zero and missing rewards, a
default reward, one-call trajectories, agent selection, orphans, clock skew, the
route's prompt mark, weighting, tool errors (penalized or not) and a history
rebuilt. The Python path is forced with a reward function
that returns nothing (a trajectory with one goes through Python, and it adds no
reward), and each build is checked to have taken the path it should."""

from __future__ import annotations

import os
import re

import polars as pl
import pytest

from nightshift.transform import build as B
from nightshift.transform import columnar
from test_transform_build import episode, run
from traces import Trace, genai_call, write_spans


def nothing(trajectory) -> None:
    """A reward function that finds no reward: the trajectory goes through Python unchanged."""
    return None


def _traces() -> list[Trace]:
    out = [episode("pos", 1.5, user="same", calls=3), episode("neg", -0.7, user="same", calls=4, agent="critic"),
           episode("zero", 0.0, user="other", calls=2), episode("one", 0.3, user="solo", calls=1),
           episode("none", None, user="other", calls=2)]
    t = Trace("orphan-skew-mark")  # a root that never ended, a call ending before it starts, a marked answer
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=None)
    t.span("chat m1", genai_call("q", "a", model="m1+p:0123456789ab"), parent=root, start=1, end=2)
    t.span("chat m1", genai_call("q2", "b"), parent=root, start=3, end=2.5)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                         "agentlightning.reward.0.value": 0.9}, parent=root, start=4, end=4.5)
    return out + [t, _tool("tool", "error: not found", True), _tool("ok-tool", "42", True),
                  _tool("rebuilt", "error: not found", False)]


def _tool(seed: str, result: str, issued: bool) -> Trace:
    """A call asking for a tool, then one whose history holds the result (and, if
    `issued`, the turn that asked: else `rebuild_history` puts it back, in Python)."""
    t = Trace(seed)
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=20)
    t.span("chat m1", genai_call("look it up", tool_call=("c1", "lookup", "{\"q\": \"x\"}")), parent=root, start=1, end=2)
    asked = [{"role": "user", "parts": [{"type": "text", "content": "look it up"}]},
             {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "lookup", "arguments": "{\"q\": \"x\"}"}]},
             {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": result}]}]
    t.span("chat m1", genai_call("and now?", "done", history=asked if issued else [asked[0], asked[2]]), parent=root,
           start=3, end=4)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                         "agentlightning.reward.0.value": 0.4}, parent=root, start=5, end=5.5)
    return t


def _both(tmp_path, monkeypatch, **kw):
    """The same spans built as frames and through Python: (frames' rows, summary), (Python's)."""
    a, b = tmp_path / "frames", tmp_path / "python"
    for d in (a, b):
        write_spans(str(d), _traces())

    def refuse(*args, **kwargs):
        raise AssertionError("this build should not have taken this path")

    python, rows_of = [], B._trajectory_rows

    def counted(key, calls, *args):
        python.append(key)
        return rows_of(key, calls, *args)

    with monkeypatch.context() as m:
        m.setattr(B, "_trajectory_rows", counted)
        got = run(a, **kw)
    assert python == [Trace("rebuilt").hex]  # only the history to rebuild went through Python
    with monkeypatch.context() as m:
        m.setattr(columnar, "rows", refuse)
        want = run(b, **kw, reward__functions=[f"{__name__}:nothing"])
    return got, want


def _same(got, want) -> None:
    (df, s1), (ref, s2) = got, want
    assert df.height == ref.height > 0
    assert df.schema == ref.schema
    for c in df.columns:  # repr: the same float bits (-0.0 too), the same nulls
        assert [repr(x) for x in df[c].to_list()] == [repr(x) for x in ref[c].to_list()], c
    timeless = [re.sub(r"[0-9.]+ s\b", "", x) for x in s1.lines()], [re.sub(r"[0-9.]+ s\b", "", x) for x in s2.lines()]
    assert timeless[0] == timeless[1]


@pytest.mark.parametrize("kw", [
    {"credit__strategy": "identical"},
    {"credit__strategy": "identical", "credit__tool_error_penalty": 0.0},
    {"credit__strategy": "discounted", "credit__gamma": 0.9},
    {"credit__strategy": "discounted", "credit__gamma": 0.0},
    {"credit__strategy": "discounted", "credit__gamma": 1.0},
    {"credit__strategy": "last", "advantage__weighting": "step", "agents_exclude": "critic"},
    {"credit__strategy": "discounted", "credit__gamma": 0.37, "reward__default": "0.25", "group_by": "none"},
])
def test_frames_equal_the_python_rows(tmp_path, monkeypatch, kw):
    got, want = _both(tmp_path, monkeypatch, **kw)
    _same(got, want)
    df = got[0]
    flags = {t: df.filter((pl.col("trajectory_id") == Trace(t).hex) & (pl.col("step") == 0))["flags"][0].to_list()
             for t in ("tool", "ok-tool", "rebuilt")}
    errors = kw.get("credit__tool_error_penalty", 0.5) != 0
    assert ("tool_error" in flags["tool"]) == errors and ("tool_error" in flags["rebuilt"]) == errors
    assert "tool_error" not in flags["ok-tool"]


def test_a_local_build_removes_each_buckets_split_pieces_once_read(tmp_path, monkeypatch):
    """The split's scratch shrinks as the buckets' rows grow: the disk a build needs
    peaks at about one copy of the window, not two (10M spans: ~15 GB, not ~30)."""
    write_spans(str(tmp_path), _traces())
    seen, run_bucket = [], B.run_bucket

    def watched(job, shared):
        waiting = [p for p in job.split if os.path.exists(p)]
        done = run_bucket(job, shared)
        seen.append((len(waiting), [p for p in job.split if os.path.exists(p)]))
        return done

    monkeypatch.setattr(B, "run_bucket", watched)
    df, s = run(tmp_path, build__buckets=3)
    assert s.buckets == 3 and len(seen) >= 2 and df.height > 0  # (a bucket no trace hashed to has no job)
    assert all(n > 0 and left == [] for n, left in seen)  # each bucket's pieces were there, and then gone
