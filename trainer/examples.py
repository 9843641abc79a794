"""Selected transitions to each algorithm's training examples: rendered once, the
overlong and unrenderable left out and counted, trajectories split into train
and held-out, then shaped for `pg` (token features with advantages and logged
logprobs), `sft` (the best rows), `kto` (rows labelled by reward) or `dpo`
(same-prompt pairs within a task group).
"""

from __future__ import annotations

import json
import random
import statistics
from collections import Counter, defaultdict
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


def prepare(cfg: TrainConfig, tokenizer, selection: Selection) -> Prepared:
    """Render every selected row and split by trajectory."""
    excluded: Counter = Counter()
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
        if len(r) > cfg.max_length:
            excluded[f"longer than max_length ({cfg.max_length} tokens)"] += 1
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
    return Prepared(train, held, excluded, logged, first_error, note)


def pg_features(examples: list[Example], normalize: bool = False, offset: float = 0.0) -> list[dict]:
    """Token features for `PGTrainer`: weights rescaled to mean 1 over the rows (so
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


def awr_features(examples: list[Example], beta: float, max_weight: float, offset: float = 0.0) -> list[dict]:
    """`pg_features` whose `advantage` is AWR's weight exp(A / beta), normalized to
    mean 1 over the rows (the learning rate means the same whatever the spread of
    rewards) and capped at `max_weight` (one lucky row cannot dominate)."""
    import math

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


def _conversational(e: Example, fallback: list[dict] | None = None) -> dict:
    prompt, completion, tools = conversation(e.row, fallback)
    return {"prompt": prompt, "completion": [completion], "tools": json.dumps(tools) if tools else None}


def sft_examples(cfg: TrainConfig, examples: list[Example]) -> tuple[list[dict], Counter]:
    """Rejection sampling: the rows at or above the reward threshold (the `top_k` best
    per task group with top_k > 0), pre-tokenized with the same renderer `pg` uses."""
    left: Counter = Counter()
    good = [e for e in examples if e.row["reward"] is not None and e.row["reward"] >= cfg.sft.threshold]
    left[f"reward below sft.threshold ({cfg.sft.threshold})"] = len(examples) - len(good)
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


def kto_examples(cfg: TrainConfig, examples: list[Example]) -> tuple[list[dict], Counter]:
    """Unpaired preferences: desirable when the reward is above the threshold.
    Shuffled here because KTOTrainer samples in order (its KL term pairs
    neighbours, and sorted data would pair like with like)."""
    fallback = load_fallback_tools(cfg)
    rows = [{**_conversational(e, fallback), "label": bool(e.row["reward"] > cfg.kto.threshold)} for e in examples]
    n_good = sum(r["label"] for r in rows)
    if rows and (n_good == 0 or n_good == len(rows)):
        side = "above" if n_good else "at or below"
        raise TrainDataError(
            f"kto needs desirable and undesirable rows, but all {len(rows)} have a reward {side} "
            f"kto.threshold={cfg.kto.threshold}; set the threshold between your rewards")
    random.Random(cfg.seed).shuffle(rows)
    return rows, Counter()


def dpo_examples(cfg: TrainConfig, examples: list[Example]) -> tuple[list[dict], Counter]:
    """Pairs from rows that answered the very same prompt (same rendered tokens)
    within one task group: the highest reward chosen, the lowest rejected, when
    they differ by at least `min_margin`. One pair per prompt."""
    fallback = load_fallback_tools(cfg)
    by_prompt: dict[tuple, list[Example]] = defaultdict(list)
    for e in examples:
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
        chosen, rejected = _conversational(best, fallback), _conversational(worst, fallback)
        pairs.append({"prompt": chosen["prompt"], "chosen": chosen["completion"], "rejected": rejected["completion"],
                      "tools": chosen["tools"]})
        left["answers beside the chosen and rejected of their prompt"] += len(group) - 2
    random.Random(cfg.seed).shuffle(pairs)
    return pairs, +left
