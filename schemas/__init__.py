"""Versioned Arrow schemas of every Nightshift dataset: the contract between stages.

Each dataset module exposes `NAME`, `SCHEMA` (with the version in its metadata)
and `KEY` (the columns that identify a row; the collector stores each key once).
"""

from . import feedback, logs, spans, transitions
from .common import ANY_VALUE, ATTRIBUTE, ATTRIBUTES, SCHEMA_VERSION, attr

DATASETS = {spans.NAME: spans, logs.NAME: logs, feedback.NAME: feedback, transitions.NAME: transitions}

__all__ = ["ANY_VALUE", "ATTRIBUTE", "ATTRIBUTES", "DATASETS", "SCHEMA_VERSION", "attr", "feedback", "logs", "spans", "transitions"]
