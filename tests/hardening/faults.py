#!/usr/bin/env python
"""Fault-injection campaigns against a real `nightshift collect` under sustained
load, with exact accounting: every span the load acknowledged must be in the
Parquet datasets exactly once.

    python tests/hardening/faults.py                 # every campaign, the long versions
    python tests/hardening/faults.py kill9 --rounds 20
    python tests/hardening/faults.py disk-full flusher-kill object-store
    python tests/hardening/faults.py --write-docs    # the figures into docs/RELIABILITY.md

- kill9: the collector killed with SIGKILL, at a random moment, `--rounds` times
  (every other time its flusher too, as when a container dies), restarted on the
  same log and data each time while the senders keep going.
- disk-full: the log on a small filesystem of its own (a tmpfs when this machine
  lets us mount one, else the log's byte cap) filled while the flusher is paused;
  then the data folder on a full filesystem. Retryable answers with Retry-After,
  then recovery by itself, nothing lost.
- flusher-kill: the flusher killed (a failpoint) after its Parquet files are
  durable and before its log segment is trimmed, `--times` times.
- object-store: the datasets on S3 (moto's server on loopback, through s3fs),
  with a proxy between them that refuses, hangs and cuts connections mid-upload.

The load: sender threads, half HTTP and half gRPC, each sending requests of 20
unique spans and resending the same bytes after a failure, as OTLP exporters do.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from load import Load  # noqa: E402
from proc import Collector, counted, drained, free_port, stored_keys  # noqa: E402


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def account(load: Load, data_keys: list[tuple]) -> dict:
    """Acknowledged spans against the stored ones."""
    acked = set(load.acked)
    stored = set(data_keys)
    return {"acknowledged": len(acked), "stored_rows": len(data_keys), "lost": len(acked - stored),
            "duplicated": len(data_keys) - len(stored),
            "stored_not_acknowledged": len(stored - acked),  # in flight at a kill: durable, answer never seen
            "answers": dict(sorted(load.answers.items())), "retryable_without_retry_after": load.retry_after_missing}


def _finish(c: Collector, load: Load, data: Path, out: dict) -> dict:
    load.stop()
    m = drained(c)
    out["exit_code"] = c.stop()
    out["flush_errors"] = int(m.get("nightshift_flush_errors", 0))
    out.update(account(load, stored_keys(data)))
    return out


# --- kill -9 -----------------------------------------------------------------------------

def kill9(rounds: int = 20, senders: int = 4, seed: int = 1, root: Path | None = None) -> dict:
    rng = random.Random(seed)
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-kill9-"))
    data, wal = root / "data", root / "wal"
    c = Collector(data, wal, root / "collector-0.log").start()
    load = Load(c.http_port, c.grpc_port, senders=senders).start()
    recovery, whole_group = [], 0
    try:
        for r in range(rounds):
            time.sleep(rng.uniform(0.3, 2.0))
            victims = c.children() if r % 2 == 1 else []
            c.kill9()
            for pid in victims:  # the flusher too, mid-flush or not, as when the container dies
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            whole_group += bool(victims)
            t0 = time.time()
            c = Collector(data, wal, root / f"collector-{r + 1}.log", grpc_port=c.grpc_port, http_port=c.http_port)
            c.start(timeout=60)
            recovery.append(time.time() - t0)
            # time to the first acknowledgement after the restart
        time.sleep(1.0)
        out = {"rounds": rounds, "flusher_killed_too": whole_group, "restart_to_healthy_s_median": _median(recovery),
               "restart_to_healthy_s_max": max(recovery, default=0.0), "senders": senders}
        return _finish(c, load, data, out)
    finally:
        load.stop()
        if c.proc and c.proc.poll() is None:
            c.kill9()


# --- full disk -----------------------------------------------------------------------------

@contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path` if this machine lets us mount one; yields
    whether it did."""
    path.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                        capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _wait(cond, timeout: float, step: float = 0.1) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(step)
    return False


def disk_full(senders: int = 4, root: Path | None = None, fill_timeout: float = 60.0) -> dict:
    """The log's filesystem fills while the flusher is paused; then the flusher
    resumes and the collector must accept again by itself."""
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-diskfull-"))
    data = root / "data"
    with small_filesystem(root / "walfs", "16m") as mounted:
        env = {} if mounted else {"NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES": "8MiB"}
        c = Collector(data, root / "walfs" / "wal", root / "collector.log", env=env).start()
        out = {"how": "a 16 MiB tmpfs for the log (a real ENOSPC)" if mounted else
               "the log's byte cap (8 MiB): this machine would not mount a small filesystem"}
        flusher = c.health()["flusher_pid"]
        os.kill(flusher, signal.SIGSTOP)  # the flusher falls behind; the disk fills
        load = Load(c.http_port, c.grpc_port, senders=senders).start()
        try:
            full = _wait(lambda: sum(v for k, v in load.answers.items() if k.endswith(("503", "UNAVAILABLE"))) >= 20,
                         fill_timeout)
            out["filled"] = full
            out["healthy_while_full"] = (c.health() or {}).get("status") == "ok"
            time.sleep(1.0)
            t_resume = time.time()
        finally:
            os.kill(flusher, signal.SIGCONT)
        _wait(lambda: load.first_after(t_resume) is not None, 60)
        first_ok = load.first_after(t_resume)
        out["resume_to_first_ack_s"] = (first_ok - t_resume) if first_ok else None
        time.sleep(2.0)
        out["refused_while_full"] = sum(v for k, v in load.answers.items() if k.endswith(("503", "UNAVAILABLE")))
        out = _finish(c, load, data, out)
    out.update(data_disk_full(senders, root))
    return out


def data_disk_full(senders: int, root: Path) -> dict:
    """The data folder's filesystem is full: flushes fail and are retried, the log
    keeps everything, and once space returns it all reaches Parquet."""
    out: dict = {}
    datafs = root / "datafs"
    with small_filesystem(datafs, "32m") as mounted:
        if not mounted:
            return {"data_disk": "not run: this machine would not mount a small filesystem"}
        data = datafs / "data"
        ballast = datafs / "ballast"
        free = shutil.disk_usage(datafs).free
        with open(ballast, "wb") as f:  # all but 256 KiB
            f.write(b"\0" * max(0, free - (256 << 10)))
        c = Collector(data, root / "wal2", root / "collector-data.log").start()
        load = Load(c.http_port, c.grpc_port, senders=senders).start()
        ok = _wait(lambda: c.metrics().get("nightshift_flush_errors", 0) >= 2, 60)
        out["data_disk_flush_errors_seen"] = ok
        out["data_disk_acks_while_full"] = len(load.acked)
        t_free = time.time()
        ballast.unlink()
        acked_then = counted(c.metrics(), "nightshift_accepted_total")
        _wait(lambda: counted(c.metrics(), "nightshift_flushed") + c.metrics().get("nightshift_duplicates_dropped", 0)
              >= acked_then, 120)
        out["data_disk_space_to_flushed_s"] = time.time() - t_free
        res = _finish(c, load, data, {})
        out.update({f"data_disk_{k}": v for k, v in res.items()})
    return out


# --- flusher killed between Parquet and the trim -----------------------------------------

def flusher_kill(times: int = 10, senders: int = 4, root: Path | None = None) -> dict:
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-flusherkill-"))
    data = root / "data"
    marks = root / "failpoints"
    marks.mkdir(parents=True, exist_ok=True)
    marker = marks / "flusher.after_commit"
    marker.touch()  # disarmed until the load runs
    c = Collector(data, root / "wal", root / "collector.log",
                  env={"NIGHTSHIFT_FAILPOINTS": "flusher.after_commit", "NIGHTSHIFT_FAILPOINT_DIR": str(marks)}).start()
    load = Load(c.http_port, c.grpc_port, senders=senders).start()
    recovery, fired = [], 0
    try:
        for _ in range(times):
            restarts = c.metrics().get('nightshift_flusher_restarts_total{why="exited"}', 0)
            marker.unlink()  # arm: the next flush dies after its files are durable
            if not _wait(marker.exists, 60):
                break
            fired += 1
            t_kill = time.time()
            _wait(lambda: c.metrics().get('nightshift_flusher_restarts_total{why="exited"}', 0) > restarts, 30)
            segs = c.metrics()
            before = counted(segs, "nightshift_flushed")
            _wait(lambda: counted(c.metrics(), "nightshift_flushed") > before, 60)
            recovery.append(time.time() - t_kill)
        out = {"times": fired, "kill_to_next_flush_s_median": _median(recovery),
               "kill_to_next_flush_s_max": max(recovery, default=0.0)}
        m = c.metrics()
        out["flusher_restarts"] = int(m.get('nightshift_flusher_restarts_total{why="exited"}', 0))
        return _finish(c, load, data, out)
    finally:
        load.stop()
        if c.proc and c.proc.poll() is None:
            c.kill9()


# --- object store that fails and hangs ------------------------------------------------------

def object_store(senders: int = 4, phase_s: float = 6.0, root: Path | None = None, flush_timeout: float = 10.0,
                 pace_s: float = 0.05) -> dict:
    """Datasets on S3 (moto's server), the flusher going through a proxy that
    refuses, stalls and resets. s3fs is given a read timeout longer than
    `flush_timeout`, so a stall is ended by the collector's watchdog."""
    import fsspec
    from moto.server import ThreadedMotoServer
    from toxic import ToxicProxy

    root = root or Path(tempfile.mkdtemp(prefix="nightshift-s3-"))
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    proxy = ToxicProxy(port)
    creds = {"key": "testing", "secret": "testing", "skip_instance_cache": True, "use_listings_cache": False}
    direct = fsspec.filesystem("s3", client_kwargs={"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}, **creds)
    import boto3
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="nightshift-faults")
    options = {**creds, "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}", "region_name": "us-east-1"},
               "config_kwargs": {"connect_timeout": 2, "read_timeout": max(30.0, flush_timeout * 3),
                                 "retries": {"max_attempts": 2, "mode": "standard"}}}
    url = "s3://nightshift-faults/data"
    c = Collector(url, root / "wal", root / "collector.log",
                  env={"NIGHTSHIFT_COLLECTOR_STORAGE_OPTIONS": json.dumps(options),
                       "NIGHTSHIFT_COLLECTOR_FLUSH_TIMEOUT": str(flush_timeout)})
    out: dict = {"store": "moto S3 server on loopback, through s3fs, behind a fault proxy",
                 "load": f"{senders} senders, 20 spans a request, {pace_s * 1000:.0f} ms apart"}
    try:
        c.start()
        # a steady rate the flusher keeps up with, so each phase's catch-up is its own
        load = Load(c.http_port, c.grpc_port, senders=senders, pace_s=pace_s).start()
        phases = {}
        time.sleep(phase_s / 2)
        for mode in ("refuse", "stall", "reset"):
            m0 = c.metrics()
            proxy.set(mode)
            time.sleep(phase_s if mode != "stall" else flush_timeout + phase_s)
            m1 = c.metrics()
            acked_during = counted(m1, "nightshift_accepted_total") - counted(m0, "nightshift_accepted_total")
            proxy.set("pass")
            t_back = time.time()
            acked = counted(c.metrics(), "nightshift_accepted_total")
            _wait(lambda: counted(c.metrics(), "nightshift_flushed") + c.metrics().get("nightshift_duplicates_dropped", 0)
                  >= acked, 180, 0.25)
            m2 = c.metrics()
            phases[mode] = {
                "acks_during": int(acked_during),
                "flush_errors_during": int(m1.get("nightshift_flush_errors", 0) - m0.get("nightshift_flush_errors", 0)),
                "flusher_restarts_stuck": int(m2.get('nightshift_flusher_restarts_total{why="stuck"}', 0)
                                              - m0.get('nightshift_flusher_restarts_total{why="stuck"}', 0)),
                "store_back_to_caught_up_s": time.time() - t_back,
                "wal_bytes_peak": int(m1.get("nightshift_wal_bytes", 0)),
            }
        out["phases"] = phases
        load.stop()
        m = drained(c)
        out["exit_code"] = c.stop()
        out["flush_errors"] = int(m.get("nightshift_flush_errors", 0))
        files = direct.glob("nightshift-faults/data/spans/date=*/*.parquet")
        import pyarrow.parquet as pq

        keys = []
        for f in files:
            with direct.open(f, "rb") as fh:
                t = pq.read_table(fh, columns=["trace_id", "span_id"])
            keys += list(zip(t.column("trace_id").to_pylist(), t.column("span_id").to_pylist()))
        out["files"] = len(files)
        out.update(account(load, keys))
        return out
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
        proxy.close()
        server.stop()


CAMPAIGNS = {"kill9": kill9, "disk-full": disk_full, "flusher-kill": flusher_kill, "object-store": object_store}


def ok(name: str, r: dict) -> bool:
    good = r.get("lost") == 0 and r.get("duplicated") == 0 and r.get("exit_code") == 0
    if name == "disk-full":
        good = good and r.get("filled") and r.get("resume_to_first_ack_s") is not None
        if "data_disk_lost" in r:
            good = good and r["data_disk_lost"] == 0 and r["data_disk_duplicated"] == 0
    return bool(good)


def report(name: str, r: dict) -> str:
    lines = [f"{name}: {'OK' if ok(name, r) else 'FAILED'}"]
    for k, v in r.items():
        if isinstance(v, float):
            v = f"{v:.2f}"
        lines.append(f"  {k}: {v}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("campaigns", nargs="*", default=list(CAMPAIGNS), help=", ".join(CAMPAIGNS))
    ap.add_argument("--rounds", type=int, default=20, help="kill9: how many kills")
    ap.add_argument("--times", type=int, default=10, help="flusher-kill: how many kills")
    ap.add_argument("--senders", type=int, default=4)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--write-docs", action="store_true", help="put the figures into docs/RELIABILITY.md")
    args = ap.parse_args()
    results, good = {}, True
    for name in args.campaigns:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.time()
        kw = {"senders": args.senders}
        if name == "kill9":
            kw["rounds"] = args.rounds
        if name == "flusher-kill":
            kw["times"] = args.times
        r = CAMPAIGNS[name](**kw)
        r["wall_s"] = time.time() - t0
        results[name] = r
        good = good and ok(name, r)
        print(report(name, r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.write_docs:
        import docs

        for name, r in results.items():
            docs.write_section(name, docs.fault_section(name, r))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
