"""`kto`: TRL's KTOTrainer on unpaired preferences (desirable: reward above a
threshold), desirable and undesirable weights balanced from their counts. A
TRL trainer with its own row batches: it gets the run's precision and
attention, not packing, token budgets or the memory plan's micro-batches.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightshift.settings import invalid, setting

from . import Algorithm

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..examples import Example
    from ..plan import RunPlan


@dataclass
class KTOSettings:
    """TRL's KTOTrainer; desirable and undesirable weights balanced from their counts."""

    threshold: float = setting(0.5, help="a row is desirable when its reward is above this")
    beta: float = setting(0.1, help="KTO's temperature", bounds="(0, inf)")


def rules(cfg: TrainConfig) -> None:
    if 0 < cfg.batch_size < 2:
        raise invalid("batch_size", "kto needs batch_size >= 2: its KL term pairs each completion with another "
                                    "row's prompt")


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    """Unpaired preferences: desirable when the reward is above the threshold.
    Shuffled here because KTOTrainer samples in order (its KL term pairs
    neighbours, and sorted data would pair like with like)."""
    from ..examples import conversational, load_fallback_tools
    from ..select import TrainDataError

    fallback = load_fallback_tools(cfg)
    rows = [{**conversational(e, fallback), "label": bool(e.row["reward"] > cfg.kto.threshold)} for e in rendered]
    n_good = sum(r["label"] for r in rows)
    if rows and (n_good == 0 or n_good == len(rows)):
        side = "above" if n_good else "at or below"
        raise TrainDataError(
            f"kto needs desirable and undesirable rows, but all {len(rows)} have a reward {side} "
            f"kto.threshold={cfg.kto.threshold}; set the threshold between your rewards")
    random.Random(cfg.seed).shuffle(rows)
    return rows, Counter()


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from datasets import Dataset

    from ..loop import row_batches

    args = {**args, **row_batches(cfg, plan, sequences=1, at_least=2)}
    from trl import KTOConfig, KTOTrainer

    good = sum(r["label"] for r in rows)
    bad = len(rows) - good
    # Equal weighted counts: inside the [1, 4/3] ratio TRL recommends.
    conf = KTOConfig(**args, max_length=plan.max_length, beta=cfg.kto.beta,
                     desirable_weight=max(1.0, bad / max(good, 1)), undesirable_weight=max(1.0, good / max(bad, 1)))
    return KTOTrainer(model=model, args=conf, train_dataset=Dataset.from_list(rows, on_mixed_types="use_json"),
                      processing_class=tok, callbacks=callbacks)


ALGORITHM = Algorithm(name="kto", settings=KTOSettings, order=3, examples=examples, trainer=make_trainer,
                      shared_loop=False, rules=rules)
