"""A real `nightshift collect` process for the campaigns: free loopback ports, its
own log file, health, metrics, SIGTERM and kill -9."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Collector:
    """One real `nightshift collect` process: the harness of the tests
    (tests/conftest.py's fixtures), the hardening campaigns and the benchmarks'
    checks alike."""

    data: Path | str  # a folder, or an fsspec URL
    wal: Path
    log_path: Path
    env: dict[str, str | None] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    grpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    host: str = "127.0.0.1"  # where it listens; health and clients always use loopback
    scheme: str = "http"  # https with --tls-cert/--tls-key
    proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.grpc_port}"

    def _cmd(self) -> list[str]:
        return [sys.executable, "-m", "nightshift.cli", "collect", "--data", str(self.data), "--wal", str(self.wal),
                "--grpc", f"{self.host}:{self.grpc_port}", "--http", f"{self.host}:{self.http_port}", *self.extra_args]

    def start(self, wait: bool = True, timeout: float = 30.0) -> "Collector":
        # The flusher in its own process unless a test says otherwise: the campaigns stop,
        # kill and fail it by its pid (`collector.flusher: auto` makes it a thread of the
        # collector on a folder); a None in `env` leaves the variable unset (the default).
        env = {**os.environ, "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "0.5", "NIGHTSHIFT_COLLECTOR_FLUSHER": "process",
               **self.env}
        env = {k: v for k, v in env.items() if v is not None}
        for attempt in range(3):
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(self._cmd(), stdout=self._log, stderr=subprocess.STDOUT, env=env)
            if not wait:
                return self
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError as e:
                # free_port's port is free when it returns, not when the collector binds it: another
                # process (a client's ephemeral port) can take it in between; new ports, not a failure
                if "address already in use" not in str(e) or attempt == 2:
                    raise
                self._log.close()
                self.grpc_port, self.http_port = free_port(), free_port()
                while self.http_port == self.grpc_port:
                    self.http_port = free_port()
        return self

    def health(self) -> dict | None:
        ctx = ssl._create_unverified_context() if self.scheme == "https" else None  # the tests' self-signed cert
        try:
            with urllib.request.urlopen(f"{self.http_url}/healthz", timeout=2, context=ctx) as r:
                return json.loads(r.read())
        except Exception:  # noqa: BLE001
            return None

    def wait_healthy(self, timeout: float = 30.0) -> float:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if self.health():
                return time.time() - t0
            time.sleep(0.05)
        raise TimeoutError(f"collector not healthy after {timeout}s; log:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """`/metrics` as {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM: drain and flush. Returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._log.close()
        return rc

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    def children(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)] if self.proc else []

    def log_tail(self, n: int = 8000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def counted(m: dict[str, float], name: str, signals=("traces", "logs", "feedback")) -> float:
    return sum(m.get(f'{name}{{signal="{s}"}}', 0.0) for s in signals)


def drained(c: Collector, timeout: float = 120.0) -> dict[str, float]:
    """Waits until the flusher has read every acknowledged record (stored or found
    a duplicate); returns the last metrics."""
    deadline = time.time() + timeout
    while True:
        m = c.metrics()
        acked = counted(m, "nightshift_accepted_total")
        read = counted(m, "nightshift_flushed") + m.get("nightshift_duplicates_dropped", 0.0)
        if read >= acked or time.time() > deadline:
            return m
        time.sleep(0.2)


def stored_rows(data: Path) -> dict[str, int]:
    import pyarrow.parquet as pq

    out = {}
    for name in ("spans", "logs", "feedback"):
        out[name] = sum(pq.ParquetFile(p).metadata.num_rows for p in (data / name).rglob("*.parquet"))
    return out


def stored_keys(data: Path, dataset: str = "spans") -> list[tuple]:
    import polars as pl

    files = sorted((data / dataset).rglob("*.parquet"))
    if not files:
        return []
    cols = {"spans": ["trace_id", "span_id"], "logs": ["record_id"], "feedback": ["feedback_id"]}[dataset]
    df = pl.concat([pl.read_parquet(f, columns=cols) for f in files])
    return list(df.iter_rows())
