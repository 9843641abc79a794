"""`nightshift build`: spans (+ GenAI log events, + feedback) -> transitions.

receiver -> log -> spans/ ──▶ read (by trace bucket) -> calls -> trajectories ->
rewards -> credit -> advantages -> transitions/ (one partition per date, replaced
whole).

Spans are read in buckets of traces (a hash of the trace id), so memory is bounded
by `memory_budget`, not by the window: with more data than the budget, a first pass
splits the window's spans into bucket files, and each bucket holds whole traces.
Where the traces lie together in the files, as a collector writes them, a build in
one process reads its buckets straight from the files in order instead (`stream`).
"""

from __future__ import annotations

import datetime as dt
import errno
import hashlib
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Iterable, Iterator

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nightshift.schemas import layout, prompt_ids, transitions
from nightshift.schemas import spans as spans_schema

from . import attrs as A
from . import calls as C
from . import attribution, chains, columnar, credit, distributed, incremental, normalize, output, pool, spill
from . import stream as stream_
from .config import TransformConfig
from .rewards import Observation, Trajectory, call_function, from_span, load_function, outcome

log = logging.getLogger("nightshift.transform")

READER = "nightshift build"
#: What the build reads of each span: the columns it needs (`layout.check` names any a
#: file lacks), then those it goes without (events, links, schema URLs).
SPAN_COLUMNS = [*layout.needs(layout.SPANS, READER), *spans_schema.OPTIONAL[READER]]
#: Peak process bytes per uncompressed byte of the span columns read: the Arrow
#: columns, the calls' attributes as Python objects, and the rows built from them.
OVERHEAD = 8.0  # measured: 200k Agent Lightning spans, peak RSS / bucket size


class BuildError(RuntimeError):
    """Nothing to build from, or settings that cannot work (a clear message)."""


@dataclass
class Summary:
    spans: int = 0
    trajectories: int = 0
    transitions: int = 0
    waiting: int = 0  # not settled yet: built by a later run
    outside_window: int = 0
    unrated: int = 0
    rewards_by_source: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    reward_errors: int = 0  # user reward functions that raised
    bad_rewards: int = 0  # reward values that were not finite numbers
    dropped_by_agent: int = 0
    duplicates: int = 0
    no_request: int = 0
    flagged: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    content_missing: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    partitions: list[str] = field(default_factory=list)
    #: instrumentation scope -> [calls, calls in a layout no reader knows (left out), an example span id]
    by_instrumentation: dict[str, list] = field(default_factory=dict)
    buckets: int = 1
    #: traces bucketed with others (`chains`): [traces, groups]
    grouped: list = field(default_factory=lambda: [0, 0])
    seconds: float = 0.0
    #: span files or row groups that could not be read, each named with why (the rest was built)
    unreadable: list[str] = field(default_factory=list)
    incremental: str = ""  # what an incremental build found changed
    #: partitions kept by an incremental build whose advantages the new rows moved (rewritten)
    repooled: list[str] = field(default_factory=list)
    #: token-id values that are not a list of integers: [count, an example span id] (the row keeps null ids)
    bad_token_ids: list = field(default_factory=lambda: [0, ""])
    #: calls read by the Python reader instead of the expressions, by why (rare layouts)
    python_reader: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: Ray worker process -> its peak RSS in bytes (engine ray)
    workers: dict[str, int] = field(default_factory=dict)
    #: Ray worker process -> CPU-seconds of the tasks it ran (engine ray); the driver's own CPU-seconds
    worker_cpu: dict[str, float] = field(default_factory=dict)
    driver_cpu: float = 0.0
    #: seconds of the build's phases (split, buckets, advantages, partitions), and of every bucket's own work summed
    phases: dict[str, float] = field(default_factory=dict)
    bucket_seconds: float = 0.0
    #: each Ray round's idle worker-seconds (`distributed.Engine.idle`), by the round's function
    ray_idle: list[tuple[str, float]] = field(default_factory=list)

    def add(self, other: "Summary") -> None:
        """Add what one bucket found, as if this build had gone on to build it: buckets
        added in order give the counts and examples of one process building them all."""
        for name in ("spans", "trajectories", "waiting", "outside_window", "unrated", "reward_errors"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.dropped_by_agent += other.dropped_by_agent
        for mine, theirs in ((self.rewards_by_source, other.rewards_by_source), (self.flagged, other.flagged),
                             (self.content_missing, other.content_missing), (self.python_reader, other.python_reader)):
            for k, v in theirs.items():
                mine[k] += v
        self.unreadable += other.unreadable
        self.bad_token_ids[0] += other.bad_token_ids[0]
        self.bad_token_ids[1] = self.bad_token_ids[1] or other.bad_token_ids[1]
        self.bucket_seconds += other.bucket_seconds

    def lines(self) -> list[str]:
        out = [
            f"transitions: {self.transitions} rows from {self.trajectories} trajectories "
            f"({self.spans} spans, {self.seconds:.1f} s, {self.buckets} bucket(s))",
            f"partitions written: {', '.join(self.partitions) or 'none'}",
        ]
        if self.grouped[0]:
            out.append(f"traces bucketed with the traces they continue or share a trajectory with: {self.grouped[0]} "
                       f"in {self.grouped[1]} group(s)")
        if self.incremental:
            out.append(f"incremental: {self.incremental}")
        if self.repooled:
            shown = ", ".join(self.repooled[:5]) + (", ..." if len(self.repooled) > 5 else "")
            out.append(f"advantages moved by the new rows: rewritten in {len(self.repooled)} kept partition(s) ({shown})")
        if self.rewards_by_source:
            out.append("rewards by source: " + ", ".join(f"{k} {v}" for k, v in sorted(self.rewards_by_source.items())))
        out.append(f"trajectories without a reward: {self.unrated}")
        if self.waiting:
            out.append(f"trajectories waiting to settle (next run): {self.waiting}")
        if self.outside_window:
            out.append(f"trajectories starting outside --since/--until: {self.outside_window}")
        if self.dropped_by_agent:
            out.append(f"rows left out by agent selection: {self.dropped_by_agent}")
        if self.duplicates:
            out.append(f"spans recording a call already seen (double instrumentation): {self.duplicates}")
        if self.no_request:
            out.append(f"LLM-kind spans that sent no request (left out): {self.no_request}")
        if self.bad_rewards:
            out.append(f"reward values ignored (not finite numbers): {self.bad_rewards}")
        if self.reward_errors:
            out.append(f"trajectories whose reward function raised: {self.reward_errors}")
        if self.by_instrumentation:
            out.append("calls by instrumentation: " + ", ".join(
                f"{k} {v[0]}" for k, v in sorted(self.by_instrumentation.items(), key=lambda kv: -kv[1][0])))
        for k, (n, bad, example) in sorted(self.by_instrumentation.items()):
            if bad:
                out.append(f"calls left out, their layout unknown ({k}): {bad} of {n}, e.g. span {example}; "
                           "a new release of that instrumentation? please report it with the span")
        for what in self.unreadable[:20]:
            out.append(f"UNREADABLE span data, skipped: {what}")
        if len(self.unreadable) > 20:
            out.append(f"... and {len(self.unreadable) - 20} more unreadable files or row groups")
        if self.bad_token_ids[0]:
            out.append(f"token ids that are not a list of integers (left null): {self.bad_token_ids[0]}, "
                       f"e.g. span {self.bad_token_ids[1]}")
        if self.python_reader:
            out.append(f"calls read by the Python reader: {sum(self.python_reader.values())} ("
                       + ", ".join(f"{k} {v}" for k, v in sorted(self.python_reader.items(), key=lambda kv: -kv[1]))
                       + ")")
        if self.phases:  # what one more worker can shorten (buckets) and what it cannot (the rest)
            out.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.phases.items())
                       + f" (the buckets' own work: {self.bucket_seconds:.1f} s; the driver's CPU: "
                       f"{self.driver_cpu:.1f} s)")
        if self.workers:
            out.append(f"ray: {self.buckets} bucket(s) on {len(self.workers)} worker process(es), peak RSS "
                       + ", ".join(f"{v / 2**20:.0f} MiB" for _, v in sorted(self.workers.items()))
                       + "; tasks' CPU " + ", ".join(f"{self.worker_cpu.get(k, 0.0):.1f} s"
                                                     for k in sorted(self.workers)))
        if self.ray_idle:  # a round's tail, a worker's imports, a late process: what CPU-seconds do not show
            out.append("ray idle worker-seconds by round: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.ray_idle))
        for flag, n in sorted(self.flagged.items()):
            out.append(f"rows flagged {flag}: {n}" + _FLAG_HINTS.get(flag, ""))
        for conv, n in sorted(self.content_missing.items()):
            out.append(f"rows without content ({conv}): {n}; capture was off, turn it on with {C.CAPTURE_HINTS.get(conv, C.CAPTURE_HINTS['unknown'])}")
        return out


#: What a user can do about a flag the summary counts, where there is something.
_FLAG_HINTS = {
    "history_incomplete": ("; each continued a stored response (gen_ai.request.previous_response.id) or a "
                           "conversation (a delta opening with an answer) that the build did not find on its day: "
                           "made outside the lake, or before midnight UTC (a history is carried within a day, "
                           "as an incremental build redoes days), so the trainer leaves it out"),
}


def _linked_components(df: pl.DataFrame) -> dict[str, str]:
    """Trace -> the first trace (by id) of the traces its spans' links connect it to:
    AutoGen's runtime starts a trace per message delivered and links it to the span
    that sent it, so one team run is one component."""
    if "links" not in df.columns:
        return {}
    pairs = (df.select("trace_id", "links").filter(pl.col("links").list.len() > 0).explode("links")
             .select("trace_id", pl.col("links").struct.field("trace_id").alias("other"))
             .filter(pl.col("other").is_not_null() & (pl.col("other") != pl.col("trace_id"))).unique())
    return chains.components(pairs.iter_rows())


def _day(value: str, what: str) -> dt.date | None:
    if not value:
        return None
    try:
        return dt.date.fromisoformat(value[:10])
    except ValueError:
        raise BuildError(f"{what} must be a date YYYY-MM-DD, got {value!r}") from None


def _listing(fs, base: str, since: dt.date | None = None, until: dt.date | None = None) -> dict[str, dict[str, str]]:
    """A dataset's Parquet files by date partition (date -> name -> stamp), within
    [since, until + 1 day] (the extra day finishes trajectories that cross midnight):
    a listing, no file opened (an incremental build looks at every date, and builds
    few)."""
    out: dict[str, dict[str, str]] = {}
    if not fs.exists(base):
        return out
    for entry in sorted(fs.ls(base, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        date = layout.partition_date(name)
        if entry["type"] != "directory" or date is None:
            continue
        day = _day(date, "partition")
        if (since and day < since) or (until and day > until + dt.timedelta(days=1)):
            continue
        files = {f["name"].rsplit("/", 1)[-1]: incremental.stamp(f) for f in fs.ls(entry["name"], detail=True)
                 if f["type"] == "file" and f["name"].endswith(layout.SUFFIX)}
        if files:
            out[date] = dict(sorted(files.items()))
    return out


def _partitions(fs, out_root: str) -> dict[str, str]:
    """Each transitions partition's stamp: what a build wrote, to tell a hand's change."""
    return {d: " ".join(f"{n}:{st}" for n, st in files.items()) for d, files in _listing(fs, out_root).items()}


def _feedback_files(fs, root: str) -> dict[str, str]:
    """Feedback files ("date=YYYY-MM-DD/name" -> stamp)."""
    return {f"{layout.partition(d)}/{n}": st for d, files in _listing(fs, layout.folder(root, layout.FEEDBACK)).items()
            for n, st in files.items()}


def _uncompressed_md(md: pq.FileMetaData, group: int | None = None) -> int:
    """Bytes the columns the build reads take once decompressed (Parquet's own
    count), of the whole file or of one row group: what sizes the buckets and the
    split's runs. Compressed sizes say little: prompts and token ids compress five
    to ten times."""
    wanted = set(SPAN_COLUMNS)
    total = 0
    for g in range(md.num_row_groups) if group is None else (group,):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.split(".", 1)[0] in wanted:
                total += col.total_uncompressed_size
    return total


@dataclass
class _Source:
    """A span file the build reads, the date partition it is in (for the next
    incremental build: where each trajectory's spans are), and, for a date read only
    to complete the trajectories of others, the traces to keep from it."""

    path: str
    date: str
    only: pl.Series | None = None
    groups: tuple[int, int] | None = None  # row groups [first, last) of the file, when split tasks share it (_cut)


def _row_groups(fs, src: _Source, columns: list[str], bad: list[str], dataset: str = layout.SPANS) -> Iterator[pa.Table]:
    """A Parquet file's row groups, one at a time, each with its `_pdate`. One that
    cannot be read (a corrupt page, a file cut short) is reported by file and row
    group and skipped; the file's other row groups are still read."""
    return (t for _, t in _numbered_groups(fs, src, columns, bad, dataset))


def _numbered_groups(fs, src: _Source, columns: list[str], bad: list[str],
                     dataset: str = layout.SPANS) -> Iterator[tuple[int, pa.Table]]:
    """`_row_groups`, each with its number in the file (a stream's buckets take them by it)."""
    path = src.path
    try:
        fh = fs.open(path, "rb")
        pf = pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as e:
        bad.append(f"{path}: not a readable Parquet file, skipped whole ({e})")
        return
    only = None if src.only is None else src.only.to_arrow()
    with fh:
        schema = pf.schema_arrow  # a property that converts the whole nested schema each time
        # a newer version, or a column the build needs gone: one sentence (exit 2), not a skip, not a traceback
        layout.check(layout.shown(fs, path), schema, dataset, READER)
        names = set(schema.names)
        cols = [c for c in columns if c in names]
        for g in range(*(src.groups or (0, pf.num_row_groups))):
            try:
                if only is not None:  # most row groups of a date read for a few traces hold none of them
                    keep = pc.is_in(pf.read_row_group(g, columns=["trace_id"]).column("trace_id"), value_set=only)
                    if not pc.any(keep).as_py():
                        continue
                t = pf.read_row_group(g, columns=cols)
                if only is not None:
                    t = t.filter(keep)
            except (pa.ArrowException, OSError) as e:
                n = pf.metadata.row_group(g).num_rows
                bad.append(f"{path}: row group {g + 1} of {pf.num_row_groups} unreadable, its {n} rows skipped ({e})")
                continue
            yield g, t.append_column("_pdate", pa.array([src.date] * t.num_rows, pa.string()))


def _read(fs, sources: list[_Source], columns: list[str], bad: list[str] | None = None,
          dataset: str = layout.SPANS) -> pl.DataFrame:
    bad = [] if bad is None else bad
    tables = [t for src in sources for t in _row_groups(fs, src, columns, bad, dataset)]
    if not tables:
        return pl.DataFrame()
    return pl.from_arrow(pa.concat_tables(tables, promote_options="default"))


def _bucket_of(trace: pl.Expr, buckets: int, groups: dict[str, str] | None = None) -> pl.Expr:
    """A trace's bucket: of its group's first trace where it has one (`chains`)."""
    return (chains.bucket_key(trace, groups).hash(seed=7) % buckets).cast(pl.Int64)


def _split(fs, files: list[_Source], buckets: int, tmp: str, batch_bytes: int, bad: list[str],
           tag: str = "", columns: list[str] | None = None, dataset: str = layout.SPANS,
           groups: dict[str, str] | None = None) -> list[str]:
    """First pass when the window exceeds the budget: each span file's rows go to
    the bucket file of their trace (only the columns the build reads), read in
    batches of about `batch_bytes` decompressed, so this pass is bounded too.

    Row groups are cut together, about two batches' worth at a time: each piece
    written costs about 0.7 ms of lz4 frames whatever its size (a span has some sixty
    buffers), and a window of 10M spans in 669 buckets cut one row group at a time
    wrote pieces of fifteen rows, most of the split's time."""
    _enough_files(buckets + 64)
    writers: dict[int, pa.ipc.RecordBatchFileWriter] = {}
    schemas: dict[int, pa.Schema] = {}
    paths = [os.path.join(tmp, f"bucket-{b:04d}{tag}.arrow") for b in range(buckets)]

    def cut(held: list[pa.Table]) -> None:
        pieces: dict[int, list[pa.Table]] = defaultdict(list)
        while held:  # each group let go once taken: its copy in bucket order is what is held
            table = held.pop(0)
            # one take into bucket order, then zero-copy slices: the rows stay
            # in Arrow (a round trip through Polars copied every prompt twice)
            b = pl.from_arrow(table.column("trace_id")).to_frame("t").select(_bucket_of(pl.col("t"), buckets, groups))
            order = b.with_row_index("i").sort("t", maintain_order=True)
            counts = order.group_by("t", maintain_order=True).len()
            table = table.take(order["i"].to_arrow())
            at = 0
            for bucket, n in counts.iter_rows():
                pieces[bucket].append(table.slice(at, n))
                at += n
        for bucket, parts in pieces.items():  # each bucket's rows of these groups as one batch, in their order
            t = parts[0] if len(parts) == 1 else pa.concat_tables(parts).combine_chunks()
            if bucket not in writers:  # Arrow IPC: scratch read once, whole; no Parquet encoding to pay
                writers[bucket] = pa.ipc.new_file(paths[bucket], t.schema,
                                                  options=pa.ipc.IpcWriteOptions(compression="lz4"))
                schemas[bucket] = t.schema
            writers[bucket].write_table(t if t.schema.equals(schemas[bucket]) else t.cast(schemas[bucket]))

    try:
        held: list[pa.Table] = []
        size = 0
        for src in files:
            for group in _row_groups(fs, src, columns or SPAN_COLUMNS, bad, dataset):
                if held and (size + group.nbytes > 2 * batch_bytes or not group.schema.equals(held[0].schema)):
                    cut(held)
                    held, size = [], 0
                held.append(group)
                size += group.nbytes
        if held:
            cut(held)
        del held
    finally:
        for w in writers.values():
            w.close()
    _give_back_memory()
    return [p if os.path.exists(p) else "" for p in paths]


def _give_back_memory() -> None:
    """Return freed memory to the system between buckets. Prompts are Python strings
    from the C allocator, and Arrow keeps its own pool: both hold on to freed pages,
    so without this the process keeps the high-water mark of every bucket it read."""
    pa.default_memory_pool().release_unused()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def _enough_files(n: int) -> None:
    """One scratch file per bucket is open during the split: raise the soft limit on
    open files (often 1024) toward the hard one when a big window needs more."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < n:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the open fails clearly later
        pass


def _streamed(fs, reads: list[_Source], logs: list[_Source], sizes: dict[str, list[int] | None], buckets: int,
              engine: distributed.Engine, cfg: TransformConfig, groups: dict[str, str]) -> stream_.Stream | None:
    """The buckets as a stream of the span files (`stream`), where one can be: a build
    in this process (Ray's tasks each read their own bucket), the bucket count the
    budget's (a count asked for keeps the split's buckets and their rows' order), no
    log events to split beside the spans, and every span file read whole."""
    if (buckets < 2 or engine.remote or cfg.build.buckets or logs
            or any(src.only is not None or src.groups is not None for src in reads)):
        return None
    got = stream_.plan(fs, [src.path for src in reads], sizes, buckets, groups)
    if got is None:
        return None
    return stream_.Stream(got, reads, lambda src, bad: _numbered_groups(fs, src, SPAN_COLUMNS, bad))


def _read_bucket(paths: list[str], consume: bool = False) -> pl.DataFrame:
    """A bucket's pieces (one per run of files split), in the runs' order; with
    `consume`, each removed once read.

    One piece (a build in one process) is read by Polars' own IPC reader, from the
    file's bytes (not mapped: the file goes once read): pyarrow's reader and then
    `from_arrow`, chunk by chunk, cost twice the CPU on the fifty small batches a
    bucket of the 1M benchmark holds (1.08-1.18 -> 0.58-0.66 CPU-s for thirty
    buckets, less RSS). Pieces of several runs (Ray) are concatenated by pyarrow,
    which fills a column a run lacks with nulls."""
    if len(paths) == 1:
        with open(paths[0], "rb") as fh:
            df = pl.read_ipc(fh.read())
        if consume:
            os.remove(paths[0])
        return df.rechunk()
    tables = []
    for path in paths:
        with pa.ipc.open_file(path) as f:
            tables.append(f.read_all())
        if consume:
            os.remove(path)
    # one chunk: the split wrote many small batches
    return pl.from_arrow(pa.concat_tables(tables, promote_options="default")).rechunk()


def _feedback(fs, root: str, files: dict[str, str]) -> pl.DataFrame:
    """Every feedback row, with the file it is in (`_file`): an incremental build
    remembers which dates each file named, to rebuild them when the file goes."""
    cols = list(layout.needs(layout.FEEDBACK, READER))
    frames = []
    for name in sorted(files):
        df = _read(fs, [_Source(f"{layout.folder(root, layout.FEEDBACK)}/{name}", "")], cols, dataset=layout.FEEDBACK)
        if df.height:
            frames.append(df.drop("_pdate").with_columns(pl.lit(name).alias("_file")))
    if not frames:
        return pl.DataFrame(schema={"feedback_id": pl.String, "trace_id": pl.String, "conversation_id": pl.String,
                                    "span_id": pl.String, "name": pl.String, "value": pl.Float64,
                                    "received_time": pl.Int64, "_file": pl.String})
    return pl.concat(frames, how="diagonal_relaxed").with_columns(pl.col("received_time").cast(pl.Int64))


def _labels(feedback: pl.DataFrame) -> pl.DataFrame:
    """Each label once (a client that resent one, an ingested file beside the live
    collector): the first file's copy."""
    return feedback.unique("feedback_id", keep="first", maintain_order=True)


def _log_events(fs, sources: list[_Source]) -> pl.DataFrame:
    """GenAI log events (message content of the instrumentations that log it), each
    with its `_pdate`."""
    if not sources:
        return pl.DataFrame()
    return _gen_ai_events(_read(fs, sources, list(layout.needs(layout.LOGS, READER)), dataset=layout.LOGS))


def _gen_ai_events(df: pl.DataFrame) -> pl.DataFrame:
    """The GenAI events of log records, each once, in time order. A bucket's records
    give the window's events of its traces: copies of a record share its trace."""
    if df.height == 0:
        return pl.DataFrame()
    name = pl.coalesce(pl.col("event_name"), pl.col("attributes").list.eval(
        pl.element().filter(pl.element().struct.field("key") == "event.name").struct.field("value").struct.field("string_value")).list.first())
    return (df.with_columns(name.alias("event_name"))
            .filter(pl.col("event_name").str.starts_with("gen_ai.") & pl.col("span_id").is_not_null())
            .unique("record_id", keep="first", maintain_order=True)
            .sort(pl.coalesce("time", "observed_time"), "record_id"))


def _events_by_span(logs: pl.DataFrame, traces: pl.Series) -> dict[tuple[str, str], list[dict]]:
    if logs.height == 0:
        return {}
    sub = logs.filter(pl.col("trace_id").is_in(traces.implode()))
    if sub.height == 0:
        return {}
    attrs = A.to_dicts(sub["attributes"].to_arrow(compat_level=pl.CompatLevel.newest()))
    bodies = sub["body"].to_list()
    out: dict[tuple[str, str], list[dict]] = {}
    for t, s, name, a, b in zip(sub["trace_id"], sub["span_id"], sub["event_name"], attrs, bodies):
        body = None
        if b:
            typ = b.get("type")
            body = A._value(typ, b.get("string_value"), b.get("int_value"), b.get("double_value"),
                            b.get("bool_value"), b.get("json_value"), b.get("bytes_value"))
        out.setdefault((t, s), []).append({"event_name": name, "body": body, "attributes": a})
    return out


def _group_text(cfg: TransformConfig, steps: list[dict], session: str | None, group_attr: str | None) -> str | None:
    g = cfg.group_by
    if g == "none":
        return None
    if g == "conversation":
        return session
    if g.startswith("attribute:"):
        return group_attr
    for m in steps[0]["input_messages"]:  # first_user_message
        if m.get("role") == "user" and m.get("content"):
            return m["content"]
    return None


def _hash(text: str, n: int = 32) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


@dataclass
class _Shared:
    """What every bucket reads besides its own spans (sent once to each Ray worker)."""

    cfg: TransformConfig
    now_ns: int
    since: dt.date | None
    until: dt.date | None
    feedback: pl.DataFrame
    logs: pl.DataFrame
    dates: set[str] | None  # an incremental build's dates; None: every date in the window
    incremental: bool
    log_dates: dict[str, set[str]] = field(default_factory=dict)  # trace -> dates of its log events


@dataclass(kw_only=True)
class _Ctx(_Shared):
    """One bucket's view: what every bucket shares (with its own log events), and
    what it counts and learns as it goes."""

    functions: list[tuple[str, object]] = field(default_factory=list)
    include: re.Pattern | None = None
    exclude: re.Pattern | None = None
    summary: Summary = field(default_factory=Summary)
    counts: C.Counts = field(default_factory=C.Counts)
    tool_error: re.Pattern | None = None
    seen: incremental.Seen | None = None  # what an incremental build learns of each date, for the next

    @classmethod
    def of(cls, shared: _Shared, **mine) -> "_Ctx":
        return cls(**{**{f.name: getattr(shared, f.name) for f in fields(_Shared)}, **mine})


@dataclass
class _Job:
    """One bucket: its span files (a build in one bucket) or its file from the split,
    and the scratch folder its parts go to. Paths, not data: the spans stay where
    they are until the process that builds the bucket reads them."""

    bucket: int
    sources: list[_Source]
    split: list[str]
    scratch: str
    log_sources: list[_Source] = field(default_factory=list)  # one bucket: the window's log files
    log_split: list[str] = field(default_factory=list)  # else this bucket's pieces of them
    #: remove the pieces once read (one process: a failed bucket fails the build, nothing retries it),
    #: so the split's scratch shrinks as the rows' grows and the build's disk peaks at about one copy
    consume: bool = False
    #: a local build without a split: the buckets' spans read in order from the files (`stream`)
    stream: stream_.Stream | None = None


@dataclass
class _Done:
    """What a bucket left: its row frames ((frame, date, spill file), by date), its
    pool columns' file, and what it counted and learnt."""

    bucket: int
    frames: list[tuple[int, str, str]]
    slim: str
    summary: Summary
    counts: C.Counts
    seen: incremental.Seen | None


@dataclass
class _SplitJob:
    """A run of span files to split into the buckets' pieces (named by the run)."""

    index: int
    sources: list[_Source]
    buckets: int
    scratch: str
    batch_bytes: int
    data: str = ""
    storage_options: dict = field(default_factory=dict)
    logs: list[_Source] = field(default_factory=list)  # log files split the same way, by trace
    groups: dict[str, str] = field(default_factory=dict)  # trace -> the trace it is bucketed with (`chains`)


def split_files(job: _SplitJob, shared: object = None) -> tuple[dict[int, str], dict[int, str], list[str]]:
    """The split of one run of files: each bucket's piece of spans and of log
    records, and what could not be read."""
    fs, _ = fsspec.core.url_to_fs(job.data, **job.storage_options)
    bad: list[str] = []
    spans = _split(fs, job.sources, job.buckets, job.scratch, job.batch_bytes, bad, tag=f"-{job.index:05d}",
                   groups=job.groups)
    logs = _split(fs, job.logs, job.buckets, job.scratch, job.batch_bytes, [], tag=f"-logs-{job.index:05d}",
                  columns=list(layout.needs(layout.LOGS, READER)), dataset=layout.LOGS, groups=job.groups)
    return {b: p for b, p in enumerate(spans) if p}, {b: p for b, p in enumerate(logs) if p}, bad


#: Footers read at once (`group_bytes`): on S3 each is a round trip or two
FOOTER_READS = 16


def group_bytes(fs, paths: Iterable[str]) -> dict[str, list[int] | None]:
    """Each span file's row groups' bytes (`_uncompressed_md`; None: its footer cannot
    be read, and reading the file reports it), the footers read concurrently. The
    driver sizes the buckets and cuts the split's runs from them before any task
    starts: on S3 a footer is a request or two (the size, then the tail), so a
    window of a thousand files read one after another kept the cluster waiting
    minutes, and each file's was read twice (the sizing, then the cut). Sizes, not
    the footers: a week of files' footers, every column's statistics, held in the
    driver for the build's whole life."""

    def one(path: str) -> list[int] | None:
        try:
            with fs.open(path, "rb") as fh:
                md = pq.ParquetFile(fh).metadata
        except (pa.ArrowException, OSError):
            return None
        return [_uncompressed_md(md, g) for g in range(md.num_row_groups)]

    unique = list(dict.fromkeys(paths))
    if len(unique) < 2:
        return {p: one(p) for p in unique}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(FOOTER_READS, len(unique)), thread_name_prefix="footer") as pool_:
        return dict(zip(unique, pool_.map(one, unique)))


def _cut(fs, sources: list[_Source], n: int, sizes: dict[str, list[int] | None] | None = None) -> list[list[_Source]]:
    """The span files as `n` contiguous runs of about the same bytes (the columns the
    build reads, decompressed: what a split task's time follows), cut between row
    groups where a run ends inside a file (`distributed.balance`): runs of equal file
    count left one Ray worker idle for the last eighth of the benchmark's split, and
    three files for four tasks one for a third of it. The rows reach each bucket in
    the same order: runs are read back in order. A file whose footer cannot be read
    stays whole, to be reported once. `sizes`: `group_bytes`, read already."""
    sizes = group_bytes(fs, (src.path for src in sources)) if sizes is None else sizes
    units: list[tuple[int, int | None, int]] = []  # (file, its row group or None: the whole file, bytes)
    groups: dict[int, int] = {}
    for i, src in enumerate(sources):
        per = sizes.get(src.path)
        if per is None:
            units.append((i, None, 0))
            continue
        groups[i] = len(per)
        lo, hi = src.groups or (0, len(per))
        units += [(i, g, per[g]) for g in range(lo, hi)] or [(i, None, 0)]
    runs = []
    for a, b in distributed.balance([w for _, _, w in units], n):
        taken: dict[int, list[int | None]] = {}  # file -> its row groups in this run, in order
        for i, g, _ in units[a:b]:
            taken.setdefault(i, []).append(g)
        run = []
        for i, gs in taken.items():
            src = sources[i]
            whole = gs == [None] or (src.groups is None and (gs[0], gs[-1] + 1) == (0, groups[i]))
            run.append(src if whole else _Source(src.path, src.date, src.only, (gs[0], gs[-1] + 1)))
        runs.append(run)
    return runs


def _runs(sources: list[_Source], n: int) -> list[list[_Source]]:
    """`sources` in `n` contiguous runs of about the same count (fewer if fewer files)."""
    n = max(1, min(n, len(sources)))
    size, extra = divmod(len(sources), n)
    out, at = [], 0
    for i in range(n):
        k = size + (1 if i < extra else 0)
        out.append(sources[at:at + k])
        at += k
    return [r for r in out if r]


@dataclass
class _DayJob:
    """A date's partition to stage: its frames' spill files and their advantages."""

    day: str
    frames: list[tuple[int, str]]
    advantages: spill.Advantages
    folder: str


def _day_tables(frames: list[tuple[int, str]], adv: spill.Advantages) -> Iterator[pa.Table]:
    for part, path in frames:
        yield pool.add_advantages(spill.read_arrow(path), adv.of(part))


def stage_day(job: _DayJob, shared: object = None) -> int:
    """A date's partition written beside the output, not yet in place (a Ray task)."""
    return output.stage(_day_tables(job.frames, job.advantages), job.folder)


def _engine_run(engine: distributed.Engine, work, jobs: list, cfg: TransformConfig, shared: object = None,
                tick=lambda: None, spread: bool = False, weights: list[int] | None = None,
                each=None) -> list:
    try:
        return engine.run(work, jobs, shared, tick, spread, weights, each)
    except distributed.EngineError as e:
        raise BuildError(str(e)) from None


def _remove(paths: Iterable[str]) -> None:
    """Scratch files no task reads again (a Ray task done is never retried), removed
    by the driver as each task's result comes in, while the workers work. Left to
    the end, the 1M benchmark's split pieces and spilled rows (gigabytes: the
    window again) took the driver alone 3 s to remove (0.4 CPU-s, the rest waiting on
    pages under writeback) after the last task, and held the disk until then."""
    for p in paths:
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


def _bytes(paths: Iterable[str]) -> int:
    """What a job reads from the scratch folder: on Ray the heaviest job goes first."""
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))


def _phase(summary: Summary, name: str, since: float) -> float:
    now = time.perf_counter()
    summary.phases[name] = now - since
    return now


def _part(bucket: int, j: int) -> int:
    """A frame's number: its advantages come back by it."""
    return bucket << 20 | j


def _spans(job: _Job, cfg: TransformConfig, summary: Summary) -> pl.DataFrame:
    if job.stream is not None:
        return job.stream.bucket(job.bucket, summary.unreadable)
    if job.split:
        return _read_bucket(job.split, job.consume)
    fs, _ = fsspec.core.url_to_fs(cfg.data, **(cfg.storage_options or {}))
    return _read(fs, job.sources, SPAN_COLUMNS, summary.unreadable)


def run_bucket(job: _Job, shared: _Shared) -> _Done:
    """Build one bucket of whole traces: the same code in this process and in a Ray
    task. Its rows are spilled by date (later buckets must not keep them in memory),
    each file written whole or not at all, so a task killed and retried leaves no
    half part behind; nothing is committed here, the driver does that."""
    cfg = shared.cfg
    t0 = time.perf_counter()
    summary = Summary()
    functions = [(spec, load_function(spec)) for spec in cfg.reward.functions]
    if job.log_split:  # this bucket's log events only: none is held for the whole window
        logs = _gen_ai_events(_read_bucket(job.log_split, job.consume))
    else:
        fs, _ = fsspec.core.url_to_fs(cfg.data, **(cfg.storage_options or {}))
        logs = _log_events(fs, job.log_sources)
    log_dates = {}
    if shared.incremental and logs.height:
        log_dates = {t: set(ds) for t, ds in logs.group_by("trace_id").agg(pl.col("_pdate").unique()).iter_rows()}
    ctx = _Ctx.of(shared, logs=logs, log_dates=log_dates, functions=functions,
                  include=re.compile(cfg.agents_include) if cfg.agents_include else None,
                  exclude=re.compile(cfg.agents_exclude) if cfg.agents_exclude else None, summary=summary,
                  tool_error=re.compile(cfg.credit.tool_error_pattern),
                  seen=incremental.Seen() if shared.incremental else None)
    rows, tokens = process(_spans(job, cfg, summary), ctx)  # `process` holds the only reference: it frees them early
    days = sorted(rows["_date"].unique().to_list()) if rows is not None else []
    frames, slim = [], []
    for j, day in enumerate(days):
        t = _table(rows.filter(pl.col("_date") == day), tokens)
        part = _part(job.bucket, j)
        slim.append(pool.slim(t).with_columns(pl.lit(part, pl.UInt64).alias("_part")))
        frames.append((part, day, spill.write_ipc(t, os.path.join(job.scratch, f"rows-{day}-{job.bucket:05d}.arrow"))))
        del t
    del rows, tokens
    path = spill.write_ipc(pl.concat(slim), os.path.join(job.scratch, f"slim-{job.bucket:05d}.arrow")) if slim else ""
    _give_back_memory()
    summary.bucket_seconds = time.perf_counter() - t0
    return _Done(job.bucket, frames, path, summary, ctx.counts, ctx.seen)


def process(df: pl.DataFrame, ctx: _Ctx) -> tuple[pl.DataFrame | None, pl.DataFrame | None]:
    """Transition rows (without advantage and token ids, with `_date` and what orders
    them) of every settled trajectory in `df`, which holds whole traces, and the token
    ids by call (`_call`): read the calls -> normalize them -> group them into
    trajectories and assign credit -> rows."""
    if df.height == 0:
        return None, None
    df = _prepare(df, ctx.summary)
    cfg = ctx.cfg
    group_attr = cfg.group_by.split(":", 1)[1] if cfg.group_by.startswith("attribute:") else None
    cls = C.classify(df, tuple(cfg.reward.keys), group_attr)
    anc = C.ancestry(df, cls)
    traces = _traces(df, cls, cfg)
    carriers = df.filter(cls["carrier"])
    root_calls = set(df.filter(cls["is_call"] & pl.col("parent_span_id").is_null())["span_id"].to_list())
    call_rows = df.filter(cls["is_call"]).drop("parent_span_id", "name", strict=False)
    del df  # the bucket's spans: only the calls and reward carriers are still needed
    kept, tokens = _normalize(call_rows, anc, root_calls, ctx, traces)
    rows, frame = _assign_credit(kept, traces, _span_rewards(carriers, ctx), ctx)
    parts = ([_dict_frame(rows)] if rows else []) + ([frame] if frame is not None and frame.height else [])
    return (pl.concat(parts) if parts else None), tokens


def _prepare(df: pl.DataFrame, summary: Summary) -> pl.DataFrame:
    df = df.with_columns(
        pl.col("start_time").cast(pl.Int64).alias("start_ns"),
        pl.col("end_time").cast(pl.Int64).alias("end_ns"),
        pl.col("received_time").cast(pl.Int64).alias("received_ns"),
    )
    # Several copies of a span (an ingested file and the live collector): once.
    if df.select(pl.struct("trace_id", "span_id").is_duplicated().any()).item():
        df = df.unique(["trace_id", "span_id"], keep="first", maintain_order=True)
    summary.spans += df.height
    return df


@dataclass
class _Traces:
    """Per trace: settling, root, conversation, grouping attribute; and, for linked
    trajectories, the trace each one joins."""

    info: dict[str, dict]
    linked_to: dict[str, str]

    def trajectory(self, trace_id: str, how: str) -> str:
        if how == "linked":
            return self.linked_to.get(trace_id, trace_id)
        if how == "conversation":
            sess = self.info[trace_id]["session"]
            if sess:
                return "conversation:" + sess
        return trace_id


def _traces(df: pl.DataFrame, cls: pl.DataFrame, cfg: TransformConfig) -> _Traces:
    dates = df["_pdate"] if "_pdate" in df.columns else pl.Series("_pdate", [None] * df.height, pl.String)
    per_trace = df.select("trace_id", "parent_span_id", "received_ns", "start_ns", "end_ns").hstack(
        cls.select("session", "group_attr")).with_columns(dates).group_by("trace_id").agg(
        pl.col("received_ns").max().alias("last_received"),
        (pl.col("parent_span_id").is_null() & pl.col("end_ns").is_not_null()).any().alias("root_ended"),
        pl.col("start_ns").min().alias("first_start"),
        pl.col("received_ns").min().alias("first_received"),
        pl.col("session").drop_nulls().first().alias("session"),
        pl.col("group_attr").drop_nulls().first().alias("group_attr"),
        pl.col("_pdate").drop_nulls().unique().alias("dates"),
    )
    return _Traces({r["trace_id"]: r for r in per_trace.iter_rows(named=True)},
                   _linked_components(df) if cfg.trajectory == "linked" else {})


def _normalize(call_rows: pl.DataFrame, anc: pl.DataFrame, root_calls: set[str],
               ctx: _Ctx, traces: _Traces) -> tuple[columnar.Kept, pl.DataFrame]:
    """One record per call, whatever its instrumentation's layout, with its agent;
    double-recorded calls merged. The records the expressions read stay frames unless
    the bucket has calls recorded twice or histories sent as deltas (then every
    record is Python's). Token ids stay in Arrow, by call index."""
    ctx.counts.calls_seen += call_rows.height
    tokens = C.token_columns(call_rows)
    if (n_bad := tokens["bad_token_ids"].sum()):
        ctx.summary.bad_token_ids[0] += n_bad
        ctx.summary.bad_token_ids[1] = ctx.summary.bad_token_ids[1] or call_rows["span_id"].filter(tokens["bad_token_ids"])[0]
    tokens = tokens.drop("bad_token_ids")
    log_events = _events_by_span(ctx.logs, call_rows["trace_id"].unique())
    span_events = C.events_of(call_rows)
    events = {k: log_events.get(k, []) + span_events.get(k, []) for k in log_events.keys() | span_events.keys()}
    meta = call_rows.select("span_id", "gen_ai_operation_name", "scope_name")
    got = normalize.read_frames(call_rows, events)
    for why, n in got.python.items():
        ctx.summary.python_reader[why] += n
    conversation = call_rows["gen_ai_conversation_id"]
    previous = C.previous_responses(call_rows)
    trace_ids = call_rows["trace_id"]
    del call_rows
    kept = columnar.kept(got, meta, anc, ctx.counts)  # never a row whose content was guessed at
    del got
    if columnar.needs_python(kept, root_calls) or previous.is_not_null().any():
        records = C.dedupe(kept.records(), kept.outer, ctx.counts)
        records = C.merge_detached(records, root_calls, ctx.counts)
        day_of = _days(traces, ctx.cfg.trajectory)  # a history is carried within a day only (`chains`)
        days = [day_of[t] for t in trace_ids.to_list()]
        C.rebuild_deltas(records, conversation.to_list(), days)
        C.rebuild_continuations(records, previous.to_list(), days)
        kept = columnar.Kept(None, None, records, kept.outer)
    return kept, tokens


def _span_rewards(carriers: pl.DataFrame, ctx: _Ctx) -> dict[str, list[Observation]]:
    """Rewards carried by spans, by trace."""
    cfg = ctx.cfg
    span_obs: dict[str, list[Observation]] = defaultdict(list)
    if carriers.height:
        for (t, s, name, start), attrs in zip(carriers.select("trace_id", "span_id", "name", "start_ns").iter_rows(),
                                             A.to_dicts(carriers["attributes"].to_arrow(compat_level=pl.CompatLevel.newest()))):
            found, bad = from_span(name or "", attrs, tuple(cfg.reward.keys))
            ctx.counts.bad_rewards += bad
            for rname, value, detail, primary in found:
                span_obs[t].append(Observation(rname, value, "span", detail, int(start or 0), s, primary))
    return span_obs


def _assign_credit(kept: columnar.Kept, traces: _Traces, span_obs: dict[str, list[Observation]],
                   ctx: _Ctx) -> tuple[list[dict], pl.DataFrame | None]:
    """The calls grouped into trajectories, and the rows of those that settled, each
    with its reward and credit: as dicts for the trajectories only Python can build
    (`_trajectory_rows`), as a frame for the rest (`columnar.rows`). Trajectories are
    visited in key order either way: the summary and what an incremental build
    learns come out as one loop over them all would make them."""
    cfg, how = ctx.cfg, ctx.cfg.trajectory
    traces_of: dict[str, list[str]] = defaultdict(list)
    for t in traces.info:
        traces_of[traces.trajectory(t, how)].append(t)
    hard: set[str] = {traces.trajectory(r["trace_id"], how) for r in kept.slow}
    frame = steps = sel = None
    plain: dict[str, tuple[int, int]] = {}  # key -> (calls, calls its agent selection keeps)
    first_user: dict[str, str] = {}
    if kept.frame is not None:
        frame = columnar.with_keys(kept.frame, None if how == "trace" else {
            t: traces.trajectory(t, how) for t in traces.info})
        keys = frame["_key"].unique().to_list()
        if ctx.functions or cfg.credit.strategy == "per_step":
            hard.update(keys)
        elif ctx.feedback.height:  # feedback read per trajectory, as `_observations` reads it
            fb_traces = set(ctx.feedback["trace_id"].drop_nulls().to_list())
            fb_convs = set(ctx.feedback["conversation_id"].drop_nulls().to_list())
            for key in keys:
                tids = traces_of[key]
                session = next((traces.info[t]["session"] for t in sorted(tids) if traces.info[t]["session"]), None)
                if any(t in fb_traces for t in tids) or (session and session in fb_convs):
                    hard.add(key)
        steps = columnar.ordered(frame)
        rebuild, errored = columnar.tools(steps, kept.flat, ctx.tool_error if cfg.credit.tool_error_penalty else None)
        hard |= rebuild
        plain_calls = ~steps["_key"].is_in(list(hard))
        steps, errored = steps.filter(plain_calls), errored.filter(plain_calls)
        sel = columnar.selected(steps, ctx.include, ctx.exclude)
        plain = {k: (n, m) for k, n, m in steps.select("_key", "step", sel).group_by("_key").agg(
            pl.len(), pl.col("_sel").sum()).iter_rows()}
        if cfg.group_by not in ("none", "conversation") and not cfg.group_by.startswith("attribute:"):
            first_user = columnar.first_user_messages(steps, kept.flat)
    by_traj: dict[str, list[dict]] = defaultdict(list)
    records = kept.slow
    if frame is not None and hard:
        records = columnar.Kept(frame.filter(pl.col("_key").is_in(list(hard))), kept.flat, kept.slow, {}).records()
    for rec in records:
        by_traj[traces.trajectory(rec["trace_id"], how)].append(rec)
    rows: list[dict] = []
    built = columnar.Trajectories.empty()
    for key in sorted(by_traj.keys() | plain.keys()):
        if key in by_traj:
            rows += _trajectory_rows(key, by_traj[key], sorted(traces_of[key]), traces, span_obs, ctx)
        else:
            _plain_trajectory(key, sorted(traces_of[key]), plain[key], first_user.get(key), traces, span_obs, ctx,
                              built)
    if not built.key:
        return rows, None
    out, flagged, missing = columnar.rows(steps, kept.flat, built, sel, errored, cfg.credit.strategy, cfg.credit.gamma,
                                          cfg.credit.tool_error_penalty, cfg.advantage.weighting == "trajectory")
    for f, n in flagged.items():
        ctx.summary.flagged[f] += n
    for conv, n in missing.items():
        ctx.summary.content_missing[conv] += n
    return rows, out


def _start_ns(infos: list[dict]) -> int:
    """When a trajectory started: a trajectory belongs to the day it started; one whose
    spans have no start time (0 in OTLP), to the day the collector filed them under:
    the day they arrived."""
    starts = [i["first_start"] for i in infos if i["first_start"] is not None]
    return min(starts) if starts else min(i["first_received"] or 0 for i in infos)


def _days(traces: _Traces, how: str) -> dict[str, dt.date]:
    """Each trace's trajectory's day (`_placed`'s)."""
    members: dict[str, list[dict]] = defaultdict(list)
    for t, info in traces.info.items():
        members[traces.trajectory(t, how)].append(info)
    day = {k: dt.datetime.fromtimestamp(_start_ns(v) / 1e9, dt.timezone.utc).date() for k, v in members.items()}
    return {t: day[traces.trajectory(t, how)] for t in traces.info}


def _placed(tids: list[str], traces: _Traces, ctx: _Ctx):
    """(infos, day, start_ns, session, rooted) of a trajectory this build writes, or
    None when it started outside the window or may still grow (counted, and the
    waiting one remembered for the next build). One function for the columnar and the
    Python rows, so both place a trajectory on the same day by the same clock."""
    summary = ctx.summary
    settle_ns = int(ctx.cfg.settle * 1e9)
    infos = [traces.info[t] for t in tids]
    last = max(i["last_received"] or 0 for i in infos)
    rooted = all(i["root_ended"] for i in infos)
    start_ns = _start_ns(infos)
    day = dt.datetime.fromtimestamp(start_ns / 1e9, dt.timezone.utc).date()
    if ((ctx.since and day < ctx.since) or (ctx.until and day > ctx.until)
            or (ctx.dates is not None and day.isoformat() not in ctx.dates)):
        summary.outside_window += 1
        return None
    session = next((i["session"] for i in infos if i["session"]), None)
    # settled once nothing arrived for `settle` by the build's clock (six times that
    # for a trajectory whose root never ended): the same clock decides in every build
    settle_at = last + (settle_ns if rooted else 6 * settle_ns)
    if settle_ns > 0 and ctx.now_ns < settle_at:
        summary.waiting += 1
        _seen(ctx, day.isoformat(), tids, infos, settle_at, session, [])
        return None
    return infos, day, start_ns, session, rooted


def _rated(best: Observation | None, ctx: _Ctx) -> tuple[float | None, str | None]:
    """A trajectory's outcome and where it came from (`reward.default` when nothing
    rated it), counted in the summary: one function for the columnar and the Python rows."""
    cfg, summary = ctx.cfg, ctx.summary
    R, R_src = (best.value, best.detail) if best else (None, None)
    if best is None and cfg.reward.default:
        R, R_src = float(cfg.reward.default), "default"
    if R is None:
        summary.unrated += 1
    else:
        summary.rewards_by_source[R_src.split(":", 1)[0] if R_src != "default" else "default"] += 1
    return R, R_src


def _plain_trajectory(key: str, tids: list[str], calls: tuple[int, int], first_user: str | None, traces: _Traces,
                      span_obs: dict[str, list[Observation]], ctx: _Ctx, built: columnar.Trajectories) -> None:
    """`_trajectory_rows` for a trajectory whose rows `columnar.rows` makes: what it
    decides once per trajectory (window, settling, outcome, group), added to `built`."""
    cfg, summary = ctx.cfg, ctx.summary
    placed = _placed(tids, traces, ctx)
    if placed is None:
        return
    infos, day, start_ns, session, rooted = placed
    trajectory_id = key if not key.startswith("conversation:") else _hash(key)
    best = outcome([o for t in tids for o in span_obs.get(t, [])], cfg.reward.name, cfg.reward.prefer)
    R, R_src = _rated(best, ctx)
    g = cfg.group_by
    group_text = (None if g == "none" else session if g == "conversation" else
                  (infos[0]["group_attr"] if infos else None) if g.startswith("attribute:") else first_user)
    n, selected = calls
    summary.dropped_by_agent += n - selected
    summary.trajectories += 1 if selected else 0
    built.key.append(key)
    built.trajectory_id.append(trajectory_id)
    built.day.append(day.isoformat())
    built.start_ns.append(start_ns)
    built.reward.append(R)
    built.source.append(R_src)
    built.group_id.append(_hash("group:" + group_text, 16) if group_text else None)
    built.orphan.append(not rooted)
    _seen(ctx, day.isoformat(), tids, infos, None, session, [key] if selected else [])


def _trajectory_rows(key: str, calls: list[dict], tids: list[str], traces: _Traces,
                     span_obs: dict[str, list[Observation]], ctx: _Ctx) -> list[dict]:
    """One trajectory's rows: none while it may still grow (settling) or when it
    started outside the window."""
    cfg, summary = ctx.cfg, ctx.summary
    rows: list[dict] = []
    steps = sorted(calls, key=lambda r: (r["start_ns"] or 0, r["span_id"]))
    placed = _placed(tids, traces, ctx)
    if placed is None:
        return []
    infos, day, start_ns, session, rooted = placed
    if not rooted:
        for s in steps:
            s["flags"].append("orphan")
    C.rebuild_history(steps)
    trajectory_id = key if not key.startswith("conversation:") else _hash(key)
    observations = _observations(trajectory_id, tids, session, steps, span_obs, ctx)
    best = outcome(observations, cfg.reward.name, cfg.reward.prefer)
    R, R_src = _rated(best, ctx)
    step_rewards = _per_step_rewards(observations, best, steps, cfg) if cfg.credit.strategy == "per_step" else {}
    credits = credit.assign(len(steps), R, R_src, step_rewards, cfg.credit.strategy, cfg.credit.gamma)
    if cfg.credit.tool_error_penalty:
        errored = credit.tool_errors(steps, ctx.tool_error)
        if any(errored):
            credits = credit.penalize(credits, errored, cfg.credit.tool_error_penalty)
            for s, bad in zip(steps, errored):
                if bad:
                    s["flags"].append("tool_error")
    group_text = _group_text(cfg, steps, session, infos[0]["group_attr"] if infos else None)
    group_id = _hash("group:" + group_text, 16) if group_text else None
    selected = []
    for i, (s, c) in enumerate(zip(steps, credits)):
        name = s["agent_name"] or ""
        if (ctx.include and not ctx.include.search(name)) or (ctx.exclude and ctx.exclude.search(name)):
            summary.dropped_by_agent += 1
            continue
        selected.append((i, s, c))
    rated = sum(1 for _, _, c in selected if c.ret is not None) or len(selected) or 1
    summary.trajectories += 1 if selected else 0
    for i, s, c in selected:
        for f in s["flags"]:
            summary.flagged[f] += 1
        if "content_missing" in s["flags"]:
            summary.content_missing[s["convention"]] += 1
        rows.append({
            "transition_id": C.transition_id(s["trace_id"], s["span_id"]),
            "trace_id": s["trace_id"], "span_id": s["span_id"], "trajectory_id": trajectory_id,
            "group_id": group_id, "step": i, "num_steps": len(steps), "agent_name": s["agent_name"],
            "service_name": s["service_name"], "model": s["model"], "provider": s["provider"],
            "request_model": s["request_model"], "response_model": s["response_model"],
            "policy_version": s["policy_version"], "temperature": s["temperature"],
            "input_messages": s["input_messages"], "output_message": s["output_message"], "tools": s["tools"],
            "finish_reason": s["finish_reason"], "prompt_token_ids": None,
            "completion_token_ids": None, "completion_logprobs": s["completion_logprobs"],
            "input_tokens": s["input_tokens"], "output_tokens": s["output_tokens"],
            "reward": c.reward, "reward_source": c.source, "return": c.ret, "advantage": None,
            "start_time": s["start_ns"], "end_time": s["end_ns"], "convention": s["convention"],
            "truncated": s["truncated"],
            "weight": (1.0 / rated) if cfg.advantage.weighting == "trajectory" else 1.0,
            "flags": s["flags"], "schema_version": transitions.VERSION, "prompt_name": s.get("prompt_name"),
            "prompt_version": s.get("prompt_version"), "_date": day.isoformat(),
            "_order": (start_ns, trajectory_id, i), "_call": s["_call"],
        })
    _seen(ctx, day.isoformat(), tids, infos, None, session, rows)
    return rows


def _seen(ctx: _Ctx, day: str, tids: list[str], infos: list[dict], settle_at: int | None, session: str | None,
          rows: list[dict]) -> None:
    """Tell the next incremental build where this trajectory's spans and log events
    are, when it settles if it waits, and what feedback can name it by."""
    if ctx.seen is None:
        return
    dates = {d for i in infos for d in (i["dates"] or [])}
    for t in tids:
        dates |= ctx.log_dates.get(t, set())
    ctx.seen.trajectory(day, dates, settle_at, tids, session, bool(rows))


def _observations(trajectory_id: str, tids: list[str], session: str | None, steps: list[dict],
                  span_obs: dict[str, list[Observation]], ctx: _Ctx) -> list[Observation]:
    """Every reward found for a trajectory: on its spans, in feedback posted later
    (by trace or conversation), from the user's reward functions."""
    summary, fb = ctx.summary, ctx.feedback
    observations = [o for t in tids for o in span_obs.get(t, [])]
    if fb.height:
        mask = pl.col("trace_id").is_in(tids)
        if session:
            mask = mask | (pl.col("conversation_id") == session)
        for r in fb.filter(mask).iter_rows(named=True):
            observations.append(Observation(r["name"], r["value"], "feedback", f"feedback:{r['name']}",
                                            int(r["received_time"] or 0), r["span_id"], False))
    if ctx.functions:
        traj = Trajectory(trajectory_id, tids, session, steps[0]["service_name"], steps, list(observations))
        for spec, fn in ctx.functions:
            got, err = call_function(spec, fn, traj, ctx.now_ns)
            if err:
                summary.reward_errors += 1
                if summary.reward_errors <= 3:
                    log.warning("reward function %s failed on trajectory %s: %s", spec, trajectory_id, err)
                for s in steps:
                    s["flags"].append("reward_function_error")
            observations += got
    return observations


def _per_step_rewards(observations: list[Observation], best: Observation | None, steps: list[dict],
                      cfg: TransformConfig) -> dict[int, list[tuple[float, str]]]:
    """per_step credit: each reward other than the outcome goes to the call it rates
    (feedback naming a span) or to the call that ended last before it was given."""
    step_rewards: dict[int, list[tuple[float, str]]] = defaultdict(list)
    chosen = best.name if best else cfg.reward.name
    index = {s["span_id"]: i for i, s in enumerate(steps)}
    for o in observations:
        if o is best or (chosen and o.name != chosen) or (not chosen and not o.primary):
            continue
        if o.source == "feedback":
            at = index.get(o.span_id) if o.span_id else None
        else:  # the call that ended last before the reward was given
            ended = [i for i, s in enumerate(steps) if (s["end_ns"] or 0) <= o.time_ns]
            at = ended[-1] if ended else None
        if at is not None:
            step_rewards[at].append((o.value, o.detail))
    return step_rewards


def _dict_frame(rows: list[dict]) -> pl.DataFrame:
    """The rows `_trajectory_rows` made, typed as `columnar.rows` types its own, with
    the prompt each model saw (`attribution`)."""
    rows = attribution.attribute(rows)
    arrays = {}
    for f in columnar.WANTED:
        col = [r[f.name] for r in rows]
        if f.name in ("start_time", "end_time"):
            arrays[f.name] = pa.array(col, pa.int64()).cast(f.type)
        else:
            arrays[f.name] = pa.array(col, f.type)
    arrays["_date"] = pa.array([r["_date"] for r in rows], pa.string())
    arrays["_ostart"] = pa.array([r["_order"][0] for r in rows], pa.int64())
    arrays["_call"] = pa.array([r["_call"] for r in rows], pa.int64())
    return pl.from_arrow(pa.table(arrays))


def _table(rows: pl.DataFrame, tokens: pl.DataFrame) -> pl.DataFrame:
    """A date's rows in output order (trajectory start, trajectory, step), token ids
    taken from Arrow by call; `advantage` comes later."""
    rows = rows.sort(*columnar.ORDER)
    ids = tokens[rows["_call"].cast(pl.UInt32)]
    sent = prompt_ids.ids(rows, prompt_ids.system_texts(), pl.col("tools"),
                          ~pl.col("flags").fill_null([]).list.contains("content_missing"))
    return rows.drop("_date", "_ostart", "_call").hstack(ids.select("prompt_token_ids", "completion_token_ids")).hstack(sent)


def build(cfg: TransformConfig, *, now_ns: int | None = None, progress: bool = False) -> Summary:
    """Build the transitions of every date (or of `since`..`until`), or, with
    `incremental`, of the dates whose rows changed since the last build (a full build
    of the same data at the same clock would give the same rows). `now_ns` is the
    clock that decides which trajectories have settled. One build at a time per lake."""
    fs, root = fsspec.core.url_to_fs(cfg.data, **(cfg.storage_options or {}))
    try:
        with output.held(fs, root.rstrip("/")):
            return _build(cfg, now_ns, progress)
    except output.Busy as e:
        raise BuildError(str(e)) from None
    except Exception as e:
        if not _disk_full(e):
            raise
        raise BuildError(f"no space left on the device while the build wrote {getattr(e, 'filename', None) or 'its files'} "
                         f"({cfg.data}): its scratch is removed, the dates it committed before stay as written and the "
                         "spans are untouched; free space (a build needs room beside its output for the window's "
                         "rows once more) and build again") from None


def _disk_full(e: BaseException) -> bool:
    """A write that failed for want of room, however it is raised: Python's and
    Arrow's writers raise OSError with the errno (a 10M-span build on a disk that
    filled printed Arrow's traceback), Polars' only says so in its message."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e)


def _build(cfg: TransformConfig, now_ns: int | None, progress: bool) -> Summary:
    cfg.check()
    try:
        distributed.check(cfg.build)
    except distributed.EngineError as e:
        raise BuildError(str(e)) from None
    t0, c0 = time.perf_counter(), time.process_time()
    summary = Summary()
    now_ns = now_ns if now_ns is not None else time.time_ns()
    since, until = _day(cfg.since, "--since"), _day(cfg.until, "--until")
    if since and until and since > until:
        raise BuildError(f"--since {since} is after --until {until}")
    fs, root = fsspec.core.url_to_fs(cfg.data, **(cfg.storage_options or {}))
    root = root.rstrip("/")
    if not fs.exists(layout.folder(root, layout.SPANS)):
        raise BuildError(f"no spans dataset at {layout.folder(root, layout.SPANS)}: run `nightshift collect` (or "
                         "`nightshift ingest`) first")
    out_root = layout.folder(root, layout.TRANSITIONS)
    inputs = incremental.Inputs(root, _listing(fs, layout.folder(root, layout.SPANS), since, until),
                                _listing(fs, layout.folder(root, layout.LOGS)),
                                _feedback_files(fs, root), {})
    feedback = _feedback(fs, root, inputs.feedback)
    plan, old_state = None, None
    if cfg.incremental and inputs.spans:
        output.repair(fs, out_root)
        inputs.partitions = _partitions(fs, out_root)
        old_state, why_none = incremental.load(fs, root)
        plan = incremental.plan(fs, old_state, why_none, inputs, feedback, now_ns, cfg)
        summary.incremental = plan.why + ("" if plan.dates is None else
                                          f": rebuilding {', '.join(sorted(plan.dates)) or 'nothing'}")
        (log.warning if old_state is None and why_none.startswith("the build state") else log.info)(
            "incremental build: %s", summary.incremental)
        if plan.dates is not None and not plan.dates:  # nothing new: every partition stays as it is
            incremental.save(fs, root, incremental.new_state(inputs, old_state, set(), incremental.Seen(), {}, now_ns,
                                                             cfg), cfg.storage_options)
            summary.seconds = time.perf_counter() - t0
            return summary
    dates = plan.dates if plan is not None else None
    if dates is not None:  # the rebuilt dates whole, and from other dates the rest of their traces
        reads = [_Source(p, d, plan.spans.get(d)) for d, paths in inputs.span_paths(dates | set(plan.spans)).items()
                 for p in paths]
        logs = [_Source(p, d, plan.logs.get(d)) for d, paths in inputs.log_paths(
            (dates & set(inputs.spans)) | set(plan.logs)).items() for p in paths]
    else:
        reads = [_Source(p, d) for d, paths in inputs.span_paths(inputs.spans).items() for p in paths]
        logs = [_Source(p, d) for d, paths in inputs.log_paths(inputs.spans).items() for p in paths]
    if not reads and not dates:
        raise BuildError(f"no span files under {layout.folder(root, layout.SPANS)}"
                         + (" in the window" if since or until else ""))
    for spec in cfg.reward.functions:  # each bucket loads them again (a Ray worker too): a bad one fails here, once
        try:
            load_function(spec)
        except ValueError as e:
            raise BuildError(str(e)) from None
    shared = _Shared(cfg, now_ns, since, until, _labels(feedback), pl.DataFrame(), dates, plan is not None)
    sizes = group_bytes(fs, (src.path for src in reads))  # each footer once, all at once: the cut uses them too
    total = sum(sum(sizes[src.path] or ()) for src in reads)  # of what this build reads, not of every date
    buckets = max(1, math.ceil(total * OVERHEAD / max(cfg.memory_budget, 1)), cfg.build.buckets)
    summary.buckets = buckets
    output.repair(fs, out_root)
    if output.is_local(fs):  # scratch files beside the output: same disk, cleaned by the next run after a crash
        os.makedirs(out_root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".build-", dir=out_root)
    else:
        tmp = tempfile.mkdtemp(prefix="nightshift-build-")
    engine = distributed.Engine(cfg.build)
    try:
        from tqdm import tqdm

        try:
            engine.__enter__()
        except distributed.EngineError as e:
            raise BuildError(str(e)) from None
        bar = tqdm(total=buckets, unit="bucket", desc="build", disable=not progress)
        clock = time.perf_counter()
        # traces whose calls need each other's (a continued response, a conversation's deltas) or that make one
        # trajectory (a conversation's, linked ones'): one bucket each group
        groups = chains.together(fs, reads, cfg.trajectory) if buckets > 1 else {}
        if groups:  # (each group's first trace is no entry of its own: it is counted here)
            summary.grouped = [len(groups) + len(set(groups.values())), len(set(groups.values()))]
        streamed = _streamed(fs, reads, logs, sizes, buckets, engine, cfg, groups)
        if buckets == 1:
            jobs = [_Job(0, reads, [], tmp, logs)]
        elif streamed is not None:  # no split: each bucket's spans read from the files in order
            jobs = [_Job(b, [], [], tmp, stream=streamed) for b in range(streamed.buckets)]
            summary.buckets = streamed.buckets  # (cuts that fell together are one)
            clock = _phase(summary, "split", clock)
        else:
            bar.set_description("split")
            # files in contiguous runs, one task each: the pieces, read in run order, keep the files' order
            n = 2 * engine.cpus if engine.remote else 1
            runs, log_runs = _cut(fs, reads, n, sizes) if engine.remote else _runs(reads, n), _runs(logs, n)
            pieces: dict[int, list[str]] = defaultdict(list)
            log_pieces: dict[int, list[str]] = defaultdict(list)
            for got, got_logs, bad in _engine_run(engine, split_files, [
                    _SplitJob(i, runs[i] if i < len(runs) else [], buckets, tmp, cfg.memory_budget // int(OVERHEAD),
                              cfg.data, cfg.storage_options or {}, log_runs[i] if i < len(log_runs) else [], groups)
                    for i in range(max(len(runs), len(log_runs)))], cfg):
                summary.unreadable += bad
                for b, path in got.items():
                    pieces[b].append(path)
                for b, path in got_logs.items():
                    log_pieces[b].append(path)
            jobs = [_Job(b, [], pieces[b], tmp, [], log_pieces.get(b, []), consume=not engine.remote)
                    for b in sorted(pieces)]
            clock = _phase(summary, "split", clock)
        if engine.remote and len(jobs) < engine.cpus:
            log.warning("%d bucket(s) of traces for %d Ray CPUs: set build.buckets (e.g. %d) to use them all",
                        len(jobs), engine.cpus, 2 * engine.cpus)
        window_days = dates if dates is not None else {
            d for d in inputs.spans if (not since or dt.date.fromisoformat(d) >= since)
            and (not until or dt.date.fromisoformat(d) <= until)}
        if plan is not None and dates is None:  # transitions are made from spans: a date without any has none
            window_days = window_days | set(inputs.partitions)
        if engine.remote and output.is_local(fs):  # the dates' round's extra worker processes start in the
            engine.prestart(stage_day.__module__, len(window_days))  # buckets' tail (its dates: the window's)
        bar.set_description("build")
        done = _engine_run(engine, run_bucket, jobs, cfg, shared, lambda: bar.update(1),
                           weights=[_bytes(j.split + j.log_split) for j in jobs] if engine.remote else None,
                           each=(lambda i: _remove(jobs[i].split + jobs[i].log_split)) if engine.remote else None)
        clock = _phase(summary, "buckets", clock)
        bar.close()
        ctx = _Ctx.of(shared, summary=summary, seen=incremental.Seen() if plan is not None else None)
        held: dict[str, list[tuple[int, str]]] = defaultdict(list)  # per date: (frame, its rows' spill file)
        slim = []
        for d in done:  # in bucket order: the same summary, examples and state as one process building them all
            summary.add(d.summary)
            ctx.counts.add(d.counts)
            if ctx.seen is not None:
                ctx.seen.add(d.seen)
            for part, day, path in d.frames:
                held[day].append((part, path))
            slim += [d.slim] if d.slim else []
        days = sorted(window_days | set(held))
        kept: dict[int, tuple[str, str]] = {}  # the partitions an incremental build keeps join the pool
        for i, day in enumerate(sorted(set(inputs.partitions) - dates) if dates is not None else ()):
            part = _part(buckets + i, 0)
            try:
                k = pool.read_kept(fs, out_root, day)
            except pool.Unreadable as e:
                raise BuildError(str(e)) from None
            kept[part] = (day, spill.write_ipc(k.select(*pool.ID, "_was"), os.path.join(tmp, f"was-{day}.arrow")))
            slim.append(spill.write_ipc(k.drop("_was").with_columns(pl.lit(part, pl.UInt64).alias("_part")),
                                        os.path.join(tmp, f"slim-kept-{day}.arrow")))
            del k
        # per-group sums from the spilled parts: no per-row table held for the whole window
        adv = spill.advantages(slim, os.path.join(tmp, "advantages"), cfg.advantage.baseline,
                               cfg.advantage.normalize)
        clock = _phase(summary, "advantages", clock)
        if engine.remote and output.is_local(fs):  # each date staged by a worker, committed here, one by one
            staged = _engine_run(engine, stage_day, [_DayJob(day, held.get(day, []), adv, os.path.join(tmp, f"stage-{day}"))
                                                     for day in days], cfg, spread=True,  # a file per date
                                  weights=[_bytes(p for _, p in held.get(day, [])) for day in days],
                                  each=lambda i: _remove(p for _, p in held.get(days[i], [])))
        engine.release()  # no task after this: the cluster stops while the dates are committed
        for i, day in enumerate(days):
            if engine.remote and output.is_local(fs):
                n = staged[i]
                output.commit(out_root, day, os.path.join(tmp, f"stage-{day}"), n)
            else:
                n = output.write_partition(fs, out_root, day, _day_tables(held.get(day, []), adv))
            held.pop(day, None)
            summary.transitions += n
            if n or day in window_days:
                summary.partitions.append(day)
        for part, (day, was) in sorted(kept.items()):
            new = adv.of(part)
            if pool.changed(spill.read_ipc(was), new):
                pool.rewrite(fs, out_root, day, new)
                summary.repooled.append(day)
        _phase(summary, "partitions", clock)
        for who, (cpu, rss) in sorted(engine.usage.items()):  # the split, the buckets and the partitions' tasks
            summary.workers[who], summary.worker_cpu[who] = int(rss), cpu
        summary.ray_idle = list(engine.idle)
    finally:
        engine.__exit__(None, None, None)
        shutil.rmtree(tmp, ignore_errors=True)
    if plan is not None:
        inputs.partitions = _partitions(fs, out_root)
        state = incremental.new_state(inputs, old_state, dates, ctx.seen,
                                      incremental.feedback_dates(feedback, ctx.seen.built), now_ns, cfg)
        incremental.save(fs, root, state, cfg.storage_options)
    summary.duplicates = ctx.counts.duplicates
    summary.no_request = ctx.counts.no_request
    summary.by_instrumentation = ctx.counts.by_scope
    summary.bad_rewards = ctx.counts.bad_rewards
    summary.seconds = time.perf_counter() - t0
    summary.driver_cpu = time.process_time() - c0
    for what in summary.unreadable:
        log.warning("unreadable span data, skipped: %s", what)
    return summary
