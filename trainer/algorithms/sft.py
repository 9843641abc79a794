"""`sft`: rejection-sampling fine-tuning, the default: the log-likelihood of the
rows at or above a reward threshold (the `top_k` best of each task group with
top_k > 0), on the shared loop (trainer/loop.py: token-budget steps, packing,
the memory plan). The learning benchmark's best and safest objective on logged
calls (filtered SFT is the baseline the others must beat).

The anchor. Rewarded rows say nothing about states no rewarded row visits (in
the agent world: every call after a tool error, since no such episode
succeeds), and training on the others moves the adapter there too, so it
answered broken output after tool errors and the gate held it back
(sft-s2 v0001: 10 of its 12 broken samples came after a tool error). The rows
below the threshold are samples of the policy that made them; their
log-likelihood at a small weight is a sampled KL to that policy on the states
they visit: it keeps the base's behaviour where nothing better is known,
without the negative gradient that collapses a small policy. Anchored only in
states no kept row shares, it leaves the states the rewarded rows cover to
them alone: anchored everywhere (`all`) it also pulls every covered state back
toward the failed calls.

What a state is. The turn shape alone (`uncovered`) is content-blind: on the
agent world's letters variant a letters question's first call has the shape of
every other first call, which rewarded rows of the other kinds cover, so the
kind no episode ever solved went unanchored and the adapter broke its format
there (85.1 % valid against 100 %, 11 of 11 broken samples after a user message,
the gate blocked two candidates 29 and 24 points better). `request` adds the
template of the conversation's first user message (per-request data folded as
the prompts stage folds system prompts, digits as data): a kind of request no
rewarded row answered is its own state. Nothing of any world enters: the
templates come from the rows.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightshift.schemas.prompt_template import infer, normalize, templated
from nightshift.settings import setting

from . import Algorithm, Prepared

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..examples import Example
    from ..plan import RunPlan

ANCHOR_ROWS = ("request", "uncovered", "all")


@dataclass
class SFTSettings:
    """Supervised fine-tuning on the best rows (rejection-sampling fine-tuning: the baseline)."""

    threshold: float = setting(0.5, help="train on rows with reward at least this")
    top_k: int = setting(0, help="with k > 0: only the k best of each group_id among those", bounds="[0, inf)")
    anchor_weight: float = setting(
        0.1, bounds="[0, 1]",
        help="weight of the rows left out (below the threshold) in the loss: a sampled KL to the policy that made "
             "them, which keeps its behaviour in states no rewarded row covers (after a tool error) instead of "
             "breaking the output format there; 0 trains on the rewarded rows alone")
    anchor_rows: str = setting(
        "request", choices=ANCHOR_ROWS,
        help="which left-out rows anchor: request (in states no kept row shares: the agent, its turns and tools "
             "so far, whether a tool errored, and the template of its first user message), uncovered (the same "
             "without the request: a kind of request no rewarded row answered stays unanchored when other kinds "
             "share its turns) or all (also pulls covered states toward the failed calls)")


def state(row: dict, errored: bool) -> tuple:
    """Where a call was made, coarsely: the agent, the conversation's shape (roles
    in order, tools already called) and whether a tool came back as an error
    before it. The content is left out on purpose: two questions of one kind are
    one state for what the policy should do next."""
    shape = tuple((m.get("role"), tuple(tc.get("name") for tc in m.get("tool_calls") or []))
                  for m in row.get("input_messages") or [])
    return (row.get("agent_name") or "", shape, errored)


_DIGITS = re.compile(r"\d+")


def _text(content) -> str:
    """A message's text, whether a string or a list of parts."""
    if isinstance(content, str):
        return content
    return " ".join(p.get("text") or "" for p in content or [] if isinstance(p, dict))


def requests(rows: list[dict]) -> list[str]:
    """Per row, the template of its conversation's first user message: per-request
    data folded (the known kinds of `schemas.prompt_template`, every digit run as
    data: "What is 3 + 4?" and "What is 2 + 7?" are one request; then the
    varying spans alignment finds across the agent's requests), so that requests
    of one kind share a key and a kind no rewarded row answered has its own. A
    free-text request that folds with no other is its own key: it anchors unless
    the same request was rewarded (the cautious side)."""
    norm = []
    for r in rows:
        first = next((m for m in r.get("input_messages") or [] if m.get("role") == "user"), None)
        norm.append(_DIGITS.sub("0", normalize(_text(first.get("content")) if first else "")[0]))
    by_agent: dict[str, Counter] = defaultdict(Counter)
    for r, n in zip(rows, norm):
        by_agent[r.get("agent_name") or ""][n] += 1
    templates = {a: infer(c) for a, c in by_agent.items()}
    return [templated(n, templates[r.get("agent_name") or ""]) for r, n in zip(rows, norm)]


def after_tool_error(rendered: list[Example]) -> list[bool]:
    """Per example, whether an earlier call of its trajectory carries the
    transform's `tool_error` flag (its tool call came back as an error)."""
    first: dict[str, int] = {}
    for e in rendered:
        if "tool_error" in (e.row.get("flags") or []):
            t, s = e.row["trajectory_id"], int(e.row.get("step") or 0)
            first[t] = min(first.get(t, s), s)
    return [e.row["trajectory_id"] in first and int(e.row.get("step") or 0) > first[e.row["trajectory_id"]]
            for e in rendered]


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    """Rejection sampling: the rows at or above the reward threshold (the `top_k` best
    per task group with top_k > 0), pre-tokenized with the same renderer `pg` uses;
    with `anchor_weight` > 0, the left-out rows of `anchor_rows` at that weight."""
    left: Counter = Counter()
    good = [e for e in rendered if e.row["reward"] is not None and e.row["reward"] >= cfg.sft.threshold]
    below = f"reward below sft.threshold ({cfg.sft.threshold})"
    out = {id(e): below for e in rendered}
    if cfg.sft.top_k > 0:
        groups: dict[str, list[Example]] = defaultdict(list)
        for e in good:
            groups[e.row.get("group_id") or e.row["trajectory_id"]].append(e)
        kept = []
        for g in groups.values():
            g.sort(key=lambda e: (-e.row["reward"], e.row["transition_id"]))
            kept += g[: cfg.sft.top_k]
            for e in g[cfg.sft.top_k:]:
                out[id(e)] = f"beyond the top {cfg.sft.top_k} of their group"
        good = kept
    for e in good:
        del out[id(e)]
    anchors = _anchors(cfg, rendered, good, set(out))
    for e in rendered:
        if id(e) in out and id(e) not in anchors:
            left[out[id(e)]] += 1
    rows = [{"input_ids": e.r.prompt_ids + e.r.completion_ids, "completion_start": len(e.r.prompt_ids)}
            for e in good]
    rows += [{"input_ids": e.r.prompt_ids + e.r.completion_ids, "completion_start": len(e.r.prompt_ids),
              "weight": cfg.sft.anchor_weight, "anchor": True}
             for e in rendered if id(e) in anchors]
    return rows, +left


def _anchors(cfg: TrainConfig, rendered: list[Example], good: list[Example], out: set[int]) -> set[int]:
    """The ids of the left-out examples that anchor."""
    if cfg.sft.anchor_weight <= 0:
        return set()
    if cfg.sft.anchor_rows == "all":
        return set(out)
    errored = after_tool_error(rendered)
    where = {id(e): state(e.row, err) for e, err in zip(rendered, errored)}
    if cfg.sft.anchor_rows == "request":
        asked = requests([e.row for e in rendered])
        where = {id(e): (*where[id(e)], a) for e, a in zip(rendered, asked)}
    covered = {where[id(e)] for e in good}
    return {i for i in out if where[i] not in covered}


def nll(logp, batch):
    """The negative log-likelihood of the completion tokens, each weighted by its
    row's `weight` (1, or `anchor_weight` for an anchor row), summed: the shared
    loop divides by the step's completion tokens, so the loss is the token mean
    over the whole optimizer step (what TRL's SFTTrainer computes), whatever the
    micro-batches and processes."""
    w = batch["weight"].to(logp.dtype)[batch["tok_seq"]]
    return -(logp * w).sum(), {"sft/nll": -logp.mean().item() if logp.numel() else 0.0}


def before_training(cfg: TrainConfig, plan: RunPlan, policy, tok, rows: list[dict], ref) -> Prepared:
    """How many rows anchored, for the summary and the manifest: the report should
    say how much of the night's loss was the anchor rather than the rewarded rows."""
    n = sum(1 for r in rows if r.get("anchor"))
    if not n:
        return Prepared(manifest={"sft_anchor_rows": 0})
    return Prepared(notes=[f"sft: {n:,} of {len(rows):,} example(s) anchor at weight {cfg.sft.anchor_weight:g} "
                           f"(below the threshold, {cfg.sft.anchor_rows}: a sampled KL to the policy that made them)"],
                    manifest={"sft_anchor_rows": n})


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from ..loop import Objective, make_trainer

    return make_trainer(cfg, plan, model, tok, rows, args, callbacks, Objective(nll, per="token"))


ALGORITHM = Algorithm(name="sft", settings=SFTSettings, order=2, examples=examples, trainer=make_trainer,
                      before_training=before_training)
