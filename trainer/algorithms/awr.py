"""`awr`: advantage-weighted regression (arXiv 1910.00177) on the shared loop:
the log-likelihood of each call weighted by exp(A / beta), normalized to mean 1
and capped. Never pushes anything down, so it cannot break the format the way
negative gradients can. It is `pg_loss` with those weights in place of the
advantage and no ratio at all.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightshift.settings import setting

from . import Algorithm

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..examples import Example
    from ..plan import RunPlan


@dataclass
class AWRSettings:
    """Advantage-weighted regression (arXiv 1910.00177): the log-likelihood of each call
    weighted by exp(A / beta), normalized to mean 1 and capped. Never pushes anything
    down, so it cannot break the format the way negative gradients can."""

    beta: float = setting(0.5, help="temperature of exp(A / beta); low approaches filtered SFT", bounds="(0, inf)")
    max_weight: float = setting(20.0, help="cap on a row's weight", bounds="(0, inf)")


def awr_features(examples: list[Example], beta: float, max_weight: float, offset: float = 0.0) -> list[dict]:
    """`pg_features` whose `advantage` is AWR's weight exp(A / beta), normalized to
    mean 1 over the rows (the learning rate means the same whatever the spread of
    rewards) and capped at `max_weight` (one lucky row cannot dominate)."""
    from ..examples import pg_features

    feats = pg_features(examples)
    if not feats:
        return feats
    advs = [f["advantage"] + offset for f in feats]
    top = max(advs)
    raw = [math.exp((a - top) / beta) for a in advs]  # shifted: no overflow, same ratios
    mean = sum(raw) / len(raw)
    for f, w in zip(feats, raw):
        f["advantage"] = min(w / mean, max_weight)
    return feats


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    return awr_features(rendered, cfg.awr.beta, cfg.awr.max_weight), Counter()


def awr_loss(logp, batch):
    """Weighted log-likelihood summed over the rows: the weights ride in
    `advantage`, μ plays no part."""
    import torch

    from .pg import pg_loss

    unknown = torch.full_like(batch["old_logprobs"], math.nan)
    return pg_loss(logp, unknown, batch["advantage"], batch["tok_seq"], batch["weight"], clip="none",
                   denominator=1.0)


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from ..loop import Objective, make_trainer

    return make_trainer(cfg, plan, model, tok, rows, args, callbacks, Objective(awr_loss, per="row"))


ALGORITHM = Algorithm(name="awr", settings=AWRSettings, order=1, examples=examples, trainer=make_trainer,
                      needs_advantage=True)
