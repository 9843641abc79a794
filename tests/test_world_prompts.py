"""APO on the agent world (issue 27, item 8): the real APO round
(nightshift.prompts.propose) reads the behaviour policy's own logged episodes and,
with the stand-in proposer, which knows nothing of the world, proposes a prompt
that quotes the failures' tool errors back as instructions, in a wording no
instruction the prompt-sensitive policy is taught (instructions.py) has.

Not here yet: that this prompt lifts the prompt-sensitive policy by 15 points with
a placebo line flat (no instruction-tuning variant tried so far follows the
content rather than the length of an instruction; benchmarks/RESULTS.md)."""

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

import instructions  # noqa: E402
import world  # noqa: E402

LOGGED = 60  # the base prompt's episodes the proposer reads (its failures)


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
    # the stand-in was sent failures with their tool errors, and nothing else to go on
    critique = next(r["body"]["messages"][0]["content"] for r in sent if "<trajectories>" in
                    r["body"]["messages"][0]["content"])
    assert "FAILED" in critique and world.TOOL_ERRORS["calculator"] in critique
