"""`sft`: rejection-sampling fine-tuning, the default: the log-likelihood of the
rows at or above a reward threshold (the `top_k` best of each task group with
top_k > 0). The learning benchmark's best and safest objective on logged calls
(/work/shared/research/offline-learning.md: filtered SFT is the baseline the
others must beat).
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
    rows = [{"input_ids": e.r.prompt_ids + e.r.completion_ids,
             "completion_mask": [0] * len(e.r.prompt_ids) + [1] * len(e.r.completion_ids)} for e in good]
    return rows, +left


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if not plan.packed:
        args = {**args, "train_sampling_strategy": "group_by_length"}
    conf = SFTConfig(**args, max_length=cfg.max_length, packing=plan.packed, padding_free=plan.packed,
                     completion_only_loss=True)
    return SFTTrainer(model=model, args=conf, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      callbacks=callbacks)


ALGORITHM = Algorithm(name="sft", settings=SFTSettings, order=2, examples=examples, trainer=make_trainer,
                      shared_loop=False)
