"""Versioned Arrow schemas of every Nightshift dataset: the contract between stages.

Each dataset module exposes `NAME`, `SCHEMA` (with the version in its metadata)
and `KEY` (the columns that identify a row; the collector stores each key once).

The names below load on first use (PEP 562), not when the package does: the
dataset schemas need pyarrow (36 MiB of memory), and `nightshift route` imports
only `prompt_identity` and `prompt_template` from here, which need nothing.
"""

from __future__ import annotations

import importlib

_MODULES = ("spans", "logs", "feedback", "transitions")  # DATASETS in this order, as before
_COMMON = ("ANY_VALUE", "ATTRIBUTE", "ATTRIBUTES", "SCHEMA_VERSION", "attr")

__all__ = ["ANY_VALUE", "ATTRIBUTE", "ATTRIBUTES", "DATASETS", "SCHEMA_VERSION", "attr", "feedback", "logs", "spans", "transitions"]


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _COMMON:
        return getattr(importlib.import_module(f"{__name__}.common"), name)
    if name == "DATASETS":
        mods = [importlib.import_module(f"{__name__}.{m}") for m in _MODULES]
        globals()["DATASETS"] = datasets = {m.NAME: m for m in mods}
        return datasets
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
