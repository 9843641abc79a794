"""The gate's ranking pairs calls in one state only, and a tool error splits a state:
a call after a tool error and a call after a success with the same turns were
paired, so sft's anchor (which keeps the after-error calls where they were, on
purpose) read as ranking rewarded actions worse (0.79 against 1.0 without it, on
the agent world's logs). Rows are the transform's; no model is loaded."""

from __future__ import annotations

from types import SimpleNamespace

from nightshift.judge.gate import ranking_pairs, state_key

from transitions_data import CALC_TOOL, msg, row

ASK = [msg("system", "Use one tool, then reply."), msg("user", "What is 4 - 2?")]


def episode(name: str, result: str, answer: str, reward: float, errored: bool) -> list[SimpleNamespace]:
    """A calculator call, then the answer after its result (the call flagged when its tool errored)."""
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "calculator", "arguments": "{}"}]}
    first = row(ASK, call, reward, trajectory=name, step=0, num_steps=2)
    first["flags"] = ["tool_error"] if errored else []
    second = row(ASK + [msg("assistant", None, [{"id": "c1", "name": "calculator", "arguments": {}}]),
                        msg("tool", result, tool_call_id="c1")], answer, reward, trajectory=name, step=1, num_steps=2)
    return [SimpleNamespace(row=first), SimpleNamespace(row=second)]


def test_calls_after_a_tool_error_are_not_paired_with_calls_after_a_success():
    held = (episode("ok", "2", "The answer is two.", 1.0, False)
            + episode("erred", "error: bad expression", "I could not compute it.", 0.0, True)
            + episode("wrong", "2", "The answer is three.", 0.0, False))
    pairs = ranking_pairs(held, max_pairs=100, fallback=CALC_TOOL)
    named = {(held[a].row["trajectory_id"], held[b].row["trajectory_id"], held[a].row["step"]) for a, b in pairs}
    # first calls: one state (nothing has errored yet); answers: only the two after a success
    assert named == {("ok", "erred", 0), ("ok", "wrong", 0), ("ok", "wrong", 1)}
    assert state_key(held[3].row, True) != state_key(held[5].row, False)
