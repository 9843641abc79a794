"""The write-ahead log: the collector's acknowledgement point.

A request is acknowledged only once its record is written and fdatasync'd here.
Requests arriving together share one write and one fsync (group commit): callers
append to the open batch and wait; a single writer thread writes and syncs the
whole batch, then wakes them all. Segments roll by size or age; a sealed segment
(`<id>.sealed`) belongs to the flusher, which deletes it once its Parquet files
are durable. The active segment is `<id>.active`; after a crash it is scanned,
cut at the first torn or corrupt record, and sealed.

An acknowledged record must be on disk, so each group commit also checks that the
open segment is still the file at its path (one stat, cheap beside the fsync). A
folder deleted, moved or unmounted under a running collector turns the log `lost`:
writes are refused (503 / UNAVAILABLE, retryable: the clients keep their spans)
instead of acknowledged into an unlinked file, and health turns red. The records
acknowledged before, still in the open (unlinked) segment this process holds, are
written back as a sealed segment when the folder is back (an operator's `mkdir`, a
remount), and then writes are accepted again; at shutdown, the folder is recreated
for them if it is still gone. The log never recreates its folder while running: on
a volume that went away, that would put the log on whichever disk holds the mount
point, hidden once the volume returns.

Record: little-endian u32 payload length, u32 CRC-32 of everything after it,
u8 kind, u64 receive time (ns), payload.
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from nightshift.storage import fsync

from .errors import Overloaded

log = logging.getLogger("nightshift.collector.wal")

MAGIC = b"NSWAL001"
HEADER = struct.Struct("<IIBQ")
KIND_TRACES = 1
KIND_LOGS = 2
KIND_FEEDBACK = 3
KINDS = {"traces": KIND_TRACES, "logs": KIND_LOGS, "feedback": KIND_FEEDBACK}

ACTIVE = ".active"
SEALED = ".sealed"
LOCK = "collector.lock"


class LogInUse(Exception):
    """Another process holds this log's folder."""


def instance_id(directory: Path) -> str:
    """This log's name, made once and kept beside its segments. Segment numbers
    restart in every log, so the flusher's file names carry it: several collectors
    writing into one data folder or bucket (a sidecar per agent, a load-balanced
    fleet) never write the same file name, and a redone segment still rewrites its
    own. The receiver makes it when it opens the log, before the disk can fill."""
    path = directory / "instance"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    ident = uuid.uuid4().hex[:12]
    tmp = directory / f".instance.{os.getpid()}"
    tmp.write_text(ident)
    try:
        os.link(tmp, path)  # first writer wins; a racing one reads the winner's id
    except FileExistsError:
        ident = path.read_text().strip()
    finally:
        tmp.unlink(missing_ok=True)
    fsync(directory)
    return ident


def record_header(kind: int, received_ns: int, payload: bytes) -> bytes:
    """The 17 bytes before a payload; the CRC runs on, never copying, the payload."""
    meta = struct.pack("<BQ", kind, received_ns)
    return struct.pack("<II", len(payload), zlib.crc32(payload, zlib.crc32(meta))) + meta


def encode_record(kind: int, received_ns: int, payload: bytes) -> bytes:
    return record_header(kind, received_ns, payload) + payload


def _records(f: BinaryIO) -> Iterator[tuple[int, int, bytes, int]]:
    """The one reader of the record format: (kind, received_ns, payload, offset just
    past the record) for each intact record, stopping at the first torn or corrupt one."""
    if f.read(len(MAGIC)) != MAGIC:
        return
    pos = len(MAGIC)
    while True:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            return
        length, crc, kind, received = HEADER.unpack(head)
        payload = f.read(length)
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(head[8:])) != crc:
            return
        pos += HEADER.size + length
        yield kind, received, payload, pos


def _scan(data: bytes) -> tuple[list[tuple[int, int, bytes]], int]:
    """Records in a segment's bytes and the offset just past the last good one."""
    out, good = [], (len(MAGIC) if data.startswith(MAGIC) else 0)
    for kind, received, payload, good in _records(io.BytesIO(data)):
        out.append((kind, received, payload))
    return out, good


def read_segment(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(kind, received_ns, payload) for every intact record of a segment, read one
    record at a time so the reader holds one record, not the segment."""
    with open(path, "rb") as f:
        for kind, received, payload, _ in _records(f):
            yield kind, received, payload


def segment_id(path: Path) -> int:
    return int(path.name.split(".", 1)[0])


def sealed_segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SEALED), key=segment_id)


def recover(directory: Path) -> int:
    """Seals active segments left by a crash, cutting torn tails. Returns the
    highest segment id present (0 if none)."""
    directory.mkdir(parents=True, exist_ok=True)
    highest = 0
    for p in sorted(directory.glob("*" + ACTIVE), key=segment_id):
        count = 0
        with open(p, "rb") as f:
            good = len(MAGIC) if f.read(len(MAGIC)) == MAGIC else 0
            f.seek(0)
            for *_, good in _records(f):
                count += 1
        size = p.stat().st_size
        if good < size:
            log.warning("wal: %s had %d torn or corrupt trailing bytes (never acknowledged); cut", p.name, size - good)
        if not count:
            p.unlink()
            continue
        with open(p, "r+b") as f:
            f.truncate(good)
            os.fsync(f.fileno())
        p.rename(p.with_suffix(SEALED))
        log.info("wal: recovered %s with %d acknowledged records", p.name, count)
    fsync(directory)
    for p in directory.iterdir():
        try:
            highest = max(highest, segment_id(p))
        except ValueError:
            pass
    return highest


_IOV_MAX = 1024


def _write_all(fd: int, buffers: list[bytes], total: int) -> None:
    """writev without joining the buffers first (no copy of the payloads),
    resuming after short writes."""
    views = [memoryview(b) for b in buffers]
    written = 0
    while written < total:
        n = os.writev(fd, views[:_IOV_MAX])
        written += n
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


@dataclass
class _Batch:
    records: list[bytes] = field(default_factory=list)  # header, payload, header, payload, ...
    count: int = 0
    size: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class WriteAheadLog:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        segment_bytes: int = 64 << 20,
        roll_interval: float = 5.0,
        cap_bytes: int = 2 << 30,
        max_pending_bytes: int = 256 << 20,
        sync: bool = True,
        ack_timeout: float = 8.0,
        lock: bool = False,
    ):
        """`lock`: hold `collector.lock` in the folder while open (LogInUse if another
        process does), and again in a folder that came back after being lost."""
        self.dir = Path(directory)
        self.segment_bytes = segment_bytes
        self.roll_interval = roll_interval
        self.cap_bytes = cap_bytes
        self.max_pending_bytes = max_pending_bytes
        self.sync = sync
        self.ack_timeout = ack_timeout
        self._cond = threading.Condition()
        self._batch = _Batch()
        self._closing = False
        self._fd = -1
        self._path: Path | None = None
        self._active_size = 0
        self._active_records = 0
        self._opened_at = 0.0
        self._roll_requested = False
        self._sealed_bytes = 0
        self._sealed_checked = 0.0
        self._refused_size = 0  # the record last refused for the cap, until one is taken (check_room)
        self._last_id = 0
        self._thread: threading.Thread | None = None
        self.on_sync = None  # callback(seconds, records) for metrics
        self._lock_wanted = lock
        self._lockfile = None
        self._ident = (0, 0)  # (st_dev, st_ino) of the open segment
        self._watched = 0.0
        self.lost = ""  # why writes are refused: the folder is gone; "" while it is in place

    # --- lifecycle ----------------------------------------------------------------------

    def open(self) -> None:
        if self._lock_wanted:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not self._take_lock():
                raise LogInUse(f"another collector is using the write-ahead log at {self.dir}")
        self._last_id = recover(self.dir)
        self._refresh_sealed(force=True)
        try:
            self._new_segment()
        except OSError as e:  # a full disk at start: answer 503 until it is not
            log.error("wal: cannot start a segment (%s); writes are refused until it can", e)
        self._thread = threading.Thread(target=self._run, name="wal-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Writes what is pending, seals the active segment; a log whose folder is
        gone writes the records it holds into a recreated one. Never raises: a
        shutdown must finish whatever happened to the disk."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread:
            self._thread.join()
        try:
            self._seal()
            if self.lost:
                self._restore(closing=True)
        except OSError as e:
            log.error("wal: could not seal the open segment %s at shutdown (%s); a restart recovers it if it is "
                      "still there", self._path, e)
        finally:
            if self._lockfile is not None:
                self._lockfile.close()
                self._lockfile = None

    def _take_lock(self) -> bool:
        """Holds the folder's lock file (True), or False if another process does.
        A lock file that is still the one held needs nothing (a second flock of it
        from here would conflict with our own)."""
        if self._lockfile is not None:
            try:
                held, there = os.fstat(self._lockfile.fileno()), os.stat(self.dir / LOCK)
                if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                    return True
            except FileNotFoundError:
                pass
        f = open(self.dir / LOCK, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return False
        if self._lockfile is not None:
            self._lockfile.close()
        self._lockfile = f
        return True

    # --- appending ----------------------------------------------------------------------

    @property
    def bytes_on_disk(self) -> int:
        return self._sealed_bytes + self._active_size

    def _refresh_sealed(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._sealed_checked < 0.1:
            return
        total = 0
        for p in self.dir.glob("*" + SEALED):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # the flusher just deleted it
                pass
        self._sealed_bytes = total
        self._sealed_checked = now

    def check_room(self) -> None:
        """Raises Overloaded at once when the log has no room now: called before a
        request is read, so a collector held at its cap refuses for the price of a
        comparison. Under sustained overload every refused request used to be read,
        decompressed, parsed and validated before `append` refused it, CPU taken
        from the flusher, the one thing that frees room. A request's record size is
        not known before it is parsed (decompression, OTLP/JSON and redaction all
        change it), so room means room for the record `append` last refused for the
        cap (a record that can never fit is not waited for): once the log is at its
        cap, one request pays the parse and the rest are refused unread until the
        flusher frees a segment."""
        with self._cond:
            if self._closing:
                raise Overloaded("collector is shutting down", retry_after=1.0)
            if self.lost:
                raise Overloaded(self.lost, retry_after=5.0)
            need = self._refused_size or 1
            if self.bytes_on_disk + self._batch.size + need <= self.cap_bytes:
                return
            self._refresh_sealed()  # the folder listed at most every 0.1 s, not per refused request
            if self.bytes_on_disk + self._batch.size + need > self.cap_bytes:
                raise self._over_cap()

    def _over_cap(self) -> Overloaded:
        """The cap's refusal; the active segment goes to the flusher, or nothing
        could free room before the segment's roll interval."""
        self._roll_requested = True
        self._cond.notify_all()
        return Overloaded(f"write-ahead log is over its {self.cap_bytes}-byte cap; the flusher is catching up",
                          retry_after=1.0)

    def append(self, kind: int, payload: bytes, received_ns: int | None = None) -> None:
        """Returns once the record is durable; raises Overloaded if it cannot be."""
        head = record_header(kind, received_ns or time.time_ns(), payload)
        size = len(head) + len(payload)
        with self._cond:
            if self._closing:
                raise Overloaded("collector is shutting down", retry_after=1.0)
            if self.lost:
                raise Overloaded(self.lost, retry_after=5.0)
            if self.bytes_on_disk + self._batch.size + size > self.cap_bytes:
                self._refresh_sealed(force=True)
                if self.bytes_on_disk + self._batch.size + size > self.cap_bytes:
                    self._refused_size = size if size <= self.cap_bytes else 0
                    raise self._over_cap()
            if self._batch.size + size > self.max_pending_bytes:
                raise Overloaded("too many bytes waiting for the disk", retry_after=0.5)
            self._refused_size = 0
            batch = self._batch
            batch.records.append(head)
            batch.records.append(payload)
            batch.count += 1
            batch.size += size
            self._cond.notify_all()
        if not batch.done.wait(self.ack_timeout):
            raise Overloaded("the disk did not confirm the write in time", retry_after=1.0)
        if isinstance(batch.error, Overloaded):  # one per waiter: they raise it in their own threads
            raise Overloaded(batch.error.message, batch.error.retry_after)
        if batch.error is not None:
            raise Overloaded(f"write-ahead log write failed: {batch.error}", retry_after=2.0)

    # --- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._batch.records and not self._closing and not self._roll_due() and not self._watch_due():
                    self._cond.wait(0.05)
                batch, self._batch = self._batch, _Batch()
                closing = self._closing
            try:
                if self._watch_due():
                    self._watch()
                if batch.records:
                    self._write(batch)
                if self._roll_due():
                    self._roll()
                if not batch.records:
                    self._refresh_sealed()
            except Exception as e:  # noqa: BLE001 - the writer must outlive any one failure
                log.exception("wal: unexpected error in the writer; the batch is refused (retryable)")
                if not batch.done.is_set():
                    batch.error = e
                    batch.done.set()
                time.sleep(0.1)
            if closing and not self._batch.records:
                return

    def _roll_due(self) -> bool:
        if self.lost:
            return False  # nowhere to seal to
        if self._active_records == 0:
            self._roll_requested = False
            return False
        return (
            self._roll_requested
            or self._active_size >= self.segment_bytes
            or time.monotonic() - self._opened_at >= self.roll_interval
        )

    def _write(self, batch: _Batch) -> None:
        t0 = time.perf_counter()
        if self.lost:  # appended just before the folder was found gone
            batch.error = Overloaded(self.lost, retry_after=5.0)
            batch.done.set()
            return
        if self._fd < 0:  # a new segment could not be started before (a full disk): again now
            try:
                self._new_segment()
            except FileNotFoundError:
                self._lose()
                batch.error = Overloaded(self.lost, retry_after=5.0)
                batch.done.set()
                return
            except OSError as e:
                log.error("wal: cannot start a segment (%s); answering 503 until it can", e)
                batch.error = e
                batch.done.set()
                return
        start_size = self._active_size
        try:
            _write_all(self._fd, batch.records, batch.size)
            if self.sync:
                os.fdatasync(self._fd)
        except OSError as e:
            # Undo the partial write so the segment stays a clean sequence of records.
            if e.errno == errno.ENOSPC:
                log.error("wal: disk full while writing %d bytes; answering 503 until space returns", batch.size)
            else:
                log.error("wal: write failed: %s", e)
            try:
                os.ftruncate(self._fd, start_size)
                os.lseek(self._fd, start_size, os.SEEK_SET)
            except OSError:
                log.exception("wal: could not cut the failed write; starting a new segment")
                self._roll()
            batch.error = e
            batch.done.set()
            return
        if not self._in_place():
            # Written and synced into a file no path leads to: not durable, so not
            # acknowledged. Cut, so the held segment keeps only acknowledged records.
            os.ftruncate(self._fd, start_size)
            os.lseek(self._fd, start_size, os.SEEK_SET)
            self._lose()
            batch.error = Overloaded(self.lost, retry_after=5.0)
            batch.done.set()
            return
        self._active_size += batch.size
        self._active_records += batch.count
        if self.on_sync:
            self.on_sync(time.perf_counter() - t0, batch.count)
        batch.done.set()

    def _new_segment(self) -> None:
        """Starts the next segment; on failure (a full disk) leaves none, and the
        next write tries again."""
        self._last_id = max(self._last_id + 1, time.time_ns())
        path = self.dir / f"{self._last_id:020d}{ACTIVE}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # read back if its folder is lost
        try:
            os.write(fd, MAGIC)
            os.fsync(fd)
            fsync(self.dir)
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self._path, self._ident = fd, path, (st.st_dev, st.st_ino)
        self._active_size = len(MAGIC)
        self._active_records = 0
        self._opened_at = time.monotonic()

    def _seal(self) -> None:
        if self._fd < 0 or self._path is None:
            return
        if not self._in_place():
            self._lose()  # keep the descriptor: it holds the only copy of what was acknowledged
            return
        os.close(self._fd)
        self._fd = -1
        if self._active_records:
            self._path.rename(self._path.with_suffix(SEALED))
            self._sealed_bytes += self._active_size
        else:
            self._path.unlink()
        fsync(self.dir)
        self._active_size = 0
        self._active_records = 0

    def _roll(self) -> None:
        with self._cond:
            self._roll_requested = False
        self._seal()
        if self.lost:
            return
        try:
            self._new_segment()
        except OSError as e:
            log.error("wal: cannot start a new segment (%s); the next write tries again", e)

    # --- a folder that went away --------------------------------------------------------

    def _in_place(self) -> bool:
        """Whether the open segment is still the file at its path: false once its
        folder is deleted, moved or unmounted, or the file itself removed."""
        try:
            st = os.stat(self._path)  # type: ignore[arg-type]
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._ident

    def _watch_due(self) -> bool:
        return time.monotonic() - self._watched >= 0.5

    def _watch(self) -> None:
        """Between writes: notices a folder that went away while idle (health turns
        red without waiting for traffic), and tries to restore a lost one."""
        self._watched = time.monotonic()
        if self.lost:
            try:
                self._restore()
            except OSError as e:  # gone again, or full: the held records stay held, tried again soon
                log.error("wal: %s is back but the held records could not be written into it yet (%s)", self.dir, e)
        elif (not self._in_place()) if self._fd >= 0 else not self.dir.is_dir():
            self._lose()

    def _lose(self) -> None:
        if self.lost:
            return
        self.lost = (f"the write-ahead log's folder {self.dir} is gone (deleted, moved or unmounted); writes are "
                     f"refused until it is back: recreate it, or restart the collector")
        log.error("wal: %s is gone (deleted, moved or unmounted) while in use: refusing writes (retryable) until it "
                  "is back. The %d acknowledged records of the open segment are held (this process still has the "
                  "deleted file open) and written back into it when it returns (mkdir -p %s, or remount), or at "
                  "shutdown; segments already handed to the flusher and not yet in Parquet went with the folder.",
                  self.dir, self._active_records, self.dir)

    def _restore(self, closing: bool = False) -> None:
        """Writes the held records back once the folder is there again, then accepts
        writes. At shutdown (`closing`) the folder is recreated for them if need be:
        the last chance to keep them."""
        if not self.dir.is_dir():
            if not closing:
                return
            if not self._active_records:  # nothing to keep: no folder made where the operator removed one
                self._release_held()
                return
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                log.error("wal: cannot recreate %s at shutdown (%s): the %d acknowledged records it held are lost",
                          self.dir, e.strerror, self._active_records)
                return
            log.warning("wal: recreated %s at shutdown for the %d acknowledged records held since it went away",
                        self.dir, self._active_records)
        if not closing and self._lock_wanted and not self._take_lock():
            self.lost = (f"another collector took the write-ahead log's folder {self.dir} while it was gone; "
                         f"writes are refused: restart this collector with a folder of its own")
            return
        saved = self._write_back()
        self._release_held()
        self._last_id = max(self._last_id, recover(self.dir))  # a folder restored from a copy: its active files too
        self.lost = ""
        log.warning("wal: %s is back; %s; %s", self.dir,
                    f"the acknowledged records held meanwhile are in {saved.name}" if saved else "nothing was held",
                    "shutting down" if closing else "accepting writes again")
        if not closing:
            self._refresh_sealed(force=True)
            try:
                self._new_segment()
            except OSError as e:
                log.error("wal: cannot start a segment (%s); the next write tries again", e)

    def _release_held(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._path = -1, None
        self._active_size = self._active_records = 0

    def _write_back(self) -> Path | None:
        """The held (unlinked) segment's records copied into a sealed segment of the
        folder, durably; None if it held none."""
        if self._fd < 0 or not self._active_records:
            return None
        self._last_id = max(self._last_id + 1, time.time_ns())
        path = self.dir / f"{self._last_id:020d}{ACTIVE}"  # a crash mid-copy: recovery cuts it like any other
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            offset = 0
            while offset < self._active_size:
                chunk = os.pread(self._fd, min(8 << 20, self._active_size - offset), offset)
                if not chunk:
                    raise OSError(errno.EIO, "the held segment ended early")
                _write_all(out, [chunk], len(chunk))
                offset += len(chunk)
            os.fsync(out)
        except OSError:
            os.close(out)
            path.unlink(missing_ok=True)
            raise
        os.close(out)
        sealed = path.with_suffix(SEALED)
        path.rename(sealed)
        fsync(self.dir)
        self._sealed_bytes += self._active_size
        return sealed
