"""How much better is the candidate than what serves, and how sure can we be? The
statistics behind the gate command's contract (judge/gate.py), for outcomes
paired by task: candidate and serving played the same tasks, so each task gives
one of four outcomes and only the tasks where they differ move the difference.

Pairing is what makes 100 tasks enough. Unpaired, two success rates near 50 %
on 100 tasks each differ by 7 points in sd, and a point comparison with margin 0
passed candidates 13 points worse (issue 27). Paired on the same tasks with the
same sampling seeds, two close models agree on most tasks, the discordant ones
are few, and the bound below uses that correlation (Newcombe's hybrid score
interval for paired proportions, method 10 of Newcombe 1998, Stat Med 17:2635):
Wilson score limits of each rate, combined with the correlation of the pairs.
One-sided, at `confidence`: the lower limit is what the contract checks.
Standard library only: the command runs in whatever Python the team's check has.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist


@dataclass
class PairedBound:
    """The paired difference (candidate minus serving, success rates) on `n` tasks
    and its one-sided lower limit at `confidence`."""

    n: int
    candidate: float  # success rate
    serving: float
    estimate: float  # candidate - serving
    lower: float
    confidence: float
    candidate_only: int  # tasks only the candidate solved
    serving_only: int  # tasks only what serves solved

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion at normal quantile `z`."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _phi(both: int, cand_only: int, serv_only: int, neither: int, n: int) -> float:
    """The pairs' correlation, with Newcombe's continuity correction (toward 0 when
    positive), 0 where a margin is empty."""
    denom = (both + cand_only) * (serv_only + neither) * (both + serv_only) * (cand_only + neither)
    if denom == 0:
        return 0.0
    num = both * neither - cand_only * serv_only
    if num > 0:
        num = max(num - n / 2, 0.0)
    return num / math.sqrt(denom)


def paired_lower(candidate: list[bool], serving: list[bool], confidence: float = 0.95) -> PairedBound:
    """The one-sided lower limit of candidate minus serving success, the i-th
    outcome of each list from the same task."""
    if len(candidate) != len(serving):
        raise ValueError(f"paired outcomes need the same tasks: {len(candidate)} candidate, {len(serving)} serving")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence}")
    n = len(candidate)
    if n == 0:
        return PairedBound(0, 0.0, 0.0, 0.0, -1.0, confidence, 0, 0)
    both = sum(1 for c, s in zip(candidate, serving) if c and s)
    cand_only = sum(1 for c, s in zip(candidate, serving) if c and not s)
    serv_only = sum(1 for c, s in zip(candidate, serving) if s and not c)
    neither = n - both - cand_only - serv_only
    z = NormalDist().inv_cdf(confidence)
    p1, p2 = (both + cand_only) / n, (both + serv_only) / n
    l1, _ = wilson(both + cand_only, n, z)
    _, u2 = wilson(both + serv_only, n, z)
    phi = _phi(both, cand_only, serv_only, neither, n)
    spread = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    lower = max(-1.0, (p1 - p2) - math.sqrt(max(spread, 0.0)))
    return PairedBound(n, p1, p2, p1 - p2, lower, confidence, cand_only, serv_only)
