"""The flusher's own process: started by the receiver as
`python -m nightshift.collector.flusher_process SETTINGS_JSON`, and what the two
share (counters, the word to stop).

A plain subprocess, not multiprocessing, because a sidecar runs beside every agent
pod and each process it keeps is paid for in every pod: multiprocessing's spawn
start keeps a third process for the collector's whole life (its resource tracker,
13 MiB), and its child unpickles its target from `server`, importing gRPC and the
HTTP server that flushing never uses. Here the child imports only what flushing
needs. The counters live in a memory file both processes map (`SharedStats`), the
word to stop is a pipe (`StopSignal`); both reach the child as inherited
descriptors, so there is nothing to clean up after a crash.

pandas is kept out of the child: pyarrow imports it, when it is installed, the
first time it converts a Python list, only to ask whether the list is a pandas
object (36 MiB, a quarter of the sidecar's budget, for nothing). So are Arrow's
own S3, GCS, Azure and HDFS filesystems, which `pyarrow.parquet` imports when it
can: the flusher writes a local folder with os calls and an object store through
fsspec, never through them, and libarrow_s3 was 3.2 MiB of its RSS (measured
after its imports, 81.0 -> 77.8 MiB).
"""

from __future__ import annotations

import importlib.abc
import json
import mmap
import os
import select
import subprocess
import sys
import tempfile

from .flusher_stats import NSTATS

MODULE = "nightshift.collector.flusher_process"


class SharedStats:
    """The flusher's counters (`flusher_stats`), doubles in a memory file mapped by
    the receiver and its flusher: the flusher writes, the receiver reads."""

    def __init__(self, fd: int | None = None):
        if fd is None:
            fd = _memory_file(NSTATS * 8)
        self.fd = fd
        self._map = mmap.mmap(fd, NSTATS * 8)
        self._values = memoryview(self._map).cast("d")

    def __getitem__(self, i: int) -> float:
        return self._values[i]

    def __setitem__(self, i: int, value: float) -> None:
        self._values[i] = value


def _memory_file(size: int) -> int:
    """A file in memory only (memfd on Linux, an unlinked temporary file elsewhere)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("nightshift-flusher-stats", 0)
    else:  # pragma: no cover - not Linux
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


class StopSignal:
    """The receiver's word to stop: a pipe that turns readable once the receiver
    writes to it, or once the receiver is gone (its end closed). The flusher's
    side has `Event`'s `is_set` and `wait`."""

    def __init__(self, read_fd: int, write_fd: int | None = None):
        self.read_fd, self.write_fd = read_fd, write_fd

    @classmethod
    def pair(cls) -> "StopSignal":
        r, w = os.pipe()
        return cls(r, w)

    def set(self) -> None:
        if self.write_fd is not None:
            os.write(self.write_fd, b"s")

    def is_set(self) -> bool:
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        return bool(select.select([self.read_fd], [], [], timeout)[0])


class FlusherProcess:
    """The receiver's handle on its flusher (what it used of multiprocessing's
    Process: pid, alive, exit code, kill, join)."""

    def __init__(self, settings: dict, stats: SharedStats, stop: StopSignal):
        settings = {**settings, "stats_fd": stats.fd, "stop_fd": stop.read_fd, "parent_pid": os.getpid()}
        self.proc = subprocess.Popen([sys.executable, "-m", MODULE, json.dumps(settings)],
                                     pass_fds=(stats.fd, stop.read_fd), stdin=subprocess.DEVNULL,
                                     env=child_environment(os.environ))
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()

    def terminate(self) -> None:
        if self.is_alive():
            self.proc.terminate()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


#: Arrow's allocator in the flusher. pyarrow's default here is mimalloc, which
#: keeps what a flush freed: measured on a 100k-span segment of 1 KB spans (4 MiB
#: chunks), the flusher peaked at 154-159 MiB with mimalloc, 130-134 with jemalloc
#: and 130-135 with the system allocator, at the same spans per CPU-second;
#: jemalloc's import is also 2-6 MiB smaller. Most of a flush's memory is outside
#: Arrow's pool (ptars' and numpy's buffers, the Parquet encoder's pages), so the
#: pool's own high-water mark (8 MiB) never showed it: RSS does.
MEMORY_POOL = "jemalloc"


def child_environment(environ) -> dict[str, str]:
    """The flusher's environment: the parent's, with Arrow's allocator chosen
    unless the operator chose one (ARROW_DEFAULT_MEMORY_POOL is read once, when
    pyarrow first allocates, so it must be there when the process starts)."""
    return {**environ, "ARROW_DEFAULT_MEMORY_POOL": environ.get("ARROW_DEFAULT_MEMORY_POOL") or MEMORY_POOL}


#: Modules the flusher never uses that pyarrow imports when they are there (see
#: the module's docstring); pyarrow goes on without each.
UNUSED = ("pandas", "pyarrow._s3fs", "pyarrow._gcsfs", "pyarrow._azurefs", "pyarrow._hdfs")


class Unused(importlib.abc.MetaPathFinder):
    """Makes importing `UNUSED` fail as if they were not installed (a None in
    sys.modules is not enough: Cython's import takes it for the module)."""

    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in UNUSED):
            raise ModuleNotFoundError(f"{name} is not used by the flusher", name=name)
        return None


def main(argv: list[str]) -> int:
    sys.meta_path.insert(0, Unused())  # see the module's docstring
    settings = json.loads(argv[1])
    from nightshift.settings import logs

    logs.configure(settings["log_level"], settings["log_format"])
    from .flusher import run

    run(settings["wal_dir"], settings["data"], settings["storage_options"], StopSignal(settings["stop_fd"]),
        SharedStats(settings["stats_fd"]), settings["parent_pid"], log_level=settings["log_level"],
        dedup_window=settings["dedup_window"], dedup_memory=settings.get("dedup_memory", 0),
        compression=settings.get("compression", ""), chunk_bytes=settings.get("chunk_bytes", 0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
