"""The last hours of what the collector stored: the spans of every trace that
received a span in the window (whole, from the dates read), their GenAI log events,
and every feedback label. What `nightshift doctor` looks at.

A file that cannot be read (a torn copy, a foreign file) is named and left out,
never a traceback: the doctor is what a user runs when something is wrong.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nightshift.schemas import layout

SPAN_COLUMNS = ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_time", "end_time", "received_time",
                "service_name", "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_agent_name",
                "gen_ai_conversation_id", "scope_name", "scope_version", "attributes", "events", "links",
                "dropped_attributes_count")
LOG_COLUMNS = ("record_id", "time", "observed_time", "event_name", "body", "attributes", "trace_id", "span_id")
FEEDBACK_COLUMNS = ("feedback_id", "trace_id", "conversation_id", "span_id", "name", "value", "received_time")


@dataclass
class Window:
    spans: pl.DataFrame
    logs: pl.DataFrame
    feedback: pl.DataFrame
    dates: list[str] = field(default_factory=list)  # the date partitions read
    unreadable: list[str] = field(default_factory=list)  # files left out, each with why
    traces: int = 0  # traces in the window (more than `spans` holds when sampled)


def _dates(fs, base: str, first: dt.date | None) -> dict[str, list[str]]:
    """date -> Parquet files of a dataset, from `first` on (None: every date)."""
    out: dict[str, list[str]] = {}
    if not fs.exists(base):
        return out
    for entry in sorted(fs.ls(base, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        date = layout.partition_date(name)
        if entry["type"] != "directory" or date is None:
            continue
        try:
            day = dt.date.fromisoformat(date)
        except ValueError:
            continue  # not a partition the collector wrote
        if first and day < first:
            continue
        files = sorted(f["name"] for f in fs.ls(entry["name"], detail=True)
                       if f["type"] == "file" and f["name"].endswith(layout.SUFFIX))
        if files:
            out[date] = files
    return out


def _read(fs, paths: list[str], columns: tuple[str, ...], bad: list[str], traces: pa.Array | None = None) -> pl.DataFrame:
    """The columns of `paths`, only the rows of `traces` when given (read a row group
    at a time, so memory follows what is kept, not the files' size)."""
    tables = []
    for path in paths:
        try:
            with fs.open(path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                names = set(pf.schema_arrow.names)
                cols = [c for c in columns if c in names]
                for g in range(pf.num_row_groups):
                    if traces is None:
                        tables.append(pf.read_row_group(g, columns=cols))
                        continue
                    keep = pc.is_in(pf.read_row_group(g, columns=["trace_id"]).column("trace_id"), value_set=traces)
                    if pc.any(keep).as_py():
                        tables.append(pf.read_row_group(g, columns=cols).filter(keep))
        except (pa.ArrowException, OSError) as e:
            if not any(b.startswith(f"{path}: ") for b in bad):  # once, whichever pass found it
                bad.append(f"{path}: not a readable Parquet file ({e})")
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return pl.DataFrame()
    return pl.from_arrow(pa.concat_tables(tables, promote_options="default")).rechunk()


def read(data: str, hours: float, now_ns: int, storage_options: dict | None = None,
         max_traces: int = 0) -> Window:
    """The window ending at `now_ns`, `hours` long (0: everything stored). With
    `max_traces`, a random sample of that many of its traces (the same sample for the
    same data): a diagnosis needs proportions, not a day of prompts in memory."""
    fs, root = fsspec.core.url_to_fs(data, **(storage_options or {}))
    root = root.rstrip("/")
    cutoff_ns = now_ns - int(hours * 3600e9) if hours > 0 else None
    # a trace may have started the day before its last span arrived
    first = (dt.datetime.fromtimestamp(cutoff_ns / 1e9, dt.timezone.utc).date() - dt.timedelta(days=1)
             if cutoff_ns is not None else None)
    bad: list[str] = []
    by_date = _dates(fs, layout.folder(root, layout.SPANS), first)
    paths = [p for ps in by_date.values() for p in ps]
    # first pass: two small columns, to choose the traces
    ids = _read(fs, paths, ("trace_id", "received_time"), bad)
    window = Window(pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), sorted(by_date), bad)
    if ids.height:
        if cutoff_ns is not None:
            ids = ids.filter(pl.col("received_time").cast(pl.Int64) >= cutoff_ns)
        chosen = ids["trace_id"].unique().sort()
        window.traces = chosen.len()
        if max_traces and chosen.len() > max_traces:
            chosen = chosen.sample(max_traces, seed=0).sort()
        if chosen.len():
            spans = _read(fs, paths, SPAN_COLUMNS, bad, chosen.to_arrow())
            window.spans = spans.unique(["trace_id", "span_id"], keep="first", maintain_order=True)
    if window.spans.height:
        log_dates = _dates(fs, layout.folder(root, layout.LOGS), first)
        window.logs = _read(fs, [p for ps in log_dates.values() for p in ps], LOG_COLUMNS, bad,
                            window.spans["trace_id"].unique().to_arrow())
    fb_dates = _dates(fs, layout.folder(root, layout.FEEDBACK), None)
    feedback = _read(fs, [p for ps in fb_dates.values() for p in ps], FEEDBACK_COLUMNS, bad)
    if feedback.height:
        window.feedback = feedback.unique("feedback_id", keep="first", maintain_order=True).with_columns(
            pl.col("received_time").cast(pl.Int64))  # nanoseconds, as the build reads it
    return window
