"""Issue 27's bad input, a proposer that proposes an empty or enormous prompt, at
the one check every candidate passes before it is stored (prompts/validate.py):
the end-to-end cases (an empty answer, an enormous block, a time-out, garbage)
run against the stand-in proposer in test_prompts_propose.py; these are the
proposals a stand-in answer does not produce, an empty or blank `<prompt>` block
among them, refused by name and never stored."""

from __future__ import annotations

import pytest

from nightshift.prompts.validate import Limits, extract, problem

PARENT = "You are the support agent of Acme. Answer in one sentence."


@pytest.mark.parametrize("answer,says", [
    ("Here it is: <prompt></prompt>", "the proposed prompt is empty"),
    ("<prompt>\n   \n\t</prompt>", "the proposed prompt is empty"),
    ("no block at all", "holds no <prompt>...</prompt> block"),
    ("<prompt>" + "Be careful. " * 1500 + "</prompt>", "more than apo.max_prompt_chars=16,000"),
    ("<prompt>" + PARENT + " Check the order." * 200 + "</prompt>", "more than apo.max_growth=2 times its parent"),
    ('<prompt>{"role": "system"}</prompt>', "a JSON document, not instructions"),
    ("<prompt>12345 67890 %%% ###</prompt>", "mostly not words"),
    ("<prompt>You are\x00 the agent.</prompt>", "control characters"),
])
def test_an_empty_blank_or_enormous_proposal_is_refused_by_name(answer, says):
    assert says in problem(extract(answer), PARENT, [], [], Limits())


def test_a_sound_proposal_passes():
    assert problem(extract(f"<prompt>{PARENT} Look the order up first.</prompt>"), PARENT, [], [], Limits()) == ""
