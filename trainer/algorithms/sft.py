"""`sft`: rejection-sampling fine-tuning, the default: the log-likelihood of the
rows at or above a reward threshold (the `top_k` best of each task group with
top_k > 0), on the shared loop (trainer/loop.py: token-budget steps, packing,
the memory plan). The learning benchmark's best and safest objective on logged
calls (filtered SFT is the baseline the others must beat).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightshift.settings import setting

from . import Algorithm

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..examples import Example
    from ..plan import RunPlan


@dataclass
class SFTSettings:
    """Supervised fine-tuning on the best rows (rejection-sampling fine-tuning: the baseline)."""

    threshold: float = setting(0.5, help="train on rows with reward at least this")
    top_k: int = setting(0, help="with k > 0: only the k best of each group_id among those", bounds="[0, inf)")


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    """Rejection sampling: the rows at or above the reward threshold (the `top_k` best
    per task group with top_k > 0), pre-tokenized with the same renderer `pg` uses."""
    left: Counter = Counter()
    good = [e for e in rendered if e.row["reward"] is not None and e.row["reward"] >= cfg.sft.threshold]
    left[f"reward below sft.threshold ({cfg.sft.threshold})"] = len(rendered) - len(good)
    if cfg.sft.top_k > 0:
        groups: dict[str, list[Example]] = defaultdict(list)
        for e in good:
            groups[e.row.get("group_id") or e.row["trajectory_id"]].append(e)
        kept = []
        for g in groups.values():
            g.sort(key=lambda e: (-e.row["reward"], e.row["transition_id"]))
            kept += g[: cfg.sft.top_k]
        left[f"beyond the top {cfg.sft.top_k} of their group"] = len(good) - len(kept)
        good = kept
    rows = [{"input_ids": e.r.prompt_ids + e.r.completion_ids, "completion_start": len(e.r.prompt_ids)}
            for e in good]
    return rows, +left


def nll(logp, batch):
    """The negative log-likelihood of the completion tokens, summed: the shared loop
    divides by the step's completion tokens, so the loss is the token mean over
    the whole optimizer step (what TRL's SFTTrainer computes), whatever the
    micro-batches and processes."""
    return -logp.sum(), {"sft/nll": -logp.mean().item() if logp.numel() else 0.0}


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from ..loop import Objective, make_trainer

    return make_trainer(cfg, plan, model, tok, rows, args, callbacks, Objective(nll, per="token"))


ALGORITHM = Algorithm(name="sft", settings=SFTSettings, order=2, examples=examples, trainer=make_trainer)
