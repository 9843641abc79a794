"""What every benchmark script shares: its flags, the lines that say on what machine
it ran, targets printed as met / NOT met, and one table printer.

A benchmark's figures mean something only next to the machine, the commit and
how busy the machine was, and a target only helps when every script says "met"
the same way; so each script builds its parser with `parser`, opens its report
with `header`, checks each target through a `Target` and prints rows through
`table`, and keeps to itself only what it measures.

The standard library only at import time (psutil is imported where it is used):
benchmarks/peer_agl.py imports this module inside Agent Lightning's own
virtualenv, where nothing of Nightshift's is installed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import operator
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30

# --------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------


def parser(doc: str, *, seed: int | None = None, temp_dir: bool = False, keep: bool = False,
           peer: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of one benchmark script, with the flags several scripts share,
    spelled and meant the same everywhere.

    doc: the script's docstring; its first paragraph is the description, laid out
    as written. seed: adds `--seed` with this default. temp_dir: adds `--dir`, the
    parent folder of the run's temp dir. keep: adds `--keep` (keep that temp dir).
    peer: adds `--peer`, one choice per key, each value saying what that peer is.
    """
    ap = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if seed is not None:
        ap.add_argument("--seed", type=int, default=seed,
                        help=f"seed of the synthetic workload: the same seed gives the same data (default {seed})")
    if temp_dir:
        ap.add_argument("--dir", default=None,
                        help="parent folder of the run's temp dir: its filesystem is the one written to and fsync'd "
                             "(default: the system's temp folder)")
    if keep:
        ap.add_argument("--keep", action="store_true", help="keep the temp dir and what the run wrote there")
    if peer:
        ap.add_argument("--peer", choices=tuple(peer), default=None,
                        help="afterwards, measure a peer on the same workload: "
                             + "; ".join(f"{k}: {v}" for k, v in peer.items()))
    return ap


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------


def log(msg: str, who: str = "") -> None:
    """Progress, to stderr with the time: the report on stdout stays the report."""
    print(f"[{time.strftime('%H:%M:%S')}] {who + ': ' if who else ''}{msg}", file=sys.stderr, flush=True)


def cpu_model() -> str:
    """The CPU's name as the kernel reports it (platform.processor() is empty on
    most Linux systems)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the whole machine since boot, every core:
    two readings bracket a measurement, and what the machine did in between minus
    what the measured processes did is what others took from it."""
    import psutil

    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle, sum(t)


def busy_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU the machine spent over `seconds` from now, while the
    benchmark itself does nothing: what other processes take before it starts."""
    ncpu = os.cpu_count() or 1
    b0, t0 = machine_busy()
    time.sleep(seconds)
    b1, t1 = machine_busy()
    # /proc/stat's ticks are whole; their float differences can come out a hair below 0
    return max(0.0, (b1 - b0) / (t1 - t0) * ncpu) if t1 > t0 else 0.0


def git_commit() -> str:
    """The commit measured, and whether the tree had changes on top of it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return f"{rev}{' + uncommitted changes' if dirty else ''}" if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_line() -> str:
    """One line: host, cores, memory and CPU model."""
    import psutil

    return (f"host: {socket.gethostname()}, {os.cpu_count() or 1} logical CPUs ({psutil.cpu_count(logical=False) or '?'} "
            f"physical), {psutil.virtual_memory().total / GIB:.1f} GiB RAM, {cpu_model()}")


def header(title: str, args: argparse.Namespace | None = None, versions: Iterable[str] = (),
           busy_seconds: float = 1.0) -> list[str]:
    """The report's first lines: what ran, when, on which commit and machine, with
    which arguments, and how busy the machine was before it started (a busy machine
    understates every figure, so the report says so).

    versions: "name version" strings of the libraries whose speed is measured.
    """
    ncpu = os.cpu_count() or 1
    lines = [
        title,
        f"date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}, commit {git_commit()}",
        machine_line(),
        f"python: {platform.python_version()} ({sys.executable})" + "".join(f", {v}" for v in versions),
    ]
    if args is not None:
        lines.append("args: " + " ".join(f"{k}={v}" for k, v in vars(args).items()))
    if busy_seconds:
        busy = busy_cores(busy_seconds)
        lines.append(f"CPU busy before start (other processes): {busy:.2f} of {ncpu} cores"
                     + ("  WARNING: the machine is not idle; figures will be low" if busy > 0.1 * ncpu else ""))
    return lines


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
}


def verdict(ok: bool) -> str:
    """The one way a report says whether a target was met."""
    return "[met]" if ok else "[NOT met]"


@dataclass(frozen=True)
class Target:
    """A goal for one figure: `figure <op> threshold`. ">=" and ">" for figures
    where more is better, "<=" and "<" where less is. A figure that could not be
    measured (NaN) meets no target.

    text: how the threshold reads in the report ("100,000 per core", "1 GiB at 10M
    spans"); by default the threshold itself. name: what the line calls it.
    """

    op: str
    threshold: float
    text: str = ""
    name: str = "target"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"Target op must be one of {', '.join(_OPS)}, not {self.op!r}")

    def met(self, value: float) -> bool:
        return not math.isnan(value) and _OPS[self.op](value, self.threshold)

    def verdict(self, value: float) -> str:
        return verdict(self.met(value))

    def __str__(self) -> str:
        return f"{self.name} {self.op} {self.text or self.threshold}"

    def check(self, value: float) -> str:
        """"target >= 100,000 per core: [met]"."""
        return f"{self}: {self.verdict(value)}"


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def fmt(n: float) -> str:
    """A count or rate with thousands separators; n/a when it was not measured."""
    if n != n:  # nan
        return "n/a"
    return f"{n:,.0f}"


def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of sorted values; NaN when there are none."""
    if not values:
        return float("nan")
    return values[max(0, math.ceil(p / 100 * len(values)) - 1)]


def table(rows: Sequence[Sequence[object]], header: Sequence[str] | None = None, align: str = "",
          indent: str = "  ", sep: str = "  ") -> list[str]:
    """Rows as lines of aligned columns, each as wide as its widest cell.

    align: one character a column, "<" (left) or ">" (right); by default the first
    column is left-aligned (labels) and the others right-aligned (figures). The last
    column is not padded, so a left-aligned note may be as long as it likes.
    """
    cells = ([list(header)] if header is not None else []) + [[str(c) for c in r] for r in rows]
    if not cells:
        return []
    ncol = max(len(r) for r in cells)
    align = align or "<" + ">" * (ncol - 1)
    if len(align) != ncol or set(align) - {"<", ">"}:
        raise ValueError(f"align needs one '<' or '>' for each of the {ncol} columns, got {align!r}")
    widths = [max(len(r[i]) for r in cells if i < len(r)) for i in range(ncol)]
    out = []
    for r in cells:
        parts = [f"{c:{a}{w}}" for c, a, w in zip(r, align, widths)]
        if parts and align[len(parts) - 1] == "<":
            parts[-1] = parts[-1].rstrip()
        out.append((indent + sep.join(parts)).rstrip())
    return out


@dataclass
class Report:
    """The report's lines, printed together at the end (or when the run fails):
    progress goes to stderr as it happens and does not cut the report apart."""

    lines: list[str] = field(default_factory=list)

    def say(self, line: str = "") -> None:
        self.lines.append(line)

    def extend(self, lines: Iterable[str], indent: str = "") -> None:
        self.lines.extend(indent + x for x in lines)

    def print(self) -> None:
        if self.lines:
            print("\n".join(self.lines), flush=True)


def measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float, str]:
    """wait4's own figures for one child: CPU (user + sys) and peak RSS. Started by
    Popen (vfork: a fork would count this process's pages, the setup's tables, as
    the child's until it execs) and reaped here, not by Popen. Returns (wall s, CPU s,
    peak RSS MiB, stdout)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {p.returncode}: {err.decode().strip()[-2000:]}")
    return time.perf_counter() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, out.decode()


# --------------------------------------------------------------------------------------
# A run's temp dir and SIGTERM
# --------------------------------------------------------------------------------------


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM cleans up like Ctrl-C (KeyboardInterrupt): a benchmark stopped by a
    job runner still stops the processes it started and removes its files."""

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextmanager
def temp_dir(prefix: str, parent: str | None = None, keep: bool = False) -> Iterator[Path]:
    """A fresh folder under `parent` (--dir) for one run, removed afterwards unless
    `keep` (--keep), when the log says where it is."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        if keep:
            log(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)
