"""The lake's retention: a date partition older than `retention.days` goes, from
every dataset at once (spans, logs, feedback, and the transitions built from
them), so the lake holds a week (or what you set) and not everything since the
sidecars started.

By trajectory, not only by file: a trace that started before the cutoff and went
on past midnight has spans on both sides of it. Deleting the old dates alone would
leave its later calls, which the next build would make into a trajectory of their
own, rootless and rewarded by half a story. So the spans and log records of every
trace with a span in a pruned date are removed from the dates kept too (the few
files holding them rewritten whole, atomically, under their own names), and a
trajectory is kept whole or pruned whole.

What it leaves is a lake like any other: the next build, incremental or full,
makes from it the same rows (the incremental build sees the files gone or
rewritten and redoes the dates that read them; the advantages of the dates kept
are pooled without the pruned ones, as a full build's are). The steps run in an
order a crash can stop anywhere: the kept files first, then the old dates, the
transitions last; run again, it finishes.

Local lakes: under the build's lock, so a build never reads a file this deletes.
On an object store nothing locks: run it where the build runs (the nightly job
prunes before it builds). A collector writing late spans into a pruned date
meanwhile is not stopped; the next prune takes them.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import tempfile
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from nightshift.schemas import layout

from . import output
from .config import RetentionConfig  # noqa: F401  (its settings: here for callers)
from .compaction import written_as

log = logging.getLogger("nightshift.retention")

#: Pruned by date, in this order: the raw datasets, then what was built from them.
DATASETS = (layout.SPANS, layout.LOGS, layout.FEEDBACK, layout.TRANSITIONS)
#: Datasets whose rows of a pruned trace are removed from the dates kept.
BY_TRACE = (layout.SPANS, layout.LOGS)
#: The end of a rewrite's file beside the one it replaces, until the rename.
TMP = ".prune.tmp"


@dataclass
class Pruned:
    """What a prune removed (or, dry, would remove)."""

    cutoff: str  # the first date kept
    days: int
    dates: dict[str, list[str]] = field(default_factory=dict)  # per dataset, the dates removed
    files: int = 0
    bytes: int = 0
    traces: int = 0  # traces that started before the cutoff with spans or log records after it
    rewritten: int = 0  # files of kept dates rewritten without them
    rows: int = 0  # their rows removed
    dry_run: bool = False

    def lines(self) -> list[str]:
        verb = "would remove" if self.dry_run else "removed"
        head = f"retention: {self.days} day(s) kept besides today, so dates before {self.cutoff} go"
        if not any(self.dates.values()) and not self.rewritten:
            return [head, "  nothing older: nothing removed"]
        out = [head]
        for name in DATASETS:
            days = self.dates.get(name) or []
            if days:
                out.append(f"  {name}: {verb} {len(days)} date(s), {days[0]} .. {days[-1]}")
        out.append(f"  {verb} {self.files} file(s), {self.bytes / 2**20:.1f} MiB")
        if self.traces:
            out.append(f"  {self.traces} trace(s) that started before {self.cutoff} went on past it: "
                       f"{'would rewrite' if self.dry_run else 'rewrote'} {self.rewritten} file(s) of the dates kept "
                       f"without their {self.rows} row(s)")
        if not self.dry_run:
            out.append("  the next build redoes the dates that read them (nightly's incremental build does)")
        return out


class RetentionError(RuntimeError):
    """A prune that cannot run now (a build holds the lake): run it again later."""


class NotADate(RetentionError):
    """A date partition whose name is not a date: the lake needs a person first."""


def cutoff(days: int, now: dt.datetime) -> dt.date:
    """The first date kept: `days` before today (UTC), so 7 on 2026-11-27 keeps 11-20 .. 11-27."""
    return now.astimezone(dt.timezone.utc).date() - dt.timedelta(days=days)


def prune(data: str, days: int, *, now: dt.datetime | None = None, storage_options: dict | None = None,
          dry_run: bool = False) -> Pruned:
    """Remove every date partition of the lake at `data` older than `days` before
    `now` (UTC), and the rest of the traces that started in them. `days` 0: nothing."""
    now = now or dt.datetime.now(dt.timezone.utc)
    first = cutoff(days, now)
    result = Pruned(first.isoformat(), days, dry_run=dry_run)
    if days <= 0:
        return result
    fs, root = fsspec.core.url_to_fs(data, **(storage_options or {}))
    root = root.rstrip("/")
    try:
        with output.held(fs, root):
            _prune(fs, root, first, result, dry_run)
    except output.Busy as e:
        raise RetentionError(f"{e}; prune after it") from None
    return result


def _prune(fs, root: str, first: dt.date, result: Pruned, dry_run: bool) -> None:
    old: dict[str, dict[str, list[dict]]] = {}  # dataset -> date -> its files' listing entries
    kept: dict[str, dict[str, list[dict]]] = {}
    leftovers: list[str] = []
    for name in DATASETS:
        old[name], kept[name] = {}, {}
        for date, entries in _partitions(fs, layout.folder(root, name), leftovers).items():
            (old if dt.date.fromisoformat(date) < first else kept)[name][date] = entries
        result.dates[name] = sorted(old[name])
    if leftovers and not dry_run:  # a rewrite a crash stopped before its rename: never read, never renamed now
        fs.rm(leftovers)
    gone = _trace_ids(fs, [e for entries in old[layout.SPANS].values() for e in entries])
    if len(gone):
        # 1. the kept dates' rows of traces that started before the cutoff (first: a crash after
        # it leaves the old dates, which say again which traces those are)
        cut: set[str] = set()
        for name in BY_TRACE:
            for date, entries in sorted(kept[name].items()):
                for entry in entries:
                    removed, traces = _without(fs, entry, gone, dry_run)
                    if removed:
                        result.rewritten += 1
                        result.rows += removed
                        cut |= traces
        result.traces = len(cut)
    # 2. the old dates, raw datasets first, the transitions built from them last
    for name in DATASETS:
        for date, entries in sorted(old[name].items()):
            result.files += len(entries)
            result.bytes += sum(int(e.get("size") or 0) for e in entries)
            if not dry_run:
                _remove_partition(fs, layout.partition_folder(root, name, date), entries)
    if not dry_run and any(result.dates.values()):
        log.info("%s", "; ".join(result.lines()))


def _partitions(fs, base: str, leftovers: list[str]) -> dict[str, list[dict]]:
    """A dataset's date partitions and the Parquet files in each (listing entries);
    a rewrite's file that a crash left goes to `leftovers`. A partition folder whose
    name is no date is refused: guessing what to keep would be worse than saying so."""
    out: dict[str, list[dict]] = {}
    if not fs.exists(base):
        return out
    for entry in fs.ls(base, detail=True):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        date = layout.partition_date(name)
        if entry["type"] != "directory" or date is None:
            continue  # the build's scratch and lock, a user's README: not a partition
        try:
            dt.date.fromisoformat(date)
        except ValueError:
            raise NotADate(f"{entry['name']}: a partition whose name is not a date YYYY-MM-DD; rename or remove "
                           "it, nothing was pruned") from None
        listed = [f for f in fs.ls(entry["name"], detail=True) if f["type"] == "file"]
        out[date] = [f for f in listed if f["name"].endswith(layout.SUFFIX)]
        leftovers += [f["name"] for f in listed if f["name"].endswith(TMP)]
    return out


def _trace_ids(fs, entries: list[dict]) -> pa.Array:
    """The distinct trace ids in these span files (their `trace_id` column alone).
    A file that cannot be read is pruned all the same; its traces are not known."""
    ids = []
    # ParquetFile(...).read, never pq.read_table, on a file object: read_table's pre-buffered
    # reads leave I/O threads that abort the process at exit (pyarrow 26: 1 exit in 4 here)
    for e in entries:
        try:
            with fs.open(e["name"], "rb") as f:
                ids.append(pq.ParquetFile(f).read(columns=["trace_id"]).column("trace_id").combine_chunks())
        except (pa.ArrowException, OSError, KeyError) as err:
            log.warning("%s: its trace ids cannot be read (%s); the rest of its traces in later dates is kept", e["name"],
                        err)
    if not ids:
        return pa.array([], pa.string())
    return pc.unique(pa.concat_arrays([a.cast(pa.string()) for a in ids]).drop_null())


def _without(fs, entry: dict, gone: pa.Array, dry_run: bool) -> tuple[int, set[str]]:
    """Rewrite one kept file without the rows of the traces in `gone` (removed when
    nothing else is left), a row group at a time: a collector's file can hold a
    64 MiB segment's spans, several times that once decompressed. Returns the rows
    removed and their traces."""
    path = entry["name"]
    try:
        with fs.open(path, "rb") as f:
            ids = pq.ParquetFile(f).read(columns=["trace_id"]).column("trace_id")
    except (pa.ArrowException, OSError, KeyError) as err:
        log.warning("%s: cannot be read (%s); left as it is", path, err)
        return 0, set()
    hit = pc.is_in(ids, value_set=gone)
    removed = pc.sum(hit).as_py() or 0
    if not removed:
        return 0, set()
    traces = set(pc.unique(pc.filter(ids, hit)).to_pylist())
    if dry_run:
        return removed, traces
    if removed == len(ids):
        fs.rm(path)
        return removed, traces
    local = output.is_local(fs)
    folder, name = path.rsplit("/", 1)
    # beside the file locally (a rename then swaps it in), else in the machine's scratch (then one upload)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=TMP, dir=folder if local else None)
    os.close(fd)
    try:
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            md = pf.metadata
            with pq.ParquetWriter(tmp, pf.schema_arrow, **written_as(md)) as w:
                for i in range(md.num_row_groups):
                    group = pf.read_row_group(i)
                    group = group.filter(pc.invert(pc.is_in(group.column("trace_id"), value_set=gone)))
                    if group.num_rows:
                        w.write_table(group, row_group_size=group.num_rows)
    except BaseException:
        os.remove(tmp)
        raise
    output.place(fs, tmp, path)
    return removed, traces


def _remove_partition(fs, folder: str, entries: list[dict]) -> None:
    """The partition's Parquet files, then the folder if nothing else is in it (a
    collector's file being written keeps it: the next prune takes what it commits)."""
    if entries:
        fs.rm([e["name"] for e in entries])
    if output.is_local(fs):
        try:
            fs.rmdir(folder)
        except OSError:
            log.info("%s: not empty after its Parquet files went (a write in flight?), left", folder)
