"""Which transition partitions a nightly build must redo, from what changed in its
inputs since the last build.

The build records what it read in `<data>/build/state.json` (beside the datasets,
not in one: a reader of `transitions/` must find only Parquet): each span date
partition's files with their sizes, the feedback files, and the settings that shape
the output. The next incremental build rebuilds only

- the dates whose span files changed (new, grown or removed: late spans included,
  however late), and the day before each, whose trajectories may cross midnight;
- the dates of the traces new feedback names;
- every date, when there is no state yet, the settings changed, or new feedback
  names only a conversation (finding its traces would mean reading every span).

A rerun with nothing new rebuilds nothing and leaves every file as it was.
Partitions keep the advantages of the pool they were built with: an incremental
build normalizes over the rows it rebuilds, as a `--since` window does.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict

import polars as pl
import pyarrow.parquet as pq

STATE = "build/state.json"
VERSION = 1

#: Settings that do not change a partition's rows: the window and the resources.
_NOT_SHAPING = ("data", "since", "until", "memory_budget", "storage_options", "incremental")


def settings_key(cfg) -> str:
    shaping = {k: v for k, v in asdict(cfg).items() if k not in _NOT_SHAPING}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load(fs, root: str) -> dict | None:
    path = f"{root}/{STATE}"
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "rb") as fh:
            state = json.loads(fh.read())
    except (OSError, ValueError):
        return None  # unreadable: a full build, which writes a good one
    return state if isinstance(state, dict) and state.get("version") == VERSION else None


def save(fs, root: str, state: dict) -> None:
    """Written after every partition is in place: a crash before leaves the old state,
    so the next build redoes this one's dates (idempotent), never skips them."""
    path = f"{root}/{STATE}"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = path + ".tmp"
    with fs.open(tmp, "wb") as fh:
        fh.write(json.dumps(state, sort_keys=True).encode())
    fs.mv(tmp, path)


def snapshot(span_files: dict[str, list[tuple[str, int]]], feedback_files: list[str], cfg) -> dict:
    """What this build read. Sizes are on disk: the collector writes a file once and
    never appends, so a new size means a new file under an old name."""
    return {"version": VERSION, "settings": settings_key(cfg),
            "spans": {d: sorted([name.rsplit("/", 1)[-1], size] for name, size in files)
                      for d, files in span_files.items()},
            "feedback": sorted(f.rsplit("/", 1)[-1] for f in feedback_files)}


def dates_to_build(fs, state: dict | None, now: dict, span_files: dict[str, list[tuple[str, int]]],
                   feedback_files: list[str]) -> tuple[set[str] | None, str]:
    """The output dates to rebuild (None: all of them) and why, in words for the log."""
    if state is None:
        return None, "no earlier build state: a full build"
    if state.get("settings") != now["settings"]:
        return None, "settings changed since the last build: a full build"
    old = state.get("spans", {})
    changed = {d for d in set(old) | set(now["spans"]) if old.get(d) != now["spans"].get(d)}
    dates = set(changed)
    for d in changed:
        dates.add((dt.date.fromisoformat(d) - dt.timedelta(days=1)).isoformat())
    seen = set(state.get("feedback", []))
    new_feedback = [f for f in feedback_files if f.rsplit("/", 1)[-1] not in seen]
    why = [f"{len(changed)} span partition(s) changed"]
    if new_feedback:
        fb = pl.concat([_column_table(fs, f, ["trace_id", "conversation_id"]) for f in new_feedback],
                       how="vertical_relaxed")
        if fb.filter(pl.col("trace_id").is_null() & pl.col("conversation_id").is_not_null()).height:
            return None, "new feedback names a conversation, not a trace: a full build"
        traces = fb["trace_id"].drop_nulls().unique()
        found = _dates_of(fs, span_files, traces)
        dates |= found
        why.append(f"{len(new_feedback)} new feedback file(s) touching {len(found)} date(s)")
    return dates & (set(span_files) | set(old)), ", ".join(why)


def _column_table(fs, path: str, columns: list[str]) -> pl.DataFrame:
    with fs.open(path, "rb") as fh:
        return pl.from_arrow(pq.read_table(fh, columns=columns))


def _dates_of(fs, span_files: dict[str, list[tuple[str, int]]], traces: pl.Series) -> set[str]:
    """The dates of the trajectories these traces belong to: the partitions holding
    their spans (and the day before, for one that started before midnight). One
    column read per file."""
    out: set[str] = set()
    if traces.len() == 0:
        return out
    want = traces.implode()
    for d, files in span_files.items():
        for name, _ in files:
            try:
                ids = _column_table(fs, name, ["trace_id"])["trace_id"]
            except (OSError, ValueError):  # an unreadable file: the build names it
                continue
            if ids.is_in(want).any():
                out.add(d)
                out.add((dt.date.fromisoformat(d) - dt.timedelta(days=1)).isoformat())
                break
    return out
