"""Selected transitions to examples: rendered once, the overlong and
unrenderable left out and counted, trajectories split into train and held-out;
then token features (`pg_features`: what the shared loop, evaluation and the
gate read). Each algorithm shapes its own rows from these (trainer/algorithms/).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass, field

from .config import TrainConfig
from .render import Rendered, conversation, render, tools_of, uses_tools
from .select import Selection, TrainDataError, held_out


@dataclass
class Example:
    row: dict
    r: Rendered


@dataclass
class Prepared:
    train: list[Example]
    eval: list[Example]
    excluded: Counter = field(default_factory=Counter)
    logged: Counter = field(default_factory=Counter)  # none | match | drift, and with_logprobs
    first_error: str = ""
    split_note: str = ""
    too_long: Counter = field(default_factory=Counter)  # rows longer than max_length, by agent


def load_fallback_tools(cfg: TrainConfig) -> list[dict] | None:
    if not cfg.tools_fallback:
        return None
    try:
        tools = json.loads(open(cfg.tools_fallback).read())
    except (OSError, json.JSONDecodeError) as e:
        raise TrainDataError(f"tools_fallback: cannot read a JSON list of tools from {cfg.tools_fallback}: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise TrainDataError(f"tools_fallback: {cfg.tools_fallback} must hold a JSON list of tool definitions")
    return tools


def prepare(cfg: TrainConfig, tokenizer, selection: Selection, max_length: int | None = None) -> Prepared:
    """Render every selected row and split by trajectory. `max_length`: the run's
    (the run plan's; default `train.max_length`, where 0 is no limit); longer rows
    are left out and counted, by agent too."""
    limit = cfg.max_length if max_length is None else max_length
    excluded: Counter = Counter()
    too_long: Counter = Counter()
    logged: Counter = Counter()
    first_error = ""
    fallback = load_fallback_tools(cfg)
    train, held = [], []
    for row in selection.rows:
        if not tools_of(row) and uses_tools(row):
            logged["tools from tools_fallback" if fallback else "tool calls without tool definitions"] += 1
        try:
            r = render(tokenizer, row, fallback)
        except Exception as e:  # noqa: BLE001 - a user's template can raise anything; count it, go on
            excluded["chat template failed"] += 1
            first_error = first_error or f"{type(e).__name__}: {e}"
            continue
        if not r.completion_ids:
            excluded["empty completion once rendered"] += 1
            continue
        if limit and len(r) > limit:
            excluded[too_long_reason(limit)] += 1
            too_long[row.get("agent_name") or "(no agent name)"] += 1
            continue
        if r.prefix_mismatch:
            logged["prompt renders differently alone (template)"] += 1
        logged[r.logged] += 1
        if r.old_logprobs is not None:
            logged["with_logprobs"] += 1
        (held if held_out(row["trajectory_id"], cfg.eval_fraction) else train).append(Example(row, r))
    note = ""
    if not train and held:
        train, held = held, []
        note = "too few trajectories to hold any out: nothing evaluated on a held-out split"
    elif not held and cfg.eval_fraction > 0:
        note = "no trajectory fell in the held-out split: nothing evaluated"
    return Prepared(train, held, excluded, logged, first_error, note, too_long)


def too_long_reason(max_length: int) -> str:
    return f"longer than max_length ({max_length:,} tokens)"


def pg_features(examples: list[Example], normalize: bool = False, offset: float = 0.0) -> list[dict]:
    """Token features for the shared loop (trainer/loop.py): weights rescaled to mean 1 over the rows (so
    the learning rate means the same whatever the trajectory lengths), advantages
    optionally to unit standard deviation, then shifted by `offset` (AsymRE's
    baseline below the mean). Each carries its row, for μ's recomputation."""
    if not examples:
        return []
    weights = [float(e.row["weight"]) for e in examples]
    mean_w = sum(weights) / len(weights) or 1.0
    advs = [e.row.get("advantage") for e in examples]  # None only in eval rows of other algorithms
    scale = 1.0
    known = [a for a in advs if a is not None]
    if normalize and len(known) > 1:
        sd = statistics.pstdev(known)
        scale = 1.0 / sd if sd > 1e-8 else 1.0
    return [
        {
            "input_ids": e.r.prompt_ids + e.r.completion_ids,
            "completion_start": len(e.r.prompt_ids),
            "advantage": a * scale + offset if a is not None else None,
            "weight": w / mean_w,
            "old_logprobs": e.r.old_logprobs,
            "policy_version": e.row.get("policy_version"),
            "temperature": e.row.get("temperature"),
            "model": e.row.get("model"),
        }
        for e, w, a in zip(examples, weights, advs)
    ]


def conversational(e: Example, fallback: list[dict] | None = None) -> dict:
    """A row as TRL's conversational format (prompt messages, completion, tools as JSON)."""
    prompt, completion, tools = conversation(e.row, fallback)
    return {"prompt": prompt, "completion": [completion], "tools": json.dumps(tools) if tools else None}
