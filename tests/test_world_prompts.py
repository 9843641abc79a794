"""APO on the agent world (issue 27, item 8): the real APO round
(nightshift.prompts.propose) reads the behaviour policy's own logged episodes and,
with the stand-in proposer, which knows nothing of the world, proposes a prompt
that quotes the failures' tool errors back as instructions, in a wording no
instruction the prompt-sensitive policy is taught (instructions.py) has.

Not here yet: that this prompt lifts the prompt-sensitive policy by 15 points with
a placebo line flat. No instruction-tuning recipe tried so far follows the content
rather than the length of an instruction: the default's placebo lifts it, the
counterfactual recipe (counterfactual.py), which hides the length, learned
nothing of the prompt (benchmarks/RESULTS.md, measured with the probe tested
here)."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

from nightshift.prompts.config import ApoConfig
from nightshift.prompts.propose import propose
from support import proposer_standin
from support.proposer_standin import Standin
from support.world import logged_episodes
from transitions_data import write

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agent_world"))

import evaluate  # noqa: E402
import instructions  # noqa: E402
import world  # noqa: E402

LOGGED = 60  # the base prompt's episodes the proposer reads (its failures)
#: In the stand-in's frame and length, about slowness: nothing a tool choice depends on, and not a taught line.
PLACEBO = proposer_standin._instruction("feedback: the answers were slow and too long")


@pytest.fixture(scope="module")
def proposal(tmp_path_factory, world_policy) -> tuple[str, list[dict]]:
    """The system prompt one APO round proposes from the policy's own logged
    episodes, and what the stand-in proposer was sent."""
    root = tmp_path_factory.mktemp("world-prompts")
    write(root / "data", logged_episodes(world_policy, LOGGED))
    with Standin() as s:
        rnd = propose(ApoConfig(data=str(root / "data"), base_url=s.url, model="standin", candidates=1, timeout=30.0,
                                retries=0), "solver", salt="night-1")
        sent = list(s.requests)
    assert rnd.stored, [a.rejected for a in rnd.attempts]
    return rnd.stored[0].system, sent


def test_the_standin_knows_nothing_of_the_world():
    """What the proposer writes comes from what it is sent: its code names no task,
    tool or instruction of the world."""
    words = set(re.findall(r"[a-z]+", inspect.getsource(proposer_standin).lower()))
    known = {"colour", "color", "calculator", "calculate", "lookup", "arithmetic", *world.COLOURS, *world.ITEMS}
    assert not words & known, words & known


def test_the_proposal_is_what_the_failures_said_in_a_wording_the_policy_never_saw(proposal):
    prompt, sent = proposal
    assert prompt.startswith(world.SYSTEM)
    added = [line for line in prompt.splitlines()[1:] if line.strip()]
    assert added, prompt
    # each added instruction quotes a tool error of the world (what the failures said)...
    assert all(any(e in line for e in world.TOOL_ERRORS.values()) for line in added), added
    # ...and none is an instruction the policy was taught (held out)
    taught = {*instructions.COLOUR, *instructions.ARITHMETIC, *instructions.DISTRACTORS}
    assert not taught & set(added) and not any(t in prompt for t in taught), added
    import counterfactual  # the recipe tried next (not adopted): its lines hold the proposal out too

    assert not counterfactual.taught() & set(added), added
    # the stand-in was sent failures with their tool errors, and nothing else to go on
    critique = next(r["body"]["messages"][0]["content"] for r in sent if "<trajectories>" in
                    r["body"]["messages"][0]["content"])
    assert "FAILED" in critique and world.TOOL_ERRORS["calculator"] in critique


def test_a_counterfactual_twin_differs_only_where_the_instruction_was():
    """The tried recipe (examples/agent_world/counterfactual.py) hides everything but
    content: how many lines a prompt gained says nothing about whether one
    instructs, and an instructed prompt's twin has the same lines but a distractor
    in each instruction's place."""
    import random

    import counterfactual

    rng = random.Random(3)
    instructed_by_count: dict[int, list[bool]] = {0: [], 1: [], 2: []}
    for _ in range(3000):
        prompt, helps, twin = counterfactual.draw_pair(rng, world.SYSTEM)
        lines, other = prompt.splitlines(), twin.splitlines()
        instructed_by_count[len(lines) - 1].append(bool(helps))
        assert len(lines) == len(other) and lines[0] == other[0] == world.SYSTEM
        changed = [i for i, (a, b) in enumerate(zip(lines, other)) if a != b]
        assert len(changed) == len(helps), (prompt, twin)
        for i in changed:
            assert any(c in lines[i] for c in (*counterfactual.COLOUR, *counterfactual.ARITHMETIC)), lines[i]
            assert any(c in other[i] for c in counterfactual.DISTRACTORS), other[i]
        taught = counterfactual.taught()
        assert all(line in taught for line in lines[1:] + other[1:])
    assert not any(instructed_by_count[0])
    share = {k: sum(v) / len(v) for k, v in instructed_by_count.items() if k}
    assert abs(share[1] - share[2]) < 0.06, share  # ~1000 prompts each: sd of the difference 2.2 points
    # no content names both kinds, and no distractor names either: a keyword would be enough to read them
    assert all("colour" in c and "arithmetic" not in c for c in counterfactual.COLOUR)
    assert all("arithmetic" in c and "colour" not in c for c in counterfactual.ARITHMETIC)
    assert not any("colour" in c or "arithmetic" in c for c in counterfactual.DISTRACTORS)


def test_the_probe_reads_the_first_tool_choice(world_policy):
    """evaluate.right_tool_probability, what the recipes were compared with: a
    probability per kind, the agent's own prompt when given None, and the world's
    behaviour policy near the coin flip it was taught (p_right_tool 0.5)."""
    probe = evaluate.right_tool_probability(str(world_policy), {"own": None, "same": world.SYSTEM,
                                                                "placebo": world.SYSTEM + "\n" + PLACEBO}, tasks=40)
    assert probe["own"] == probe["same"]
    for p in probe.values():
        assert set(p) == {"arithmetic", "colour", "all"} and all(0.0 < v < 1.0 for v in p.values()), p
    assert 0.3 < probe["own"]["all"] < 0.7, probe
