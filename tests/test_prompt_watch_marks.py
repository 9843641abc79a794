"""The prompt watch counts the route's marked calls as the candidate's arm even when
the mark is not the candidate's version_id: the route names what the model saw by the
candidate's text with the REQUEST's tools, and the lake knows an agent whose spans
record no tool definitions (openai-v2, the agent world's agent) without them. Found by
benchmarks/learning.py's apo arm: every canary read "too_few: 0 and N" and could only
expire."""

from __future__ import annotations

import datetime as dt

import polars as pl

from nightshift.judge.prompt_watch import arms
from nightshift.schemas.prompt_identity import system_id, version_id

PROMPT = "You answer questions. Use one tool, then reply: The answer is X."
CANDIDATE = PROMPT + "\nEarlier conversations went wrong with: a tool error. Make sure this does not happen."
T0 = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.timezone.utc)


def _rows(n: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`n` trajectories after the trial's start, every other one rewritten and marked
    with the id the route computes from the request's tools (which the spans lack)."""
    mark = version_id([CANDIDATE], [{"type": "function", "function": {"name": "lookup"}}])
    rows, outcomes = [], []
    for i in range(n):
        rows.append({"transition_id": f"t{i}", "trajectory_id": f"j{i}", "trace_id": f"j{i}", "span_id": f"s{i}",
                     "step": 0, "agent": "solver", "system": [PROMPT], "tools": None, "content": True,
                     "model": "world-policy", "reward": None, "start_time": T0 + dt.timedelta(minutes=1 + i),
                     "prompt_seen": None if i % 2 else mark})
        outcomes.append({"trajectory_id": f"j{i}", "reward": float(i % 2 == 0)})
    return pl.DataFrame(rows), pl.DataFrame(outcomes)


def test_marked_calls_are_the_candidates_arm_whatever_tools_the_lake_recorded():
    rows, outcomes = _rows(20)
    trial = {"match": system_id([PROMPT]), "version_id": version_id([CANDIDATE], []),  # as the proposer named it
             "parent_version_id": version_id([PROMPT], []), "time": T0.isoformat()}
    baseline, candidate = arms(rows, outcomes, trial)
    assert (len(baseline), len(candidate)) == (10, 10)  # before the fix: (10, 0), the canary could never be judged
    assert sum(candidate) == 10 and sum(baseline) == 0


def test_marks_from_before_the_trial_are_not_its_arm():
    rows, outcomes = _rows(20)
    trial = {"match": system_id([PROMPT]), "version_id": "0" * 12, "parent_version_id": version_id([PROMPT], []),
             "time": (T0 + dt.timedelta(minutes=11)).isoformat()}  # an earlier trial marked the first ten
    baseline, candidate = arms(rows, outcomes, trial)
    assert len(candidate) == 5 and len(baseline) == 5
