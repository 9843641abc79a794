"""Writes Arrow tables into hive-partitioned Parquet datasets (a local folder, or
any fsspec URL), each key stored once.

A batch (one WAL segment, or one ingested file) is written as one file per date
partition, named after the batch, so that redoing a batch after a crash rewrites
the same files instead of adding new ones. Local files appear atomically
(temporary name, fsync, rename, fsync of the folder); object stores make a put
visible only when complete.

Deduplication keeps, per partition, 128 bits of hash of each stored key in memory
(two 64-bit hashes with different seeds) as sorted numpy arrays, one per batch,
searched with `searchsorted`: 16 bytes a key and lookups that cost the batch, not
the partition. The partition's existing files are read once, the first time it is
touched (files of batches about to be rewritten left out). A long-running
collector bounds memory with `window_s`: keys are forgotten that long after they
were loaded or written, which still covers every OTLP client's resend (their
retry window is about 10 s); `nightshift ingest` keeps whole partitions, and so
do the datasets of `KEEP_ALL_KEYS` (feedback) whatever the window.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import DATASETS, layout
from nightshift.storage import fsync

from .keyhash import row_hashes
from .localfs import LocalFiles, local_root

log = logging.getLogger("nightshift.collector.datasets")

EVICT_AFTER_S = 900.0
BUDGET_WARN_EVERY_S = 600.0

#: How every dataset file is written, chosen by measurement on the ingest
#: benchmark's spans (benchmarks/ingest.py prints the trade-off): zstd level 1
#: writes 240 MB/s of spans to 0.28 of their protobuf size; level 3 is 20 % slower
#: for 0.26, snappy 1.6x faster for 0.37. A flush chunk is one row group.
PARQUET_OPTIONS = dict(compression="zstd", compression_level=1)
#: The codecs `collector.compression` offers. Measured on the flusher's own chunks
#: (4 MiB, 2026-11-26, CPU-seconds per 100k spans / file size over the protobuf's):
#: 1 KB spans zstd 0.60 / 0.14, lz4 0.53 / 0.22, snappy 0.51 / 0.23, none 0.48 /
#: 0.90; 5 KB spans zstd 2.41 / 0.27, lz4 1.62 / 0.40, snappy 1.38 / 0.36, none
#: 1.01 / 0.98 (zstd's negative levels were no faster). zstd stays the default: a
#: lake kept a week and read by every build pays for the 1.3-1.6x larger files
#: every day, while the flusher's CPU is spent only at peaks (the 5 KB flush goes
#: from 5.3 to 4.3 CPU-seconds per 100k spans with snappy, the 1 KB one by 5 %).
#: lz4 is asked for as `lz4_raw`, the Parquet format's current LZ4 codec (pyarrow
#: names either "LZ4" in a file's metadata); same speed, measured.
CODECS = {"zstd": PARQUET_OPTIONS, "snappy": dict(compression="snappy"), "lz4": dict(compression="lz4_raw"),
          "none": dict(compression="none")}
ROW_GROUP_ROWS = 1 << 20
#: Columns worth a dictionary: attribute keys and value types repeat on every row;
#: message content never does, and trying costs 10 % of the write.
_DICT_LEAVES = (".key", ".value.type")
_DICT_COLUMNS = frozenset({"kind", "status_code", "service_name", "scope_name", "scope_version", "event_name",
                           "severity_text", "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model",
                           "gen_ai_response_model", "gen_ai_agent_name", "source", "name"})
#: Columns readers filter on get min/max statistics (row groups skipped by id,
#: time, model); the large ones would only cost.
_STATS_COLUMNS = frozenset({"trace_id", "span_id", "parent_span_id", "record_id", "label_id", "name", "kind",
                            "start_time", "end_time", "time", "observed_time", "received_time", "status_code",
                            "service_name", "scope_name", "event_name", "severity_number", "gen_ai_operation_name",
                            "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "gen_ai_agent_name",
                            "gen_ai_conversation_id"})


def parquet_options(schema: pa.Schema, compression: str = "") -> dict:
    """The codec's options (`CODECS`, zstd when not given) with the dictionary and
    statistics columns of `schema`."""
    leaves = _leaf_paths(schema)
    return {**CODECS[compression or PARQUET_OPTIONS["compression"]],
            "use_dictionary": [p for p in leaves if p.endswith(_DICT_LEAVES) or p in _DICT_COLUMNS],
            "write_statistics": [p for p in leaves if p in _STATS_COLUMNS]}


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """Parquet column paths (`attributes.list.element.key`) of an Arrow schema."""
    out: list[str] = []

    def walk(prefix: str, t: pa.DataType) -> None:
        if pa.types.is_struct(t):
            for f in t:
                walk(f"{prefix}.{f.name}", f.type)
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            walk(f"{prefix}.list.element", t.value_type)
        else:
            out.append(prefix)

    for f in schema:
        walk(f.name, f.type)
    return out

#: Datasets whose keys are never forgotten while their partition is in memory:
#: labels are few, and a label's id is a client's idempotency key, resent at any
#: time, not only within an exporter's retry window.
KEEP_ALL_KEYS = frozenset({"feedback"})


def part_name(batch_id: str) -> str:
    return layout.batch_file(batch_id)


def _hashes(keys: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    return row_hashes(keys)


@dataclass
class _Frame:
    h1: np.ndarray  # sorted
    h2: np.ndarray  # in h1's order
    added: float

    @classmethod
    def of(cls, hashes: tuple[np.ndarray, np.ndarray], added: float) -> "_Frame":
        h1, h2 = hashes
        order = np.argsort(h1, kind="stable")
        return cls(h1[order], h2[order], added)

    def contains(self, q1: np.ndarray, q2: np.ndarray) -> np.ndarray:
        if len(self.h1) == 0:
            return np.zeros(len(q1), dtype=bool)
        found = np.zeros(len(q1), dtype=bool)
        pos = np.searchsorted(self.h1, q1, side="left")
        # Equal h1 values sit side by side; walk them (almost always one step).
        active = np.ones(len(q1), dtype=bool)
        while active.any():
            p = np.minimum(pos, len(self.h1) - 1)
            same1 = active & (pos < len(self.h1)) & (self.h1[p] == q1)
            found |= same1 & (self.h2[p] == q2)
            active = same1 & ~found
            pos = pos + 1
        return found


def _merged(older: _Frame, newer: _Frame) -> _Frame:
    """One frame of both: forgotten with the newer (a key may be kept a little past
    the window, never dropped early)."""
    h1, h2 = np.concatenate([older.h1, newer.h1]), np.concatenate([older.h2, newer.h2])
    order = np.argsort(h1, kind="stable")  # two sorted runs: a merge
    return _Frame(h1[order], h2[order], max(older.added, newer.added))


#: Keys a merged frame holds at most, when no budget sets it (`DatasetStore.merge_cap`).
MERGE_CAP_KEYS = 1 << 20


@dataclass
class _Index:
    frames: list[_Frame] = field(default_factory=list)
    used: float = field(default_factory=time.monotonic)

    def add(self, frame: _Frame, cap_keys: int) -> None:
        """A frame appended, then merged with the ones before it while they are no
        larger, up to `cap_keys` (a binary counter of frames). A lookup searches
        every frame, and a frame was kept per flushed segment: a sidecar flushing
        every 0.5 s held up to 1,200 within the 600 s window, and the 25 chunks of a
        100k-span segment searched each other's (quadratic), measured 0.42 CPU-s
        per 100k spans at 40 frames (a quarter of the flush), 2.7 at 400; merged,
        a few times log2 of the keys held."""
        frames = self.frames
        frames.append(frame)
        while (len(frames) >= 2 and len(frames[-2].h1) <= len(frames[-1].h1)
               and len(frames[-2].h1) + len(frames[-1].h1) <= cap_keys):
            newer = frames.pop()
            frames[-1] = _merged(frames[-1], newer)

    def contains(self, hashes: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        q1, q2 = hashes
        if len(self.frames) > 1:  # searched in order, each search starts where the last ended
            order = np.argsort(q1)
            q1, q2 = q1[order], q2[order]
        out = np.zeros(len(q1), dtype=bool)
        for f in self.frames:
            out |= f.contains(q1, q2)
        if len(self.frames) > 1:
            found = np.empty_like(out)
            found[order] = out
            return found
        return out

    def trim(self, window_s: float | None) -> None:
        if window_s is None:
            return
        cutoff = time.monotonic() - window_s
        self.frames = [f for f in self.frames if f.added >= cutoff]


@dataclass
class WriteStats:
    rows: int = 0
    duplicates: int = 0
    files: list[str] = field(default_factory=list)


def _concat(frames: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not frames:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return np.concatenate([f[0] for f in frames]), np.concatenate([f[1] for f in frames])


def _first_of_each(h1: np.ndarray, h2: np.ndarray) -> np.ndarray:
    """Positions of each key's first row, in row order: a key sent twice in one
    batch is stored once. Sorted by (h1, h2) as two uint64 keys, not as 16-byte
    records: numpy compares those byte by byte, 4 % of a flush's CPU."""
    if len(h1) < 2:
        return np.arange(len(h1))
    order = np.lexsort((np.arange(len(h1)), h2, h1))  # ties in row order: the first stays first
    a1, a2 = h1[order], h2[order]
    repeat = np.zeros(len(order), dtype=bool)
    repeat[1:] = (a1[1:] == a1[:-1]) & (a2[1:] == a2[:-1])
    if not repeat.any():
        return np.arange(len(h1))
    return np.sort(order[~repeat])


def _dates(times_ns) -> tuple[np.ndarray, list[str]]:
    """Each row's UTC day as a code into the distinct dates (`YYYY-MM-DD`), those
    first seen first. Days are counted in integers and only the distinct ones are
    spelled: a batch holds one or two days, not a string per row."""
    days = np.floor_divide(np.asarray(times_ns, dtype=np.int64), _DAY_NS)
    if len(days) and (days == days[0]).all():
        return np.zeros(len(days), dtype=np.int64), [_day_name(int(days[0]))]
    distinct, first, codes = np.unique(days, return_index=True, return_inverse=True)
    order = np.argsort(first)  # distinct days renumbered in order of appearance
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[codes.ravel()], [_day_name(int(d)) for d in distinct[order]]


_DAY_NS = 86_400 * 1_000_000_000
_EPOCH = datetime.date(1970, 1, 1)


def _day_name(day: int) -> str:
    return (_EPOCH + datetime.timedelta(days=day)).isoformat()


class PartitionedWriter:
    """One open batch: `add()` chunks, then `commit()`; `abort()` on failure."""

    def __init__(self, store: "DatasetStore", dataset: str, batch_id: str):
        self.store, self.dataset, self.batch_id = store, dataset, batch_id
        self.schema = DATASETS[dataset].SCHEMA
        self.key = list(DATASETS[dataset].KEY)
        self._writers: dict[str, tuple[pq.ParquetWriter, object, str, str]] = {}
        self._pending: dict[str, _Index] = {}  # keys this batch wrote, per date: one sorted frame a chunk
        self.stats = WriteStats()

    def add(self, table: pa.Table, times_ns: list[int]) -> None:
        if table.num_rows == 0:
            return
        codes, names = _dates(times_ns)
        h1, h2 = _hashes(table.select(self.key))
        for code, date in enumerate(names):
            rows = np.arange(len(codes)) if len(names) == 1 else np.flatnonzero(codes == code)
            index = self.store.index(self.dataset, date, self.batch_id)
            arrived = len(rows)
            rows = rows[_first_of_each(h1[rows], h2[rows])]
            g = (h1[rows], h2[rows])
            seen = index.contains(g)
            pending = self._pending.setdefault(date, _Index())
            if pending.frames:
                seen |= pending.contains(g)
            rows = rows[~seen]
            self.stats.duplicates += arrived - len(rows)
            if len(rows) == 0:
                continue
            # Sorted once per chunk, not all of the batch again for every chunk
            # (that was quadratic in a segment's chunks: 8 % of a flush's CPU).
            pending.add(_Frame.of((h1[rows], h2[rows]), 0.0), MERGE_CAP_KEYS)
            if len(rows) == table.num_rows:  # the common case: one day, nothing seen before
                part = table
            else:
                part = table.take(pa.array(rows, pa.int64()))
            self._writer(date).write_table(part, row_group_size=ROW_GROUP_ROWS)
            self.stats.rows += part.num_rows

    def _writer(self, date: str) -> pq.ParquetWriter:
        if date not in self._writers:
            final = f"{layout.partition_folder(self.store.root, self.dataset, date)}/{part_name(self.batch_id)}"
            self.store.files.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = final if not self.store.local else f"{final}.tmp-{uuid.uuid4().hex[:8]}"
            f = self.store.files.open(tmp, "wb")
            w = pq.ParquetWriter(f, self.schema, **parquet_options(self.schema, self.store.compression))
            self._writers[date] = (w, f, tmp, final)
        return self._writers[date][0]

    def commit(self) -> WriteStats:
        for date, (w, f, tmp, final) in sorted(self._writers.items()):
            w.close()
            if self.store.local:
                f.flush()
                os.fsync(f.fileno())  # a real file, or fsspec's LocalFileOpener around one
                f.close()
                os.replace(tmp, final)
                fsync(os.path.dirname(final))
            else:
                f.close()
            self.stats.files.append(final)
        for date, pending in self._pending.items():
            if pending.frames:
                self.store.remember(self.dataset, date, [(f.h1, f.h2) for f in pending.frames])
        self._writers.clear()
        return self.stats

    def abort(self) -> None:
        for w, f, tmp, final in self._writers.values():
            try:
                if self.store.local:
                    w.close()
                    f.close()
                    if self.store.files.exists(tmp):
                        self.store.files.rm(tmp)
                elif hasattr(f, "discard"):
                    # Closing an object-store file uploads it: throw it away instead,
                    # so a part-written file never shows under its final name.
                    try:
                        f.discard()
                    finally:
                        f.closed = True  # and nothing (not even its finalizer) uploads it
                        w.close()
                else:
                    w.close()
                    f.close()
            except Exception:  # noqa: BLE001 - best effort; the batch is redone
                pass
        self._writers.clear()


class DatasetStore:
    """The `<data>` root: where datasets live, and which keys they hold."""

    def __init__(self, url: str, storage_options: dict | None = None, exclude_batches=lambda: set(),
                 window_s: float | None = None, key_budget: int = 0, compression: str = ""):
        self.url = url
        local = local_root(url, storage_options)
        if local is not None:  # os calls, no fsspec: 6 MiB of a sidecar's flusher (localfs)
            self.files, self.root, self._fs = LocalFiles(), local, None
        else:
            import fsspec

            self._fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
            self.files, self.root = self._fs, root.rstrip("/")
        self.local = local is not None or "file" in (
            self._fs.protocol if isinstance(self._fs.protocol, tuple) else (self._fs.protocol,))
        if self.local and local is None:
            self.root = os.path.abspath(self.root)
        self._exclude_batches = exclude_batches  # batch ids whose files are not final yet
        self._index: dict[tuple[str, str], _Index] = {}
        self.window_s = window_s
        self.key_budget = key_budget  # bytes of windowed keys held at most; 0: the window alone bounds them
        # Merged frames of at most an eighth of the budget: past it the oldest go an
        # eighth at a time, not half the keys at once.
        self.merge_cap = max(1, key_budget // 128) if key_budget else MERGE_CAP_KEYS
        if compression and compression not in CODECS:
            raise ValueError(f"compression {compression!r} is not one of {', '.join(CODECS)}")
        self.compression = compression or PARQUET_OPTIONS["compression"]
        self._budget_warned = -float("inf")
        self.files.makedirs(self.root, exist_ok=True)

    @property
    def fs(self):
        """The root's fsspec filesystem, for callers that want its whole API
        (made on first use when the root is a local folder)."""
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("file")
        return self._fs

    def writer(self, dataset: str, batch_id: str) -> PartitionedWriter:
        self._evict()
        return PartitionedWriter(self, dataset, batch_id)

    def index(self, dataset: str, date: str, current_batch: str) -> _Index:
        key = (dataset, date)
        idx = self._index.get(key)
        if idx is None:
            loaded = self._load(dataset, date, {current_batch} | set(self._exclude_batches()))
            idx = _Index([_Frame.of(loaded, time.monotonic())])
            self._index[key] = idx
        idx.used = time.monotonic()
        return idx

    def remember(self, dataset: str, date: str, frames: list[tuple[np.ndarray, np.ndarray]]) -> None:
        idx = self._index[(dataset, date)]
        idx.add(_Frame.of(_concat(frames), time.monotonic()), self.merge_cap)
        idx.trim(None if dataset in KEEP_ALL_KEYS else self.window_s)
        if self.key_budget:
            self._hold_to_budget()

    def _hold_to_budget(self) -> None:
        """The oldest windowed keys forgotten while they hold more than
        `key_budget` bytes (the newest batch's always kept). The window bounds keys
        by time, so their memory grows with the rate: 600 s at 50k spans/s is 30M
        keys, 480 MB, three times a sidecar's whole budget. Past the budget a resend
        older than what is still held is stored twice (the build keeps one copy of a
        span); nothing is lost."""
        frames = [(f.added, idx, f) for (dataset, _), idx in self._index.items() if dataset not in KEEP_ALL_KEYS
                  for f in idx.frames]
        held = sum(f.h1.nbytes + f.h2.nbytes for _, _, f in frames)
        if held <= self.key_budget:
            return
        frames.sort(key=lambda x: x[0])
        newest = frames[-1][2]
        for added, idx, f in frames[:-1]:
            if held <= self.key_budget:
                break
            idx.frames = [g for g in idx.frames if g is not f]
            held -= f.h1.nbytes + f.h2.nbytes
        kept = min((g.added for _, idx, _ in frames for g in idx.frames), default=newest.added)
        now = time.monotonic()
        if now - self._budget_warned > BUDGET_WARN_EVERY_S:
            self._budget_warned = now
            log.warning("the duplicate check holds the keys of the last %.0f s, not %.0f s: they filled its %d MiB "
                        "(collector.dedup_memory); a span resent later than that is stored twice",
                        now - kept, self.window_s or float("inf"), self.key_budget >> 20)

    def _load(self, dataset: str, date: str, exclude: set[str]) -> tuple[np.ndarray, np.ndarray]:
        folder = layout.partition_folder(self.root, dataset, date)
        skip = {part_name(b) for b in exclude}
        try:
            files = [p for p in self.files.ls(folder, detail=False) if p.endswith(layout.SUFFIX)]
        except FileNotFoundError:
            files = []
        files = [p for p in files if os.path.basename(p) not in skip]
        key = list(DATASETS[dataset].KEY)
        frames = []
        budget = self.key_budget if dataset not in KEEP_ALL_KEYS else 0
        if budget:  # a restart into a full day reads the newest files only, not a day of keys
            files = self._newest_first(files)
        held = 0
        for i, p in enumerate(files):
            if budget and held >= budget:
                log.info("%s %s: the duplicate check knows the keys of the newest %d of %d files (collector.dedup_memory)",
                         dataset, layout.partition(date), i, len(files))
                break
            try:
                if self._fs is None:  # a local file: Arrow reads it itself
                    t = pq.read_table(p, columns=key)
                else:
                    with self.files.open(p, "rb") as f:
                        t = pq.ParquetFile(f).read(columns=key)
            except (pa.ArrowException, OSError) as e:
                # A torn or foreign file (a user's partial copy) must not stop every
                # flush into its date, which would fill the WAL and turn agents away:
                # skipped, as the build skips it. Its keys, if any, are not known, so
                # a span resent now that is only in it may be stored twice.
                log.warning("%s: not a readable Parquet file with the %s key (%s), left out of the duplicate check "
                            "of %s %s", p, ", ".join(key), e, dataset, layout.partition(date))
                continue
            frames.append(_hashes(t))
            held += frames[-1][0].nbytes + frames[-1][1].nbytes
        return _concat(frames)

    def _newest_first(self, files: list[str]) -> list[str]:
        def modified(p: str) -> float:
            try:
                return os.path.getmtime(p) if self._fs is None else self._fs.modified(p).timestamp()
            except (OSError, NotImplementedError, AttributeError, ValueError):
                return 0.0

        return sorted(files, key=modified, reverse=True)

    def _evict(self) -> None:
        now = time.monotonic()
        for k in [k for k, v in self._index.items() if now - v.used > max(EVICT_AFTER_S, self.window_s or 0)]:
            del self._index[k]
