"""The lake's small files merged: a collector seals a segment every
`flush_interval` (10 s) whatever its size, so a quiet sidecar writes a file per
dataset every 10 s, 8,640 a day, and a thousand of them 8.6 million: the build
then spends its night opening footers, and an object store bills each GET. Once a
date is over (UTC), its small files are merged into files of about
`compaction.target_bytes`, their rows in the same order, in row groups of a
useful size.

Each merge is safe to stop anywhere, and a reader never sees a row missing:
1. the merged file is written under a temporary name (locally beside its inputs,
   else in the machine's scratch);
2. a journal (`<partition>/.compact-<id>.json`: the output's name and its inputs);
3. the merged file put in place (a rename locally, one upload on an object store);
4. the inputs are deleted, then the journal.
Between 3 and 4 a reader sees the group's rows twice, which the build (and
`doctor`) already takes once: one span per trace and span id, one log record per
record id, one feedback per feedback id, the rule a collector's retry relies on
(`nightshift show` counts rows as stored, twice there). The next compaction finishes what a journal names: the inputs
deleted when its output is there, the journal dropped when it is not.

The next build, incremental or full, makes the same rows (the incremental build
sees the inputs gone and the output new, and redoes that date). Local lakes are
compacted under the build's lock; on an object store, run it where the build runs
(the nightly job compacts before it builds). Only files of one schema are merged
together (a lake written by two Nightshift versions keeps each version's files
apart), and a date's files are merged once: what is left is big enough to stay.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import layout
from nightshift.storage import write_atomic

from . import output
from .config import CompactionConfig  # noqa: F401  (its settings: here for callers)

log = logging.getLogger("nightshift.compaction")

#: The datasets collectors write a file at a time (the transitions are one file a date already).
DATASETS = (layout.SPANS, layout.LOGS, layout.FEEDBACK)
JOURNAL = ".compact-"
#: Rows are written in row groups of about this many bytes (Arrow's, uncompressed): the
#: collector's chunks are 2 MiB; a quiet sidecar's files hold a few KB.
GROUP_BYTES = 8 << 20


@dataclass
class Compacted:
    """What a compaction merged (or, dry, would merge)."""

    before: str  # dates before this one were looked at
    merged: dict[str, int] = field(default_factory=dict)  # per dataset, files merged
    written: dict[str, int] = field(default_factory=dict)  # per dataset, files they became
    dates: dict[str, list[str]] = field(default_factory=dict)  # per dataset, dates touched
    bytes: int = 0  # of the files merged
    finished: int = 0  # merges a crash had stopped, finished now
    dry_run: bool = False

    def lines(self) -> list[str]:
        verb = "would merge" if self.dry_run else "merged"
        head = f"compaction: the small files of dates before {self.before}"
        body = [f"  {name}: {verb} {self.merged[name]:,} file(s) into {self.written[name]:,}, in {len(d)} date(s) "
                f"({d[0]} .. {d[-1]})" for name in DATASETS if (d := self.dates.get(name))]
        if self.finished:
            body.append(f"  finished {self.finished} merge(s) a crash had stopped")
        if not body:
            return [head, "  nothing to merge"]
        return [head, *body, f"  {self.bytes / 2**20:.1f} MiB merged"]


def compact(data: str, *, target_bytes: int = 64 << 20, before: dt.date | None = None,
            storage_options: dict | None = None, dry_run: bool = False) -> Compacted:
    """Merge the small files of every date before `before` (default: today, UTC)."""
    before = before or dt.datetime.now(dt.timezone.utc).date()
    result = Compacted(before.isoformat(), dry_run=dry_run)
    fs, root = fsspec.core.url_to_fs(data, **(storage_options or {}))
    root = root.rstrip("/")
    with output.held(fs, root):
        for name in DATASETS:
            result.merged[name] = result.written[name] = 0
            base = layout.folder(root, name)
            if not fs.exists(base):
                continue
            for entry in sorted(fs.ls(base, detail=True), key=lambda e: e["name"]):
                date = layout.partition_date(entry["name"])
                if entry["type"] != "directory" or date is None:
                    continue
                try:
                    day = dt.date.fromisoformat(date)
                except ValueError:
                    continue  # not a partition a reader reads either
                if not dry_run:
                    result.finished += _finish(fs, entry["name"])
                if day >= before:
                    continue
                groups = _partition(fs, entry["name"], fs.ls(entry["name"], detail=True), target_bytes, dry_run)
                for group in groups:
                    result.merged[name] += len(group)
                    result.written[name] += 1
                    result.bytes += sum(int(e["size"]) for e in group)
                if groups:
                    result.dates.setdefault(name, []).append(date)
    if not dry_run and any(result.dates.values()):
        log.info("%s", "; ".join(result.lines()))
    return result


@dataclass
class _Run:
    """Files being merged into one, in name order; written once a second file joins."""

    schema: pa.Schema
    inputs: list[dict]
    size: int
    writer: pq.ParquetWriter | None = None
    tmp: str = ""
    pending: list[pa.Table] = field(default_factory=list)
    held: int = 0


def _partition(fs, folder: str, listing: list[dict], target_bytes: int, dry_run: bool) -> list[list[dict]]:
    """Merge one partition's small Parquet files (under half of `target_bytes`), in
    name order (the collector's names follow its segments), into runs of at most
    `target_bytes` of one schema; a run of one file stays as it is. Each file is
    opened once (on an object store, a GET each): the run's choice and its copy read
    the same footer. Returns the merged runs' inputs."""
    small = sorted((e for e in listing if e["type"] == "file" and e["name"].endswith(layout.SUFFIX)
                    and int(e.get("size") or 0) < target_bytes // 2), key=lambda e: e["name"])
    if len(small) < 2:
        return []
    done: list[list[dict]] = []
    run: _Run | None = None
    for e in small:
        size = int(e["size"])
        try:  # a torn or foreign file is skipped (the build names it); only reading is tried here
            with fs.open(e["name"], "rb") as f:
                pf = pq.ParquetFile(f)
                schema, options = pf.schema_arrow, written_as(pf.metadata)
                joins = run is not None and run.size + size <= target_bytes and schema.equals(run.schema,
                                                                                            check_metadata=True)
                rows = _read(pf) if joins and not dry_run else []
                first = _read_path(fs, run.inputs[0]) if joins and not dry_run and run.writer is None else None
        except (pa.ArrowException, OSError) as err:
            log.warning("%s: not a readable Parquet file (%s), left out of compaction", e["name"], err)
            continue
        if not joins:
            if run is not None:
                done += _close(fs, folder, run)
            run = _Run(schema, [e], size)
            continue
        if first is not None:  # a second file: the run is written from here, its first file's rows first
            fd, run.tmp = tempfile.mkstemp(prefix=f".{_name(run.inputs[0])}.", suffix=".tmp",
                                           dir=folder if output.is_local(fs) else None)
            os.close(fd)
            run.writer = pq.ParquetWriter(run.tmp, schema, **options)
            _add(run, first)
        if not dry_run:
            _add(run, rows)
        run.inputs.append(e)
        run.size += size
    if run is not None:
        done += _close(fs, folder, run)
    return done


def _read(pf: pq.ParquetFile) -> list[pa.Table]:
    """A file's row groups, all of them before any is written: a file that fails part
    way adds nothing to a run."""
    return [pf.read_row_group(i) for i in range(pf.metadata.num_row_groups)]


def _read_path(fs, entry: dict) -> list[pa.Table]:
    with fs.open(entry["name"], "rb") as f:
        return _read(pq.ParquetFile(f))


def _name(entry: dict) -> str:
    return entry["name"].rstrip("/").rsplit("/", 1)[-1]


def _add(run: _Run, tables: list[pa.Table]) -> None:
    """Rows into the run's file, in row groups of about GROUP_BYTES."""
    for t in tables:
        run.pending.append(t)
        run.held += t.nbytes
        if run.held >= GROUP_BYTES:
            _write_group(run.writer, run.pending)
            run.pending, run.held = [], 0


def _close(fs, folder: str, run: _Run) -> list[list[dict]]:
    """Put a run's merged file in place of its inputs (the journal first), or nothing
    for a run of one file. Dry (no writer) only says which inputs it would merge."""
    if run.writer is None:  # one file (nothing to merge), or a dry run
        return [run.inputs] if len(run.inputs) > 1 else []
    names = [_name(e) for e in run.inputs]
    # named after its first input, so it sorts where they did; the hash keeps two merges apart
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
    out = f"{names[0][:-len(layout.SUFFIX)]}.c{digest}{layout.SUFFIX}"
    journal = f"{folder}/{JOURNAL}{digest}.json"
    local = output.is_local(fs)
    try:
        _write_group(run.writer, run.pending)
        run.writer.close()
        body = json.dumps({"output": out, "inputs": names})
        write_atomic(journal, body) if local else fs.pipe(journal, body.encode())
        output.place(fs, run.tmp, f"{folder}/{out}")
    finally:
        if os.path.exists(run.tmp):
            os.remove(run.tmp)
    fs.rm([e["name"] for e in run.inputs])
    fs.rm(journal)
    return [run.inputs]


def written_as(md: pq.FileMetaData) -> dict:
    """ParquetWriter's options as the file was written: its codec, and dictionaries and
    statistics on the columns that had them (the collector chooses a few of each:
    a dictionary tried on message text costs a tenth of the write for nothing)."""
    if not md.num_row_groups:
        return {"compression": "zstd"}
    group = md.row_group(0)
    cols = [group.column(i) for i in range(group.num_columns)]
    codec = cols[0].compression.lower()
    return {"compression": "none" if codec == "uncompressed" else codec,
            "use_dictionary": [c.path_in_schema for c in cols if any("DICTIONARY" in e for e in c.encodings)],
            "write_statistics": [c.path_in_schema for c in cols if c.is_stats_set]}


def _write_group(writer: pq.ParquetWriter, tables: list[pa.Table]) -> None:
    if tables:
        t = pa.concat_tables(tables)
        writer.write_table(t, row_group_size=max(t.num_rows, 1))


def _finish(fs, folder: str) -> int:
    """Finish the merges a crash stopped in this partition: inputs deleted where the
    output is there, the journal dropped where it is not (the inputs are whole)."""
    done = 0
    for entry in fs.ls(folder, detail=True):
        name = entry["name"].rsplit("/", 1)[-1]
        if entry["type"] != "file":
            continue
        if name.startswith(".") and name.endswith(".tmp") and JOURNAL not in name and output.is_local(fs):
            fs.rm(entry["name"])  # a merged file a crash left before its rename
            continue
        if not (name.startswith(JOURNAL) and name.endswith(".json")):
            continue
        try:
            with fs.open(entry["name"], "rb") as f:
                j = json.loads(f.read())
            out, inputs = j["output"], list(j["inputs"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s: a compaction journal that cannot be read; its inputs are left as they are", entry["name"])
            fs.rm(entry["name"])
            continue
        if fs.exists(f"{folder}/{out}"):
            gone = [f"{folder}/{n}" for n in inputs if fs.exists(f"{folder}/{n}")]
            if gone:
                fs.rm(gone)
        fs.rm(entry["name"])
        done += 1
    return done
