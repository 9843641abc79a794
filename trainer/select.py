"""Which transitions a run trains on: the transitions dataset scanned lazily
(Polars over a pyarrow dataset, so any fsspec store works and date partitions
are pruned before a byte is read), checked against the columns the trainer
needs, filtered, and every row left out counted by reason.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field

import fsspec
import polars as pl
import pyarrow.dataset as pads

from nightshift.schemas import layout, transitions

from . import algorithms
from .config import TrainConfig


class TrainDataError(ValueError):
    """The data cannot be trained on: said plainly, before any model is loaded."""


READER = "nightshift train"
#: Columns every algorithm reads; a dataset without them is refused by name (`layout.check`).
REQUIRED = layout.needs(transitions.NAME, READER)
#: Read when present; filled with a default when a dataset lacks them.
OPTIONAL = {
    "group_id": pl.Utf8,
    "tools": pl.Utf8,
    "weight": pl.Float64,
    "advantage": pl.Float64,
    "agent_name": pl.Utf8,
    "model": pl.Utf8,
    "request_model": pl.Utf8,
    "step": pl.Int32,
    "start_time": pl.Datetime("ns", "UTC"),
    "prompt_token_ids": pl.List(pl.Int32),
    "completion_token_ids": pl.List(pl.Int32),
    "completion_logprobs": pl.List(pl.Float32),
    "policy_version": pl.Utf8,
    "temperature": pl.Float64,
    "prompt_seen": pl.Utf8,
    "flags": pl.List(pl.Utf8),  # sft: which calls came after a tool error (trainer/algorithms/sft.py)
    "finish_reason": pl.Utf8,
}


#: Columns besides id, reward and advantage that make a row's content.
HASHED = ("weight", "input_messages", "output_message", "tools", "prompt_token_ids", "completion_token_ids",
          "completion_logprobs", "policy_version", "temperature")


@dataclass
class Selection:
    rows: list[dict]
    scanned: int = 0  # rows in the date window
    excluded: Counter = field(default_factory=Counter)
    since: str = ""
    until: str = ""

    def content_hash(self) -> str:
        """Identifies what was trained on: each row's id, reward, advantage, weight,
        messages, tools and logged tokens (a rebuild that changed any of them is
        other data, and resumes nothing)."""
        h = hashlib.sha256()
        for r in sorted(self.rows, key=lambda r: r["transition_id"]):
            content = [r.get(k) for k in HASHED]
            h.update(f"{r['transition_id']}|{r['reward']!r}|{r.get('advantage')!r}|".encode())
            h.update(json.dumps(content, sort_keys=True, default=repr).encode())
            h.update(b"\n")
        return h.hexdigest()


def _files(cfg: TrainConfig) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    fs, root = fsspec.core.url_to_fs(cfg.data, **cfg.storage_options)
    base = layout.folder(root, transitions.NAME)
    if not fs.exists(base):
        raise TrainDataError(f"no transitions dataset at {layout.folder(cfg.data, transitions.NAME)}: "
                             "run `nightshift build` first")
    files = []
    for path in sorted(fs.glob(layout.files(root, transitions.NAME))):
        day = layout.date_of(path)
        if day and cfg.select.since and day < cfg.select.since:
            continue
        if day and cfg.select.until and day > cfg.select.until:
            continue
        files.append(path)
    return fs, files


def scan(cfg: TrainConfig) -> pl.LazyFrame:
    """The transitions in the date window, lazily, with every column the trainer
    reads present (optional ones filled), or a `TrainDataError` naming what is
    missing."""
    fs, files = _files(cfg)
    window = f" between {cfg.select.since or 'the start'} and {cfg.select.until or 'the end'}" if (cfg.select.since or cfg.select.until) else ""
    if not files:
        raise TrainDataError(f"no transitions files under {cfg.data}{window}: nothing to train on")
    # every file's version and columns (one footer each), not the first file's alone
    layout.check_files(fs, files, transitions.NAME, READER,
                       also=("advantage",) if algorithms.get(cfg.algorithm).needs_advantage else ())
    dataset = pads.dataset(files, filesystem=fs, format="parquet")
    names = set(dataset.schema.names)
    lf = pl.scan_pyarrow_dataset(dataset)
    fill = [pl.lit(None, dtype).alias(c) for c, dtype in OPTIONAL.items() if c not in names]
    if "weight" not in names:
        fill = [e for e in fill if e.meta.output_name() != "weight"] + [pl.lit(1.0).alias("weight")]
    return lf.with_columns(fill) if fill else lf


_REGEX_CHARS = set("|*+?()[]{}^$\\")


def agent_names(spec: str | list[str]) -> list[str] | None:
    """The exact agent names `spec` selects (`writer,rewriter`, or a list), or None
    when it is a regex (`writer|rewr.*`): a name is never matched by a substring,
    so `writer` does not select `rewriter`."""
    if isinstance(spec, list):
        return [str(a).strip() for a in spec if str(a).strip()]
    if any(c in _REGEX_CHARS for c in spec.replace(".", "")) or spec.startswith("re:"):
        return None
    return [a.strip() for a in spec.split(",") if a.strip()]


def agent_filter(spec: str | list[str]) -> pl.Expr:
    """Rows whose `agent_name` is one of the names, or matches the whole regex."""
    names = agent_names(spec)
    if names is not None:
        return pl.col("agent_name").is_in(names)
    pattern = spec[3:] if isinstance(spec, str) and spec.startswith("re:") else spec
    return pl.col("agent_name").fill_null("").str.contains(f"^(?:{pattern})$")


def _count(lf: pl.LazyFrame) -> int:
    return lf.select(pl.len()).collect().item()


def select(cfg: TrainConfig) -> Selection:
    """Rows to train on, and every row left out counted by why."""
    lf = scan(cfg)
    sel = cfg.select
    excluded: Counter = Counter()
    scanned = n = _count(lf)
    if sel.agents:
        lf = lf.filter(agent_filter(sel.agents))
        excluded["agent not selected"], n = n - (m := _count(lf)), m
    if sel.models:
        # what the agent asked for, or (older datasets, or no request recorded) `model`
        lf = lf.filter(pl.col("request_model").is_in(sel.models) | pl.col("model").is_in(sel.models))
        excluded["model not selected"], n = n - (m := _count(lf)), m
    if sel.max_rows and n > sel.max_rows:
        order = ["start_time", "transition_id"] if "start_time" in lf.collect_schema().names() else ["transition_id"]
        lf = lf.sort(order).tail(sel.max_rows)
        excluded["over select.max_rows (oldest left out)"] = n - sel.max_rows
    df = lf.select(["transition_id", "trajectory_id", "input_messages", "output_message", "reward", *OPTIONAL]).collect()
    rows = []
    for r in df.iter_rows(named=True):
        seen = sel.seen_prompts.get(r.get("prompt_seen") or "")
        if seen:
            r["input_messages"], r["prompt_seen"] = with_system(r["input_messages"], seen), None
        reason = _unusable(r, cfg)
        if reason:
            excluded[reason] += 1
            continue
        if r["weight"] is None or not math.isfinite(r["weight"]) or r["weight"] < 0:
            r["weight"] = 1.0
        rows.append(r)
    return Selection(rows=rows, scanned=scanned, excluded=+excluded, since=sel.since, until=sel.until)


def with_system(messages: list[dict] | None, system: str | list[str]) -> list[dict] | None:
    """`messages` as the model saw them when a route put `system` in front of it: the
    leading system messages replaced (issue 27). Without this the row is left out,
    and an adapter trained after a prompt's promotion learns only from conversations
    under the agent's own prompt, then serves under the promoted one."""
    if not messages:
        return messages
    texts = [system] if isinstance(system, str) else list(system)
    n = next((i for i, m in enumerate(messages) if (m or {}).get("role") != "system"), len(messages))
    like = messages[0] if n else {"role": "system"}
    return [{**like, "role": "system", "content": t} for t in texts] + list(messages[n:])


def _unusable(r: dict, cfg: TrainConfig) -> str:
    """Why a row cannot be trained on, or "" when it can."""
    reward = r["reward"]
    needs_advantage = algorithms.get(cfg.algorithm).needs_advantage
    if reward is None:
        if cfg.select.require_reward or not needs_advantage:
            return "no reward"
    elif not math.isfinite(reward):
        return "reward not finite (NaN or infinite)"
    if needs_advantage:
        adv = r["advantage"]
        if adv is None:
            return "no advantage (a call the credit strategy left uncredited)"
        if not math.isfinite(adv):
            return "advantage not finite (NaN or infinite)"
    out = r["output_message"]
    if out is None or (not out.get("content") and not out.get("tool_calls")):
        return "no output message (content not captured)"
    if r.get("finish_reason") == "error":
        # The GenAI conventions keep a failed call's partial output (a stream cut off by
        # a timeout or a dropped connection) with finish reason `error`: half an answer,
        # not one the model would give, however the trajectory ended.
        return "the call failed part way (finish_reason error): its output is what came before the failure"
    if "history_incomplete" in (r.get("flags") or []):
        return ("history_incomplete: it continued a stored response the build did not find (its state lacks the "
                "turns the provider put back)")
    if r.get("prompt_seen"):
        # The route put a candidate system prompt in front of the model (issue 27): the
        # answer was written to that prompt, the row's input_messages hold the agent's.
        # Trained on as recorded, the model would learn the answer to a state it never had.
        return "answered under a route's prompt trial (prompt_seen): its recorded prompt is not what the model saw"
    return ""


def held_out(trajectory_id: str, fraction: float) -> bool:
    """Whether a trajectory is in the evaluation split: a stable hash, so every call
    of a trajectory lands on the same side and reruns split the same way."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(trajectory_id.encode(), digest_size=8).digest(), "big")
    return (h / 2**64) < fraction
