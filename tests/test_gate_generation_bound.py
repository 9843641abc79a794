"""The generation check decides on evidence, not on a point comparison: it
blocks a candidate whose samples show its valid-output share fell by more than
the margin, and lets through a fall the samples cannot tell from none. Before
this, 83.0 % against 89.8 % valid on 88 paired samples blocked a candidate the
world's checker measured 23 points better (benchmarks/learning.py, issue 27)."""

from __future__ import annotations

import random

from nightshift.judge.gate import GateDecision, GateSettings, _judge, paired_upper_bound


def _decide(cand: list[int], serv: list[int]) -> GateDecision:
    d = GateDecision(passed=False, reason="", candidate="c", published=None)
    scores = lambda v: {"mean_logp": [], "valid": v, "first_sample": ""}  # noqa: E731
    _judge(d, [], scores(cand), scores(serv), GateSettings())
    return d


def test_a_fall_inside_the_samples_noise_passes():
    # awr-s2 night 1: 73 of 88 valid against 79 of 88 on the same prompts (6 only the serving model got right)
    serv = [1] * 79 + [0] * 9
    cand = [1] * 73 + [0] * 15
    d = _decide(cand, serv)
    assert d.candidate_metrics["valid_share"] < d.published_metrics["valid_share"] - 0.05  # the old rule blocked
    assert d.checks["generation"]["passed"], d.checks["generation"]["detail"]
    assert d.passed


def test_a_broken_format_is_blocked():
    # pg-s0 night 1: 57 of 88 valid against 79
    serv = [1] * 79 + [0] * 9
    cand = [1] * 57 + [0] * 31
    d = _decide(cand, serv)
    assert not d.checks["generation"]["passed"]
    assert "breaks the output format" in d.reason
    assert d.candidate_metrics["valid_fall_upper"] < -0.05


def test_the_bound_covers_the_true_difference_as_often_as_it_claims():
    rng = random.Random(0)
    misses = 0
    for _ in range(2000):
        serv = [int(rng.random() < 0.9) for _ in range(88)]
        cand = [s if rng.random() < 0.9 else int(rng.random() < 0.8) for s in serv]  # true fall: 0.1 * 0.1 = 1 point
        misses += paired_upper_bound(cand, serv, 0.95) < -0.01
    assert misses / 2000 < 0.08  # nominal 5 %; a bound that ignored the pairing's noise would miss far more


def test_no_samples_and_no_disagreement_are_not_certainty():
    assert paired_upper_bound([], [], 0.95) == 0.0
    assert paired_upper_bound([1] * 4, [1] * 4, 0.95) > 0.3  # four agreeing samples say little
