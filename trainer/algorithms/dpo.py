"""`dpo`: TRL's DPOTrainer on pairs of answers to the very same prompt within a
task group. A TRL trainer with its own row batches: it gets the run's
precision and attention, not packing, token budgets or the memory plan's
micro-batches.
"""

from __future__ import annotations

import random
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
class DPOSettings:
    """TRL's DPOTrainer on pairs within a group_id with the same prompt (input messages and tools)."""

    min_margin: float = setting(0.1, help="the highest and lowest reward must differ by at least this",
                                bounds="[0, inf)")
    beta: float = setting(0.1, help="DPO's temperature", bounds="(0, inf)")


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    """Pairs from rows that answered the very same prompt (same rendered tokens)
    within one task group: the highest reward chosen, the lowest rejected, when
    they differ by at least `min_margin`. One pair per prompt."""
    from ..examples import conversational, load_fallback_tools

    fallback = load_fallback_tools(cfg)
    by_prompt: dict[tuple, list[Example]] = defaultdict(list)
    for e in rendered:
        by_prompt[(e.row.get("group_id") or "", tuple(e.r.prompt_ids))].append(e)
    pairs, left = [], Counter()
    for group in by_prompt.values():
        if len(group) < 2:
            left["no other answer to the same prompt"] += len(group)
            continue
        group.sort(key=lambda e: (-e.row["reward"], e.row["transition_id"]))
        best, worst = group[0], group[-1]
        if best.row["reward"] - worst.row["reward"] < cfg.dpo.min_margin:
            left[f"answers to one prompt within dpo.min_margin ({cfg.dpo.min_margin})"] += len(group)
            continue
        chosen, rejected = conversational(best, fallback), conversational(worst, fallback)
        pairs.append({"prompt": chosen["prompt"], "chosen": chosen["completion"], "rejected": rejected["completion"],
                      "tools": chosen["tools"]})
        left["answers beside the chosen and rejected of their prompt"] += len(group) - 2
    random.Random(cfg.seed).shuffle(pairs)
    return pairs, +left


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from datasets import Dataset

    from ..loop import row_batches

    args = {**args, **row_batches(cfg, plan, sequences=2, at_least=1)}
    from trl import DPOConfig, DPOTrainer

    conf = DPOConfig(**args, max_length=plan.max_length, beta=cfg.dpo.beta)
    return DPOTrainer(model=model, args=conf, train_dataset=Dataset.from_list(rows, on_mixed_types="use_json"),
                      processing_class=tok, callbacks=callbacks)


ALGORITHM = Algorithm(name="dpo", settings=DPOSettings, order=4, examples=examples, trainer=make_trainer,
                      shared_loop=False)
