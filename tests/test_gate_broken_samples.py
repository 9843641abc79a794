"""The generation check on what a real candidate emitted: sft-s2 v0001 of the
learning benchmark (issue 27 item 9), blocked as "breaks the output format"
though the world measured it 95 % against the base's 45 %. Re-run, 10 of its 12
broken samples came after a tool error (a state none of the rows sft kept holds:
it trains on rewarded rows, and in the world a tool error always fails the
episode) and 2 called tools that do not exist. They are broken output, so the
check is right; the world does not see it because a reply after a tool error
fails there whatever it says. The gate log now shows where a candidate broke,
which took a re-run of the check to find out."""

from __future__ import annotations

import pytest

from nightshift.judge.gate import GateDecision, GateSettings, _judge, asked, valid_output

#: The world's tools as the run offered them (agent-tools.json: no required arguments).
TOOLS = [{"type": "function", "function": {"name": n, "description": "", "parameters": {"type": "object",
                                                                                          "properties": {}}}}
         for n in ("calculator", "lookup")]

#: Samples of v0001 (temperature 1, ended by themselves) the check counted invalid.
BROKEN = [
    # after "error: cannot calculate a colour": markup fragments in a text reply
    'The answer is "arguments": """: "arguments": {}}</tool_call>',
    'The answer is "arguments": ""calculator "arguments": {}}</tool_call>',
    # a question's first turn: tools nobody offered (the world answers "error: no such tool")
    '<tool_call>{"name": " colour", "arguments": {}}</tool_call>',
    '<tool_call>{"name": " lookup", "arguments": {}}</tool_call>',
]
#: What the base model answered on the same prompts.
FINE = ["The answer is unknown.", '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>']


@pytest.mark.parametrize("text", BROKEN)
def test_what_the_candidate_emitted_is_broken_output(text):
    assert not valid_output(text, TOOLS)


@pytest.mark.parametrize("text", FINE)
def test_what_the_base_emitted_on_the_same_prompts_is_valid(text):
    assert valid_output(text, TOOLS)


def test_the_gate_log_says_where_the_candidate_broke():
    n = 40  # 4 prompts only the candidate broke on; the rest both got right
    cand = [0, 0, 0, 0] + [1] * (n - 4)
    serv = [1] * n
    rows = [{"input_messages": [{"role": "user", "content": "What is 2 + 3?"},
                                {"role": "tool", "content": "error: cannot calculate a colour"}]}] * 3
    rows += [{"input_messages": [{"role": "user", "content": "What colour is the table today?"}]}] * (n - 3)
    c = {"mean_logp": [], "valid": cand, "first_sample": "", "samples": [*BROKEN, *["The answer is two."] * (n - 4)]}
    p = {"mean_logp": [], "valid": serv, "first_sample": "", "samples": ["The answer is unknown."] * n}
    d = GateDecision(passed=False, reason="", candidate="c", published=None)
    _judge(d, [], c, p, GateSettings(), None, [asked(r) for r in rows])
    broke = d.candidate_metrics["broke"]
    assert [b["candidate"] for b in broke] == BROKEN
    assert broke[0]["after"] == "tool: error: cannot calculate a colour"
    assert broke[0]["serving"] == "The answer is unknown."
    detail = d.checks["generation"]["detail"]
    assert "4 where only the candidate's was not (3 after a tool message, 1 after a user message)" in detail
