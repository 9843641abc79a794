"""A collector that cannot start says why in one sentence, exits 2 and leaves nothing
running: a busy port (gRPC or HTTP), a write-ahead log another collector holds."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    return subprocess.run([sys.executable, "-m", "nightshift.cli", "collect", "--data", str(tmp_path / "data"),
                           "--wal", str(tmp_path / "wal"), *args], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=env)


def _nobody_holds(lock: Path) -> bool:
    with open(lock, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True


@pytest.mark.parametrize("busy", ["grpc", "http"])
def test_a_busy_port_is_one_sentence_exit_2_and_nothing_left_running(tmp_path, busy):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            other = free.getsockname()[1]
        ports = {"grpc": other, "http": other, busy: port}
        r = _collect(tmp_path, "--grpc", f"127.0.0.1:{ports['grpc']}", "--http", f"127.0.0.1:{ports['http']}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"nightshift collect: cannot listen on 127.0.0.1:{port} (collector.{busy}): "
                                "address already in use (another collector?)")
    # nothing started: no flusher (it would hold its lock in the WAL), the WAL's own lock released
    assert not (tmp_path / "wal" / "flusher.lock").exists()
    assert _nobody_holds(tmp_path / "wal" / "collector.lock")
    assert not list((tmp_path / "wal").glob("*.active"))


def test_a_wal_held_by_another_collector_is_one_sentence_and_exit_2(tmp_path):
    (tmp_path / "wal").mkdir()
    with open(tmp_path / "wal" / "collector.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = _collect(tmp_path, "--grpc", "off", "--http", "off")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"nightshift collect: another collector is using the write-ahead log at {tmp_path / 'wal'}"
