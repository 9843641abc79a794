"""The flusher: sealed WAL segments to Parquet datasets, then deletes them.

It runs as a thread of the receiver's process when the data is a folder (one
interpreter: the sidecar's memory) and in its own process when the data is an
object store, whose uploads can hang and only a process can be killed and redone
(`collector.flusher: auto`; `process` and `thread` choose either everywhere; see
`flusher_thread`). A segment is deleted only after every file made
from it is durable; a flush that dies half-way is redone from the segment, and
rewrites the same file names, so it adds no duplicate rows.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest

from nightshift.schemas import layout
from nightshift.storage import fsync

from . import failpoints, feedback, wal
from .convert import LogBuilder, SpanBuilder
from .datasets import DatasetStore
from .feedback_table import FeedbackBuilder
from .flusher_stats import (DUPLICATES, ERRORS, FEEDBACK, FLUSH_STARTED_S, LAST_FLUSH_S, LOGS, OLDEST_PENDING_NS,
                            SEGMENTS, SPANS)

log = logging.getLogger("nightshift.collector.flusher")

#: Payload bytes converted at a time: bounds the flusher's memory whatever the
#: segment size (each chunk becomes a row group of the segment's file). Measured
#: on 1 KB and 5 KB spans (issue 28): the conversion's peak is about 7x the chunk
#: (ptars' arrays and numpy's, outside Arrow's pool), so 8 MiB chunks peaked 57-72
#: MiB above the flusher's 82 MiB of imports, 4 MiB 41-47 MiB, 2 MiB 35-38 MiB;
#: spans per CPU-second were the same at 4 and 8 MiB and 12-20 % lower at 2 MiB
#: (each chunk pays ~3 ms of conversion and ~3.5 ms of row group before its first
#: span). 2 MiB since 2026-11-27 (`collector.flush_chunk_bytes`): the sidecar's
#: 150 MB at 50k spans/s needs the 10 MiB, and the flusher's speed at 2 MiB still
#: keeps up with 1 KB spans at that rate (benchmarks/RESULTS.md, sidecar8).
CHUNK_BYTES = 2 << 20


@dataclass
class SegmentResult:
    spans: int = 0
    logs: int = 0
    feedback: int = 0
    duplicates: int = 0
    files: int = 0


def batch_of(segment: Path, instance: str) -> str:
    seg = segment.name.split(".", 1)[0]
    return f"{instance}-{seg}" if instance else seg


def flush_segment(path: Path, store: DatasetStore, chunk_bytes: int = CHUNK_BYTES, instance: str = "") -> SegmentResult:
    """Every record of a segment into its datasets. Returns only once every
    writer has committed (the caller then deletes the segment); if any fails, all
    are aborted and the segment is redone whole."""
    batch_id = batch_of(path, instance)
    writers = {name: store.writer(name, batch_id) for name in (layout.SPANS, layout.LOGS, layout.FEEDBACK)}
    try:
        sb, lb, fb, size = SpanBuilder(), LogBuilder(), FeedbackBuilder(), 0

        def drain() -> None:
            nonlocal sb, lb, fb, size
            for name, b in ((layout.SPANS, sb), (layout.LOGS, lb), (layout.FEEDBACK, fb)):
                if len(b):
                    table = b.table()
                    writers[name].add(table, b.dates)
            sb, lb, fb, size = SpanBuilder(), LogBuilder(), FeedbackBuilder(), 0

        for kind, received, payload in wal.read_segment(path):
            if kind == wal.KIND_TRACES:
                sb.add_payload(payload, received)  # converted column-wise, never parsed here
            elif kind == wal.KIND_LOGS:
                lb.add_request(ExportLogsServiceRequest.FromString(payload), received)
            elif kind == wal.KIND_FEEDBACK:
                fb.add(feedback.decode(payload), received, "http")
            size += len(payload)
            if size >= chunk_bytes:
                drain()
        drain()
        failpoints.hit("flusher.before_commit")
        done = {name: w.commit() for name, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    s, lg, fd = done[layout.SPANS], done[layout.LOGS], done[layout.FEEDBACK]
    return SegmentResult(s.rows, lg.rows, fd.rows, s.duplicates + lg.duplicates + fd.duplicates,
                         len(s.files) + len(lg.files) + len(fd.files))


def _lock(directory: Path, stop, parent_pid: int, poll_s: float):
    """The flusher's lock in the WAL folder (waiting for an orphaned flusher to
    finish), or None if told to stop first. A folder that is gone (deleted under
    a running collector, whose log then refuses writes) is waited for, not a
    crash to restart every second. `parent_pid` None: a thread of the collector
    itself, which cannot outlive it."""
    while parent_pid is None or os.getppid() == parent_pid:
        try:
            f = open(directory / "flusher.lock", "a+")
        except FileNotFoundError:
            if stop.is_set():  # the log recreates the folder before this is set, if it held anything
                return None
            stop.wait(poll_s)
            continue
        fcntl.flock(f, fcntl.LOCK_EX)
        return f
    return None


def _oldest_ns(segments: list[Path]) -> float:
    try:
        return float(segments[0].stat().st_mtime_ns) if segments else 0.0
    except FileNotFoundError:  # its folder was deleted a moment ago
        return 0.0


def _release() -> None:
    """What a flush freed goes back to the system, not kept for the next: glibc
    keeps freed heap (protobuf, ptars and numpy buffers) until trimmed, 10 MiB of
    the flusher's resting RSS, measured. Run between segments, never mid-flush."""
    try:
        import ctypes

        import pyarrow as pa

        pa.default_memory_pool().release_unused()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def _trim(segment: Path, directory: Path) -> None:
    """The flushed segment deleted, durably. Already gone with its folder: its
    records are in Parquet all the same."""
    segment.unlink(missing_ok=True)
    try:
        fsync(directory)
    except FileNotFoundError:
        pass


def run(wal_dir: str, data_url: str, storage_options: dict | None, stop, stats, parent_pid: int | None,
        poll_s: float = 0.2, log_level: int = logging.INFO, dedup_window: float | None = None, dedup_memory: int = 0,
        compression: str = "", chunk_bytes: int = 0) -> None:
    """The flusher's loop. Exits when `stop` is set and no sealed segment is left,
    or when the collector that started it is gone (a restart takes over).
    `parent_pid` None: run as a thread of the collector (no process of its own to
    watch its parent, set signals or lower its priority for: a lowered thread
    that holds the GIL when preempted would hold up the receiver's acks)."""
    if parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the receiver orchestrates shutdown
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            os.nice(5)  # background work: when the cores are busy, acks go first
        except OSError:
            pass
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    directory = Path(wal_dir)
    lock = _lock(directory, stop, parent_pid, poll_s)
    if lock is None:
        return
    try:
        instance = wal.instance_id(directory)
        store: DatasetStore | None = None  # made on first use: a store that is down at start is retried too
        backoff = 0.0
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("flusher: collector is gone; exiting so a restart can take over")
                return
            segments = wal.sealed_segments(directory)
            stats[OLDEST_PENDING_NS] = _oldest_ns(segments)
            if not segments:
                if stop.is_set():
                    return
                stop.wait(poll_s)
                continue
            seg = segments[0]
            t0 = time.perf_counter()
            stats[FLUSH_STARTED_S] = time.time()  # the receiver's watchdog restarts a flush that hangs
            try:
                if store is None:
                    store = DatasetStore(
                        data_url, storage_options, window_s=dedup_window, key_budget=dedup_memory,
                        compression=compression,
                        exclude_batches=lambda: {batch_of(p, instance) for p in wal.sealed_segments(directory)},
                    )
                res = flush_segment(seg, store, chunk_bytes=chunk_bytes or CHUNK_BYTES, instance=instance)
                failpoints.hit("flusher.after_commit")  # Parquet durable, segment not yet trimmed
                _trim(seg, directory)
            except Exception as e:  # noqa: BLE001 - the segment stays; retried with backoff
                backoff = min(30.0, max(0.5, backoff * 2))
                stats[ERRORS] += 1
                log.error("flusher: %s failed (%s: %s); kept in the WAL, retrying in %.1fs", seg.name, type(e).__name__, e, backoff)
                stop.wait(backoff) if not stop.is_set() else time.sleep(min(backoff, 1.0))
                continue
            finally:
                stats[FLUSH_STARTED_S] = 0.0
            backoff = 0.0
            dt = time.perf_counter() - t0
            stats[SPANS] += res.spans
            stats[LOGS] += res.logs
            stats[FEEDBACK] += res.feedback
            stats[DUPLICATES] += res.duplicates
            stats[SEGMENTS] += 1
            stats[LAST_FLUSH_S] = dt
            log.info("flushed %s: %d spans, %d log records, %d feedback labels, %d duplicates dropped, %d files in %.2fs",
                     seg.name, res.spans, res.logs, res.feedback, res.duplicates, res.files, dt)
            _release()
    finally:
        lock.close()
