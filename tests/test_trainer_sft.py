"""sft's anchor: rows below the threshold in states no kept row covers (after a tool
error, in the agent world) train at `sft.anchor_weight`, and that weight reaches the
loss. Without it the adapter drifted there and broke the output format (the gate held
sft-s2 v0001 back: 10 of 12 broken samples came after a tool error). Rendered tokens
are stand-ins: the builders only compare them; the loss test runs collate and the
objective on made-up log-probs."""

from __future__ import annotations

import torch

from nightshift.trainer.algorithms.sft import examples, nll
from nightshift.trainer.config import TrainConfig
from nightshift.trainer.examples import Example
from nightshift.trainer.loop import collate
from nightshift.trainer.render import Rendered
from nightshift.trainer.select import select

from transitions_data import msg, row, write

def ask(question: str = "What is 4 - 2?") -> list[dict]:
    return [msg("system", "Use one tool, then reply."), msg("user", question)]


ASK = ask()


def episode(name: str, tool: str, result: str, answer: str, reward: float, errored: bool,
            question: str = "What is 4 - 2?", n: int = 0) -> list[Example]:
    """A two-call episode of the agent world: a tool call, then the answer after its result
    (stand-in token ids marked by `n`, else the name's length)."""
    ASK = ask(question)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": tool, "arguments": "{}"}]}
    first = row(ASK, call, reward, trajectory=name, step=0, num_steps=2)
    first["flags"] = ["tool_error"] if errored else []
    second = row(ASK + [msg("assistant", None, [{"id": "c1", "name": tool, "arguments": {}}]),
                        msg("tool", result, tool_call_id="c1")], answer, reward, trajectory=name, step=1, num_steps=2)
    n = n or len(name)
    return [Example(first, Rendered(prompt_ids=[1, n], completion_ids=[10 + n])),
            Example(second, Rendered(prompt_ids=[2, n, 3], completion_ids=[20 + n, 21]))]


def world() -> list[Example]:
    return (episode("ok", "calculator", "result: two", "The answer is two.", 1.0, False)
            + episode("erred", "lookup", "error: cannot look up arithmetic", "The answer is unknown.", 0.0, True)
            + episode("wrong", "calculator", "result: two", "The answer is three.", 0.0, False))


def cfg(**sft) -> TrainConfig:
    c = TrainConfig()
    for k, v in sft.items():
        setattr(c.sft, k, v)
    return c


def test_rows_after_a_tool_error_anchor_at_the_anchor_weight():
    rows, left = examples(cfg(threshold=0.5, anchor_weight=0.1), world())
    full = [r for r in rows if r.get("weight", 1.0) == 1.0]
    anchored = [r for r in rows if r.get("anchor")]
    assert len(full) == 2  # the rewarded episode's two calls
    # only the answer after the error: every other failed call is in a state a rewarded call covers
    assert [r["input_ids"] for r in anchored] == [[2, 5, 3, 25, 21]]
    assert anchored[0]["weight"] == 0.1 and anchored[0]["completion_start"] == 3
    assert left == {"reward below sft.threshold (0.5)": 3}


def test_all_anchors_every_left_out_row_and_zero_turns_the_anchor_off():
    rows, left = examples(cfg(threshold=0.5, anchor_weight=0.2, anchor_rows="all"), world())
    assert sum(1 for r in rows if r.get("anchor") and r["weight"] == 0.2) == 4 and not left
    rows, left = examples(cfg(threshold=0.5, anchor_weight=0.0), world())
    assert len(rows) == 2 and not any("weight" in r for r in rows)
    assert left == {"reward below sft.threshold (0.5)": 4}


def letters_world() -> list[Example]:
    """The letters variant's night 1 in small: arithmetic answered (one question rewarded,
    another of its kind failed), and a kind of request no episode ever solved, whose
    first call has the same turn shape as the rewarded first call."""
    return (episode("ok", "calculator", "result: two", "The answer is two.", 1.0, False, "What is 4 - 2?")
            + episode("wrong", "lookup", "error: no such thing", "Seven.", 0.0, True, "What is 9 - 3?")
            + [e for k, w in enumerate(("apple", "shirt", "orange"))
               for e in episode(f"letters-{w}", "lookup", "error: use counter", "Five.", 0.0, True,
                                f"How many letters are in the word {w}?", n=40 + k)])


def test_a_kind_of_request_no_rewarded_row_answered_anchors_by_default():
    """The finding (anchor7): the content-blind state covered the letters questions' first
    calls by the rewarded arithmetic first call, so they never anchored and the adapter
    broke its format there (85.1 % valid vs 100 %). With the request's template in the
    state (the default) they anchor; the failed arithmetic first call stays covered (its
    request is of the rewarded kind: digits are data)."""
    data = letters_world()

    def anchored(rows_setting: str | None) -> set[str]:
        c = cfg(threshold=0.5, anchor_weight=0.1, **({"anchor_rows": rows_setting} if rows_setting else {}))
        rows, _ = examples(c, data)
        ids = {tuple(r["input_ids"]) for r in rows if r.get("anchor")}
        return {e.row["trajectory_id"] for e in data if e.row["step"] == 0
                and tuple(e.r.prompt_ids + e.r.completion_ids) in ids}

    assert anchored(None) == {"letters-apple", "letters-shirt", "letters-orange"}
    assert anchored("request") == anchored(None)
    assert anchored("uncovered") == set()  # the old state: every first call covered by the rewarded one


def test_a_rewarded_request_covers_the_others_of_its_template():
    """Requests fold to a template across the agent's rows (`schemas.prompt_template`):
    one rewarded letters question covers its kind's other first calls."""
    data = letters_world() + episode("letters-ok", "counter", "result: five", "Five.", 1.0, False,
                                     "How many letters are in the word apple?", n=50)
    rows, _ = examples(cfg(threshold=0.5, anchor_weight=0.1), data)
    firsts = {tuple(e.r.prompt_ids + e.r.completion_ids) for e in data if e.row["step"] == 0}
    assert not [r for r in rows if r.get("anchor") and tuple(r["input_ids"]) in firsts]


def test_the_anchor_weight_reaches_the_loss():
    rows = [{"input_ids": [1, 2, 3], "completion_start": 1},
            {"input_ids": [4, 5, 6, 7], "completion_start": 2, "weight": 0.1, "anchor": True}]
    batch = collate(rows, pad_id=0)
    logp = -torch.arange(1, batch["targets"].numel() + 1, dtype=torch.float32) / 10
    loss, _ = nll(logp, batch)
    expected = -(logp[:2].sum() + 0.1 * logp[2:].sum())  # two tokens at 1, the anchor's two at 0.1
    assert torch.isclose(loss, expected), (loss, expected)


def test_the_trainer_reads_the_tool_error_flag(tmp_path):
    """`select` hands the transform's flags to the algorithms: without them no call
    reads as after a tool error and the anchor covers nothing."""
    data = [e.row for e in world()]
    write(tmp_path, data)
    c = cfg()
    c.data = str(tmp_path)
    rows = select(c).rows
    assert sorted(tuple(r["flags"] or ()) for r in rows) == [()] * 5 + [("tool_error",)]
