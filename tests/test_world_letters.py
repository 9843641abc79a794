"""The agent world's "letters" variant (examples/agent_world/world.py, complement.py;
issue 27: APO + sft beats either alone): a part only a prompt can fix (a third
tool the policy almost never calls unless its prompt says when; the other tools'
error on those questions names it) and a part only logged data fixes (results
misread whatever the prompt says; no error says so). Off by default: the demo, the
closed loop and their cached policy see the two-tool world unchanged."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from support import proposer_standin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agent_world"))

import complement  # noqa: E402
import counterfactual  # noqa: E402
import world  # noqa: E402


@pytest.fixture
def letters():
    world.use("letters")
    try:
        yield
    finally:
        world.use("")


def test_the_default_world_has_two_tools_and_is_back_after_the_variant():
    before = world.demonstrations(200, seed=5)
    world.use("letters")
    try:
        assert os.environ[world.VARIANT_ENV] == "letters"  # the agents it starts inherit it
    finally:
        world.use("")
    assert world.VARIANT_ENV not in os.environ
    assert [t["function"]["name"] for t in world.TOOLS] == ["calculator", "lookup"]
    assert world.demonstrations(200, seed=5) == before
    rng = random.Random(1)
    assert {world.make_task(rng).kind for _ in range(400)} == {"arithmetic", "colour"}
    task = world.make_task(random.Random(2))
    assert world.run_tool("counter", task) == "error: no such tool 'counter'"


def test_an_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match="no variant 'letter'"):
        world.use("letter")
    assert world.VARIANT == ""


def test_letters_questions_need_the_counter_and_the_other_tools_say_so(letters):
    assert [t["function"]["name"] for t in world.TOOLS] == ["calculator", "lookup", "counter"]
    rng = random.Random(3)
    tasks = [world.make_task(rng) for _ in range(2000)]
    share = sum(t.kind == "letters" for t in tasks) / len(tasks)
    assert abs(share - world.LETTERS_SHARE) < 0.04, share
    for t in tasks[:300]:
        if t.kind == "letters":
            word = t.question.split()[-1].rstrip("?")
            assert world.run_tool("counter", t) == f"result: {world.NUMBERS[len(word)]}" and t.right_tool == "counter"
            assert world.run_tool("lookup", t) == world.run_tool("calculator", t) == world.LETTER_ERROR
            assert "counter" in world.LETTER_ERROR  # what a reader of the failure learns
        else:
            assert world.run_tool("counter", t) == world.COUNTER_ERROR
            assert world.run_tool(t.right_tool, t).startswith("result: ")
    # the variant's policy misreads a result `p_misread` of the time: the answer is then another value
    rng = random.Random(4)
    chats = [world.demonstration(world.make_task(rng), rng, 1.0, p_misread=0.25) for _ in range(1000)]
    misread = [c for c in chats if c[4]["content"] != f"The answer is {c[3]['content'].removeprefix('result: ')}."]
    assert 0.2 < len(misread) / len(chats) < 0.3
    assert all(not world.check(world.Task(c[1]["content"], "", c[3]["content"].removeprefix("result: ")),
                               c[4]["content"]) for c in misread)


def test_the_standins_words_for_the_letters_failure_are_never_taught():
    """What the stand-in proposer writes from the variant's tool errors is held out of
    the policy's demonstrations: a lift under it is the failures' words generalised,
    not a line the policy learned by heart."""
    said = [proposer_standin._instruction(f"tool error: {tool}: {world.LETTER_ERROR}")
            for tool in ("lookup", "calculator")]
    taught = complement.taught()
    assert not taught & set(said)
    assert not any(c in line for c in complement.LETTERS for line in said)
    # every letters content names letters and no other kind; no distractor names letters
    assert all("letter" in c and "colour" not in c and "arithmetic" not in c for c in complement.LETTERS)
    assert not any("letter" in c or "counter" in c for c in counterfactual.DISTRACTORS)


def test_a_twin_differs_only_where_an_instruction_was(letters):
    rng = random.Random(6)
    kinds = set()
    for _ in range(2000):
        prompt, helps, twin = complement.draw_pair(rng, world.SYSTEM, 0.85)
        lines, other = prompt.splitlines(), twin.splitlines()
        assert len(lines) == len(other) and lines[0] == other[0] == world.SYSTEM
        assert len([i for i, (a, b) in enumerate(zip(lines, other)) if a != b]) == len(helps)
        assert all(line in complement.taught() for line in lines[1:])
        kinds |= helps
    assert kinds == {"colour", "arithmetic", "letters"}


@pytest.fixture(scope="module")
def letters_policy() -> Path:
    """complement.LETTERS_POLICY, what benchmarks/learning.py --world letters serves:
    built on counterfactual.PROMPT_SENSITIVE (test_world_prompts' policy, same cache)
    unless cached; its own stage is about 1,450 steps (200 s on one thread), the
    whole chain from the behaviour policy about 11 minutes (policy.READING_THREADS)."""
    spec = complement.LETTERS_POLICY
    root = Path(os.environ.get("NIGHTSHIFT_WORLD_CACHE") or "~/.cache/nightshift-agent-world").expanduser()
    try:
        return complement.build(root / f"letters-{spec.key()}", spec, progress=False)
    finally:
        world.use("")


def _said(*problems: str) -> str:
    """The agent's prompt as the stand-in proposer edits it for these problems."""
    return "\n".join([world.SYSTEM, *map(proposer_standin._instruction, problems)])


def test_the_stages_under_the_letters_policy_are_built_in_the_two_tool_world(tmp_path, monkeypatch, letters):
    """The instructed and counterfactual stages are the two-tool world's policies,
    cached under keys that name no variant: the letters stage builds them in that
    world even when the process is in the letters variant, and is back in the variant
    after. Before, they were built in the letters world when this module built the
    chain first (its demonstrations then held letters questions and a third tool), and
    test_world_prompts got that policy from the cache."""
    seen = []

    class Stop(Exception):
        pass

    def start(out, spec, progress=True):
        seen.append((world.VARIANT, [t["function"]["name"] for t in world.TOOLS]))
        world.demonstrations(1, seed=0)  # what the stage would be taught
        raise Stop

    monkeypatch.setattr(counterfactual, "build", start)
    with pytest.raises(Stop):
        complement.build(tmp_path / "letters", complement.LETTERS_POLICY, progress=False)
    assert seen == [("", ["calculator", "lookup"])]
    world.use("letters")  # the fixture's state; a built policy returns in the variant:
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "policy-spec.json").write_text(json.dumps({"key": complement.LETTERS_POLICY.key()}))
    world.use("")
    complement.build(tmp_path / "done", complement.LETTERS_POLICY, progress=False)
    assert world.VARIANT == "letters"


def test_the_two_tool_worlds_policies_are_not_built_in_the_variant(tmp_path, letters):
    """Their cache keys name no variant: a build in the letters world is refused by
    name before it trains anything, and a cached one is still served."""
    import policy

    for what, build in (("behaviour", lambda: policy.build(tmp_path / "p", policy.PolicySpec(), progress=False)),
                        ("instructed", lambda: policy.build_instructed(tmp_path / "i", policy.InstructSpec(),
                                                                       progress=False)),
                        ("counterfactual", lambda: counterfactual.build(tmp_path / "c", counterfactual.PROMPT_SENSITIVE,
                                                                        progress=False))):
        with pytest.raises(ValueError, match=f"the {what} policy is the two-tool world's.*'letters' variant"):
            build()
    assert not any(tmp_path.iterdir())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "policy-spec.json").write_text(json.dumps({"key": counterfactual.PROMPT_SENSITIVE.key()}))
    assert counterfactual.build(tmp_path / "c", counterfactual.PROMPT_SENSITIVE, progress=False) == tmp_path / "c"


def test_only_a_prompt_that_says_so_sends_letters_questions_to_the_counter(letters_policy, letters):
    """Teacher-forced, the first tool's probability (evaluate.right_tool_probability):
    under the agent's own prompt the policy almost never calls the counter, so its
    logs hold nearly no rewarded letters row for sft; under the stand-in's
    proposal, which quotes the other tools' error, it does. Measured on the build
    keyed 77d21c0ad4b7, 40 questions: own 0.001, proposal 0.997, the placebo 0.004,
    a colour line +0.41 on colour; for the other seeds recipe_check.py built
    (examples/agent_world/recipe_check.py, benchmarks/RESULTS.md) the proposal
    0.91-0.97. (The build before, d092dc10b85c, read a placebo at 0.344: a longer
    prompt lifted it a third as much as the proposal.)
    """
    import evaluate

    prompts = {"own": None,
               "said": _said(*(f"tool error: {t}: {world.LETTER_ERROR}" for t in ("lookup", "calculator"))),
               "placebo": _said("feedback: the answers were slow and too long"),
               "colour": _said("tool error: calculator: error: cannot calculate a colour")}
    p = evaluate.right_tool_probability(str(letters_policy), prompts, tasks=40)
    assert p["own"]["letters"] < 0.02, p
    assert p["said"]["letters"] > 0.85, p
    assert p["said"]["letters"] - p["placebo"]["letters"] > 0.3, p  # what the line says, more than that it is there
    assert p["colour"]["colour"] - p["own"]["colour"] > 0.2, p  # the old kinds still read their instructions
    assert abs(p["own"]["colour"] - 0.5) < 0.15 and abs(p["own"]["arithmetic"] - 0.5) < 0.15, p  # and a coin flip without


def test_no_prompt_moves_the_misreading(letters_policy, letters):
    """The part only logged data can fix: after the right tool's result the policy
    answers that value about 75 % of the time (p_misread 0.25; measured 0.72 and
    0.71 on 60 questions), with the proposal as with the agent's own prompt; the failures carry no error for a proposer to
    read, and rewarded rows are all read right."""
    import evaluate

    r = evaluate.read_probability(str(letters_policy), {"own": None, "said": _said(
        f"tool error: lookup: {world.LETTER_ERROR}", "tool error: calculator: error: cannot calculate a colour")},
        tasks=40)
    assert 0.6 < r["own"] < 0.88 and abs(r["said"] - r["own"]) < 0.05, r
