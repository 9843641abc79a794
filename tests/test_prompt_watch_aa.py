"""The prompt watch under noise (issue 27's targets): an identical candidate (A/A) is
never promoted nor stopped over 20 seeds, and a harmful prompt (one that drops an
instruction the task needs) is stopped. Simulated looks at growing evidence, the
watch's own decision (`prompt_action` over `judge`) at its default settings, the
rewards drawn here and never shown to the decision except as rewards."""

from __future__ import annotations

import random

from nightshift.judge.prompt_watch import prompt_action
from nightshift.judge.watch import WatchSettings, judge
from nightshift.publish.canary import CanarySettings

W, C = WatchSettings(), CanarySettings(max_hours=72)
LOOKS = 24  # a look an hour for a day
PER_LOOK = 40  # trajectories per arm between looks: 960 a side by the end


def _run(seed: int, p_own: float, p_cand: float) -> str | None:
    """The first action the watch takes over a day of hourly looks, or None."""
    rng = random.Random(seed)
    own, cand = [], []
    for hour in range(1, LOOKS + 1):
        own += [float(rng.random() < p_own) for _ in range(PER_LOOK)]
        cand += [float(rng.random() < p_cand) for _ in range(PER_LOOK)]
        action = prompt_action(judge(own, cand, alpha=W.alpha, tau=W.tau, min_trajectories=W.min_trajectories),
                               hour, W, C)
        if action:
            return action
    return None


def test_an_identical_prompt_is_never_promoted_nor_stopped_over_20_seeds():
    # the adapter's rule would promote it: no worse than the margin is all it asks
    assert [_run(s, 0.5, 0.5) for s in range(20)] == [None] * 20


def test_a_harmful_prompt_is_stopped_and_a_helpful_one_promoted():
    assert [_run(s, 0.6, 0.4) for s in range(20)] == ["stop"] * 20
    assert [_run(s, 0.4, 0.6) for s in range(20)] == ["promote"] * 20
