"""The training algorithms, one module each, TRL's shape: a module holds its
settings (YAML `train.<name>:`, `NIGHTSHIFT_TRAIN_<NAME>_*`, `--<name>-*`), how
the rendered rows become its examples, its trainer and its loss, and ends with
`ALGORITHM`, the record below. They are found by name from the files in this
folder, so adding an algorithm is one new file: the settings section, the
`--algorithm` choice and the row checks follow from its record.

The modules import only the standard library and `nightshift.settings` at the
top (everything heavy inside functions): `trainer/config.py` reads every
record to build `TrainConfig`, and reading the settings must not load torch.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Prepared:
    """What an algorithm's work before training adds to the summary and the manifest."""

    logged: Counter = field(default_factory=Counter)  # counts merged into the summary's logged figures
    notes: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)  # kept under metrics.train in the manifest


@dataclass(frozen=True)
class Algorithm:
    """One algorithm, as the rest of the trainer sees it."""

    name: str
    #: Its settings dataclass, the `train.<name>` section.
    settings: type
    #: Where `--algorithm` lists it (the choices read in this order).
    order: int
    #: cfg, rendered examples -> (training rows, rows left out by reason).
    examples: Callable[[Any, list], tuple[list[dict], Counter]]
    #: (cfg, plan, policy, tokenizer, rows, training-argument dict, callbacks) -> a transformers Trainer.
    trainer: Callable[..., Any]
    #: Rows need a finite advantage (and the dataset the column); rows nobody rated may train
    #: when `select.require_reward` is off.
    needs_advantage: bool = False
    #: Its rows go through trainer/loop.py (token-budget steps, packing, the memory plan, the
    #: out-of-memory retry); False: a TRL trainer with its own row batches.
    shared_loop: bool = True
    #: Checks between settings, beyond each field's own (raise `settings.invalid`).
    rules: Callable[[Any], None] | None = None
    #: The policy the held-out KL is measured against: "base" or "init".
    reference: Callable[[Any], str] = lambda cfg: "base"
    #: Work with the policy loaded, before the first step: (cfg, plan, policy, tok, rows, ref_fn) -> Prepared.
    before_training: Callable[..., Prepared] | None = None


@functools.cache
def registry() -> dict[str, Algorithm]:
    """Every module of this folder's `ALGORITHM`, in `--algorithm`'s order."""
    found = [importlib.import_module(f"{__name__}.{m.name}").ALGORITHM for m in pkgutil.iter_modules(__path__)]
    return {a.name: a for a in sorted(found, key=lambda a: (a.order, a.name))}


def get(name: str) -> Algorithm:
    try:
        return registry()[name]
    except KeyError:
        raise ValueError(f"no algorithm {name!r}: one of {', '.join(registry())}") from None
