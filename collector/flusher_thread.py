"""The flusher as a thread of the receiver's process (`collector.flusher: thread`).

The process form pays for a second interpreter: idle with gRPC, receiver and
flusher were 54 + 76 MiB, both in one process 101 (the runtime and the shared
libraries once, not twice); under a sustained 50k spans/s the one process was
18-32 MB smaller (benchmarks/RESULTS.md, sidecar7). The price is the GIL: the flush's Python
parts (the WAL's reads, ptars' conversion, ~0.45 s per 100k 1 KB spans) run
between the receiver's acks, while the Parquet encode and the writes release it.
Same loop, same WAL, same files, same dedup as the process form
(`flusher.run`); what changes is what a thread cannot do: it cannot be killed, so
a flush stuck past `flush_timeout` is reported and left (the process form kills
and restarts it), and a crash of the flusher is a crash of the collector (the
WAL keeps what was acknowledged; the next start flushes it, as after any kill).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .flusher_process import UNUSED, SharedStats, StopSignal, Unused, child_environment

log = logging.getLogger("nightshift.collector.flusher")


def prepare_process() -> None:
    """What the process form does to its own child, done to this process before
    the flusher's first import of pyarrow: Arrow's allocator chosen (read once,
    at pyarrow's first allocation) and the modules the flusher never uses kept
    out (pandas and Arrow's S3 were 8 MiB of the one process, measured). Only
    `server.run` calls it: a process that is the collector and nothing else (a
    test or a library user of `Collector` may well want pandas)."""
    os.environ.update(child_environment(os.environ))
    if not any(isinstance(f, Unused) for f in sys.meta_path) and not any(m in sys.modules for m in UNUSED):
        sys.meta_path.insert(0, Unused())


class FlusherThread:
    """The receiver's handle on its flusher thread: what `server` uses of
    `FlusherProcess` (pid, alive, exit code, join; kill and terminate cannot stop
    a thread and say so)."""

    kind = "thread"

    def __init__(self, settings: dict, stats: SharedStats, stop: StopSignal):
        self.pid = os.getpid()
        self.exitcode: int | None = None
        self._settings, self._stats, self._stop = settings, stats, stop
        self._thread = threading.Thread(target=self._run, name="nightshift-flusher", daemon=True)
        self._thread.start()
        self.tid = self._thread.native_id  # its CPU in /proc/<pid>/task/<tid>: the benchmark's flusher share

    def _run(self) -> None:
        from .flusher import run  # here: pyarrow comes with it, after `prepare_process`

        s = self._settings
        try:
            run(s["wal_dir"], s["data"], s["storage_options"], self._stop, self._stats, None,
                log_level=s["log_level"], dedup_window=s["dedup_window"], dedup_memory=s.get("dedup_memory", 0),
                compression=s.get("compression", ""), chunk_bytes=s.get("chunk_bytes", 0))
            self.exitcode = 0
        except BaseException:  # noqa: BLE001 - the watchdog restarts it, as it restarts a process that died
            log.exception("flusher thread failed")
            self.exitcode = 1

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def kill(self) -> None:
        """A thread cannot be killed: the flush goes on (the caller logs it)."""

    def terminate(self) -> None:
        """As `kill`: the process's exit ends the thread, and the WAL keeps what it had not flushed."""
