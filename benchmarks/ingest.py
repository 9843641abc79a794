#!/usr/bin/env python
"""Ingest benchmark for `nightshift collect`.

    python benchmarks/ingest.py [--seconds N] [--senders K] [--spans-per-request 512]
                                [--span-kb 1,5] [--transport http|grpc] [--peer phoenix]

What it does, in one run:

1. Builds realistic GenAI `chat` spans up front (about 1 KB, then about 5 KB
   each with `--span-kb 1,5`, the default: steps 2-4 run once per size; 0 is the
   old 1-10 KB mix), message content included, as a few OTLP `ExportTraceServiceRequest` templates, serialized once
   (benchmarks/otlp_load.py). Every send gets fresh random trace and span ids,
   written straight into the serialized bytes at offsets found once at build time
   (no protobuf work in the senders, and no id is ever sent twice, so
   deduplication hides no work).
2. Raw loop, the physical reference: one process doing only
   `ExportTraceServiceRequest.FromString(b)`, append to a file, `os.fdatasync` per
   request; then the same with one fdatasync per 8 requests (group commit).
3. Starts the collector as a real process in a temp dir, then K sender processes
   (HTTP keep-alive POSTs or raw-bytes gRPC `Export` calls) for:
   warm-up -> full load (closed loop) -> wait until Parquet has everything ->
   half of the measured peak (rate-limited, open loop) -> wait -> the sustained
   phase: `--sustained-rate` (50k) spans/s open loop for `--sustained-seconds`
   (30 s: a million 1 KB spans, long enough for the duplicate check's default
   key budget to fill and for 60 WAL segments to be flushed one after another),
   what issue 28's targets name -> wait -> SIGTERM.
   Then, unless `--overload-cap 0`, a second collector whose WAL is capped
   (`--overload-cap`, 128 MiB) runs at that cap under the same full load: what
   the clients get (acknowledged, told 503), what reaches Parquet meanwhile, the
   backlog and the RSS, beside the unthrottled figures (issue 28 item 6: a
   sidecar that cannot keep up must push back, not fill its disk).
4. Prints throughput (total, per collector core), sustained throughput to
   Parquet, ack latencies, RSS (receiver and flusher, sampled every 100 ms), and
   checks the Parquet row count against what was acknowledged; last, the sidecar's
   two targets (issue 28) for each span size, from the sustained phase at 50k
   spans/s: to Parquet >= 0.8x the acknowledged rate, receiver + flusher <= 150
   MB RSS; the full-load (closed loop) and WAL-cap figures beside them, named as
   such.
5. With `--peer phoenix`: afterwards, the same load against Arize Phoenix (own
   virtualenv, see benchmarks/peer_phoenix.py), its figures next to Nightshift's.

Progress goes to stderr; the report (plain text) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/hardening: the shared process helpers
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
import otlp_load  # noqa: E402
from hardening.proc import free_port  # noqa: E402  one helper for every harness
from harness import Target, fmt, log, pct, verdict  # noqa: E402
from otlp_load import MB, SenderPool, Sent, Template  # noqa: E402

# NB: grpc and polars are imported only where used (grpc in the sender processes,
# polars after the senders are gone): both start threads, and the senders are forked.

# Targets printed next to the figures.
T_ACK_PER_CORE = Target(">=", 100_000, "100,000 per core")
T_RAW_RATIO = Target(">=", 0.3)
T_PARQUET_PER_CORE = Target(">=", 50_000, "50,000 per core")
T_FLUSHER_PER_CORE = Target(">=", 40_000, "40,000 per CPU-second", name="flusher target")  # issue 16
T_HALF_P99_MS = Target("<", 20.0, "20 ms")
T_RSS_RATE = 50_000  # spans/s at which the RSS target applies
FORMS = ("auto", "process", "thread")  # collector.flusher
#: What a sidecar's memory and flush speed depend on, besides the flusher's form
#: and gRPC: set in this benchmark's environment, the collector inherits them.
MEMORY_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "ARROW_DEFAULT_MEMORY_POOL")


def settings_tag(form: str, resolved: str, no_grpc: bool, environ=os.environ,
                 flush_interval: float | None = None) -> str:
    """Which settings a collector ran with, for the targets' lines: the collector's
    defaults unless a NIGHTSHIFT_COLLECTOR_* variable or an allocator variable was
    set where the benchmark ran (the collector inherits them), the flusher's form
    as asked and as resolved, and gRPC. The flush interval, given, is named too:
    it is the benchmark's own (`--flush-interval`), not the collector's 10 s, and
    the ratio depends on it (a 10 s segment reaches Parquet 10 s late whatever the
    flusher's speed), so a line read alone must say so."""
    told = [f"{k.removeprefix('NIGHTSHIFT_COLLECTOR_').lower()}={v}" for k, v in sorted(environ.items())
            if k.startswith("NIGHTSHIFT_COLLECTOR_") and k not in ("NIGHTSHIFT_COLLECTOR_FLUSHER",
                                                                   "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL")]
    told += [f"{k}={environ[k]}" for k in MEMORY_ENV if environ.get(k)]
    flusher = f"flusher {form}" + (f"->{resolved}" if resolved != form else "")
    interval = [] if flush_interval is None else [f"flush_interval {flush_interval:g} s (the benchmark's)"]
    return ", ".join([flusher, "grpc off" if no_grpc else "grpc on", *interval,
                      *(told or ["the rest at the defaults"])])


#: The collector's settings the flusher alone reads as the running collector does
#: (`_ALONE`): what its CPU-seconds per span depend on besides the spans.
FLUSHER_SETTINGS = ("flush_chunk_bytes", "compression", "dedup_memory", "dedup_window")


def flusher_tag(environ=os.environ) -> str:
    """The settings the flusher alone ran with, by value (`FLUSHER_SETTINGS` as the
    collector reads them from `environ`, and Arrow's allocator as the flusher
    chooses it), each marked where a variable set it: its line is a target's
    companion, compared across runs that may not share their variables."""
    from nightshift.collector import flusher_process
    from nightshift.collector.config import CollectorConfig
    from nightshift.settings import load

    env = {k: v for k, v in environ.items() if k.startswith("NIGHTSHIFT_COLLECTOR_")}
    cfg = load(CollectorConfig, "collector", env=env, check=False)
    parts = []
    for name in FLUSHER_SETTINGS:
        v = getattr(cfg, name)
        text = f"{v / 2**20:g}MiB" if name.endswith(("_bytes", "_memory")) else f"{v:g}s" if isinstance(v, float) else str(v)
        parts.append(f"{name}={text}" + (" (set)" if f"NIGHTSHIFT_COLLECTOR_{name.upper()}" in env else ""))
    pool = flusher_process.child_environment(environ)["ARROW_DEFAULT_MEMORY_POOL"]
    parts.append(f"Arrow pool {pool}" + (" (set)" if environ.get("ARROW_DEFAULT_MEMORY_POOL") else ""))
    parts += [f"{k}={environ[k]}" for k in MEMORY_ENV if k != "ARROW_DEFAULT_MEMORY_POOL" and environ.get(k)]
    return ", ".join(parts)
T_RSS_MB = Target("<=", 150.0, f"150 MB at {T_RSS_RATE // 1000}k spans/s", name="sidecar RSS")  # issue 28
T_SUSTAINED = Target(">=", 0.8, "0.8x the acknowledged rate", name="sustained/acknowledged")  # issue 28

PEERS = (
    "peer references (not measured here):",
    "  Arize Phoenix: ~126 spans/s persisted on this kind of machine",
    "  Agent Lightning 0.3, OTLP path: ~1,400 spans/s",
)


# --------------------------------------------------------------------------------------
# Raw loop: parse + append + fdatasync, nothing else
# --------------------------------------------------------------------------------------


def parquet_tradeoff(templates: list[Template], chunk_rows: int = 1536) -> list[str]:
    """Write speed (MB of protobuf per CPU-second) against file size for the codecs
    and levels worth considering, with the flusher's dictionary and statistics
    columns, in row groups of a flush chunk's size: the measurement behind
    `collector.datasets.PARQUET_OPTIONS`."""
    import io

    import pyarrow.parquet as pq

    from nightshift.collector import datasets
    from nightshift.collector.otlp_arrow import spans_table

    payloads = [t.fresh(bytearray(t.data)) for t in templates]
    spans_table(payloads[:1], [0])  # the converter is built on first use
    t0 = time.process_time()
    table = spans_table(payloads, [time.time_ns()] * len(payloads)).table
    conv = time.process_time() - t0
    raw = sum(len(p) for p in payloads)
    out = [f"{table.num_rows:,} spans, {raw / 1e6:.0f} MB of protobuf; conversion to Arrow: "
           f"{table.num_rows / conv:,.0f} spans per CPU-second"]
    base = datasets.parquet_options(table.schema)
    chosen = (datasets.PARQUET_OPTIONS["compression"], datasets.PARQUET_OPTIONS.get("compression_level"))
    for codec, level in (("zstd", 1), ("zstd", 3), ("zstd", 6), ("snappy", None), ("lz4_raw", None), ("none", None)):
        opts = {**base, "compression": codec}
        opts.pop("compression_level", None)
        if level is not None:
            opts["compression_level"] = level
        best, size = float("inf"), 0
        for _ in range(2):
            buf = io.BytesIO()
            t0 = time.process_time()
            w = pq.ParquetWriter(buf, table.schema, **opts)
            for i in range(0, table.num_rows, chunk_rows):
                w.write_table(table.slice(i, chunk_rows))
            w.close()
            best, size = min(best, time.process_time() - t0), len(buf.getvalue())
        name = codec + (f" {level}" if level is not None else "")
        mark = "  <- the flusher's" if (codec, level) == chosen else ""
        out.append(f"{name:8s} {raw / best / 1e6:6.0f} MB/s ({table.num_rows / best:8,.0f} spans/s)   "
                   f"file {size / raw:.3f} of the protobuf{mark}")
    return out


#: What `flusher_alone` runs in a fresh process: the flusher's imports and
#: allocator, one small segment to build the converter, then the measured one;
#: then, for each running sidecar in `_STEADY`, a 25k-span segment of new ids into
#: a store whose duplicate check holds what that sidecar's holds: the collector's
#: default budget of keys (collector.dedup_memory), from that many flushes.
#: The peak is the process's VmHWM: its ru_maxrss is at least the RSS of the
#: benchmark process that started it (Linux carries the high-water mark across
#: fork and exec), which is where the 257 and 681 MiB "flusher" peaks of earlier
#: runs came from (a 500 MiB parent gives a 11 MiB child a ru_maxrss of 511 MiB).
_ALONE = """
import json, sys, time
from pathlib import Path
import numpy as np
from nightshift.collector import flusher_process
sys.meta_path.insert(0, flusher_process.Unused())
from nightshift.collector.config import CollectorConfig
from nightshift.collector.datasets import DatasetStore
from nightshift.collector.flusher import _release, flush_segment
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def peak_rss():  # this process's own high-water mark; ru_maxrss keeps the parent's across fork and exec
    return next(int(line.split()[1]) / 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
warm, seg, steady_seg, data = sys.argv[1:5]
from nightshift.settings import load
cfg = load(CollectorConfig, "collector", check=False)  # NIGHTSHIFT_COLLECTOR_* as the collector reads them
store = DatasetStore(data + "/fresh", window_s=cfg.dedup_window, key_budget=cfg.dedup_memory)
imports = rss()
flush_segment(Path(warm), store, chunk_bytes=cfg.flush_chunk_bytes)
_release()
t0 = time.process_time()
spans = flush_segment(Path(seg), store, chunk_bytes=cfg.flush_chunk_bytes).spans
cpu = time.process_time() - t0
out = {"spans": spans, "cpu": cpu, "imports_mib": imports, "peak_mib": peak_rss(), "steady": []}
for flushes in json.loads(sys.argv[5]):
    _release()
    store = DatasetStore(f"{data}/steady-{flushes}", window_s=cfg.dedup_window, key_budget=cfg.dedup_memory)
    flush_segment(Path(warm), store, chunk_bytes=cfg.flush_chunk_bytes)
    rng, (_, date) = np.random.default_rng(0), next(iter(store._index))
    keys = cfg.dedup_memory // 16 // flushes
    for _ in range(flushes):
        store.remember("spans", date, [(rng.integers(0, 2**63, keys, dtype=np.uint64),
                                        rng.integers(0, 2**63, keys, dtype=np.uint64))])
    frames = len(store._index[("spans", date)].frames)
    t0 = time.process_time()
    n = flush_segment(Path(steady_seg), store, chunk_bytes=cfg.flush_chunk_bytes).spans
    out["steady"].append({"flushes": flushes, "keys": keys, "frames": frames, "per_100k": 1e5 * (time.process_time() - t0) / n})
# Where a flush's CPU goes: the measured segment again, into a store of its own, each
# step timed (after the figures above, so the timers cost them nothing).
from nightshift.collector import convert, datasets, otlp_arrow, wal
import pyarrow.parquet as pq
acc = {}
def timed(label, f):
    def g(*a, **k):
        t0 = time.process_time()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.process_time() - t0
    return g
read = wal.read_segment
def read_timed(path):
    it = read(path)
    while True:
        t0 = time.process_time()
        try:
            record = next(it)
        except StopIteration:
            return
        finally:
            acc["wal"] = acc.get("wal", 0.0) + time.process_time() - t0
        yield record
class Handler:
    def __init__(self, h):
        self.list_to_record_batch = timed("ptars", h.list_to_record_batch)
any_handler, trace_handler = otlp_arrow._handler, Handler(otlp_arrow._handler("trace"))
otlp_arrow._handler = lambda message="trace": trace_handler if message == "trace" else any_handler(message)
wal.read_segment = read_timed
convert.spans_table = timed("conversion", convert.spans_table)
datasets.PartitionedWriter.add = timed("add", datasets.PartitionedWriter.add)
datasets.PartitionedWriter.commit = timed("commit", datasets.PartitionedWriter.commit)
pq.ParquetWriter.write_table = timed("encode", pq.ParquetWriter.write_table)
_release()
store = DatasetStore(data + "/profile", window_s=cfg.dedup_window, key_budget=cfg.dedup_memory)
flush_segment(Path(warm), store, chunk_bytes=cfg.flush_chunk_bytes)
acc.clear()
t0 = time.process_time()
n = flush_segment(Path(seg), store, chunk_bytes=cfg.flush_chunk_bytes).spans
total = time.process_time() - t0
g = lambda k: acc.get(k, 0.0)
parts = {"Parquet encode": g("encode"), "protobuf to Arrow (ptars)": g("ptars"),
         "column operations": g("conversion") - g("ptars"), "duplicate check": g("add") - g("encode"),
         "WAL read and CRC": g("wal"), "close and fsync": g("commit")}
parts["other"] = total - sum(parts.values())
out["parts"] = {k: 1e5 * v / n for k, v in parts.items()}
out["parts_total"] = 1e5 * total / n
print(json.dumps(out))
"""

#: The running sidecars `flusher_alone` measures, by the flushes (0.5 s apart) its
#: duplicate check's keys came from: 20 s at 50k spans/s; 10 minutes at 1.7k spans/s.
_STEADY = (40, 1200)


def flusher_alone(directory: Path, templates: list[Template], spans: int = 100_000) -> dict:
    """The flusher's own speed and memory, apart from the load: a fresh process
    with the flusher's imports and allocator flushes one WAL segment of about
    `spans` of this run's spans (new ids each request). CPU-seconds per span do
    not depend on what else the machine runs, so this is the figure to compare
    across runs; the ratio under load depends on the core the flusher gets."""
    from nightshift.collector import flusher_process, wal

    directory.mkdir(parents=True, exist_ok=True)

    def segment(name: str, n_spans: int) -> Path:
        p, done, i = directory / name, 0, 0
        with open(p, "wb") as f:
            f.write(wal.MAGIC)
            while done < n_spans:
                t = templates[i % len(templates)]
                f.write(wal.encode_record(wal.KIND_TRACES, time.time_ns(), bytes(t.fresh(bytearray(t.data)))))
                done, i = done + t.spans, i + 1
        return p

    warm, seg = segment("00000000000000000001.sealed", 1), segment("00000000000000000002.sealed", spans)
    again = segment("00000000000000000003.sealed", spans // 4)
    env = {**flusher_process.child_environment(os.environ), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _ALONE, str(warm), str(seg), str(again), str(directory / "data"),
                          json.dumps(_STEADY)], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"flusher alone failed: {out.stderr[-2000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["per_cpu"] = res["spans"] / res["cpu"] if res["cpu"] else float("nan")
    res["segment_mib"] = seg.stat().st_size / MB
    return res


def parts_line(alone: dict) -> str:
    """Where the flusher's CPU goes, largest first (a second, timed flush of the same segment)."""
    parts = sorted(alone.get("parts", {}).items(), key=lambda kv: -kv[1])
    return (f"where it goes ({alone.get('parts_total', float('nan')):.2f} CPU-s per 100k spans, timed): "
            + ", ".join(f"{k} {v:.2f}" for k, v in parts))


def steady_line(alone: dict) -> str:
    """The flusher's cost once its duplicate check is full, as in a running sidecar."""
    return "with a running sidecar's duplicate check (default key budget full): " + ", ".join(
        f"{s['per_100k']:.2f} CPU-s per 100k spans after {s['flushes']:,} flushes ({s['frames']} frames searched)"
        for s in alone["steady"])


def raw_loop(directory: Path, templates: list[Template], seconds: float, group: int) -> dict:
    seg = 0
    rotate = 256 * MB

    def open_file(n: int) -> int:
        return os.open(directory / f"raw-{group}-{n}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    fd = open_file(seg)
    size = 0
    reqs = spans = nbytes = pending = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    try:
        while True:
            t = templates[reqs % len(templates)]
            ExportTraceServiceRequest.FromString(t.data)  # the decode the collector must do
            view = memoryview(t.data)
            while view:
                view = view[os.write(fd, view):]
            size += len(t.data)
            reqs += 1
            spans += t.spans
            nbytes += len(t.data)
            pending += 1
            if pending >= group:
                os.fdatasync(fd)
                pending = 0
                if time.perf_counter() >= deadline:
                    break
                if size >= rotate:  # like a WAL segment roll
                    os.close(fd)
                    os.unlink(directory / f"raw-{group}-{seg}.log")
                    seg += 1
                    fd = open_file(seg)
                    size = 0
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
        os.unlink(directory / f"raw-{group}-{seg}.log")
    return {"reqs": reqs, "spans": spans, "bytes": nbytes, "elapsed": elapsed, "cpu": cpu,
            "spans_s": spans / elapsed, "mb_s": nbytes / MB / elapsed, "per_cpu": spans / cpu if cpu else float("nan")}


# --------------------------------------------------------------------------------------
# Collector process, metrics, RSS sampling
# --------------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read()


def metrics(port: int) -> dict[str, float]:
    # The collector refreshes its flusher gauges (nightshift_flushed, ...) only when
    # /healthz is served, not on /metrics; ask for /healthz first so they are current.
    try:
        http_get(port, "/healthz", timeout=5.0)
    except urllib.error.HTTPError:
        pass  # 503 while shutting down: the gauges were still refreshed
    out = {}
    for line in http_get(port, "/metrics", timeout=5.0).decode().splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        try:
            out[key] = float(val)
        except ValueError:
            pass
    return out


FLUSHED = 'nightshift_flushed{signal="traces"}'
ACCEPTED = 'nightshift_accepted_total{signal="traces"}'


def cpu_seconds(p: psutil.Process | None) -> float:
    if p is None:
        return 0.0
    try:
        t = p.cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def thread_cpu_seconds(p: psutil.Process | None, tid: int) -> float:
    """One thread's CPU seconds (the flusher's, in the thread form)."""
    if p is None or not tid:
        return 0.0
    try:
        return next((t.user_time + t.system_time for t in p.threads() if t.id == tid), 0.0)
    except psutil.Error:
        return 0.0


def anon_mib(p: psutil.Process | None) -> float:
    """A process's anonymous resident memory (RssAnon): its RSS less the pages of
    mapped files (libarrow's code, 40-50 MiB in the flusher), which the kernel
    shares between processes and may drop under pressure."""
    if p is None:
        return 0.0
    try:
        with open(f"/proc/{p.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


@dataclass
class RssStats:
    max_r: float = 0.0
    max_f: float = 0.0
    max_sum: float = 0.0
    sum_sum: float = 0.0
    n: int = 0
    max_anon_sum: float = 0.0  # peak of receiver + flusher RssAnon

    def add(self, r: float, f: float, anon: float = 0.0) -> None:
        self.max_r = max(self.max_r, r)
        self.max_f = max(self.max_f, f)
        self.max_sum = max(self.max_sum, r + f)
        self.max_anon_sum = max(self.max_anon_sum, anon)
        self.sum_sum += r + f
        self.n += 1

    @property
    def mean_sum(self) -> float:
        return self.sum_sum / self.n if self.n else 0.0


class Collector:
    def __init__(self, root: Path, flush_interval: float, env: dict[str, str] | None = None, grpc: bool = True,
                 form: str = "process"):
        self.root = root
        self.grpc = grpc  # False: HTTP alone, as a sidecar for HTTP exporters runs (gRPC is 16-17 MiB of a receiver)
        self.form = form  # collector.flusher: its own process, or a thread of the receiver's (one process to measure)
        self.env = {"NIGHTSHIFT_COLLECTOR_FLUSHER": form, **(env or {})}
        self.data = root / "data"
        self.wal = root / "wal"
        self.log_path = root / "collector.log"
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.flush_interval = flush_interval
        self.proc: subprocess.Popen | None = None
        self.ps: psutil.Process | None = None
        self.flusher: psutil.Process | None = None  # the flusher's own process; None in the thread form
        self.flusher_tid = 0  # the thread form: the flusher's thread in the receiver's process
        self.resolved = form  # the form /healthz reports (`auto` is a thread on a folder, a process on a bucket)
        self._log = None

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "nightshift.cli", "collect",
            "--data", str(self.data), "--wal", str(self.wal),
            "--grpc", f"127.0.0.1:{self.grpc_port}" if self.grpc else "off", "--http", f"127.0.0.1:{self.http_port}",
        ]
        env = {**os.environ, "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": str(self.flush_interval), **self.env}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            self.check_alive()
            try:
                info = json.loads(http_get(self.http_port, "/healthz", timeout=1.0))
                if info.get("status") == "ok" and info.get("flusher_pid"):
                    self._set_flusher(info)
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"collector not healthy after 60 s; log:\n{self.log_tail()}")

    def _set_flusher(self, info: dict) -> None:
        """The flusher's process, or in the thread form its thread (its process is
        the receiver's: counting it as a flusher would count the sidecar twice)."""
        self.resolved = info.get("flusher") or self.form  # `auto` resolved by the collector
        if info.get("flusher") == "thread":
            self.flusher, self.flusher_tid = None, int(info.get("flusher_tid") or 0)
        elif self.flusher is None or self.flusher.pid != info["flusher_pid"]:
            self.flusher = psutil.Process(info["flusher_pid"])

    def refresh_flusher(self) -> None:
        try:
            info = json.loads(http_get(self.http_port, "/healthz", timeout=1.0))
            if info.get("flusher_pid"):
                self._set_flusher(info)
        except (OSError, ValueError, psutil.Error):
            pass

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"collector exited with {self.proc.returncode}; log:\n{self.log_tail()}")

    def cpu(self) -> tuple[float, float]:
        """(receiver, flusher) CPU seconds; in the thread form the flusher's is its
        thread's, and the receiver's the rest of the process."""
        if self.resolved != "thread":
            return cpu_seconds(self.ps), cpu_seconds(self.flusher)
        whole, thread = cpu_seconds(self.ps), thread_cpu_seconds(self.ps, self.flusher_tid)
        return whole - thread, thread

    def log_tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 300.0) -> tuple[int, float]:
        """SIGTERM: drain, flush, exit. Returns (exit code, seconds)."""
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, time.perf_counter() - t0

    def kill(self) -> None:
        """Last resort on error: the collector and its flusher, by pid."""
        procs = []
        if self.ps is not None:
            try:
                procs = self.ps.children(recursive=True)
            except psutil.Error:
                procs = []
        if self.flusher is not None and all(p.pid != self.flusher.pid for p in procs):
            procs.append(self.flusher)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None


class Sampler(threading.Thread):
    """RSS of the receiver and the flusher every 100 ms, by phase label."""

    def __init__(self, coll: Collector):
        super().__init__(name="rss-sampler", daemon=True)
        self.coll = coll
        self.label = "start"
        self.stats: dict[str, RssStats] = {}
        self.all = RssStats()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.1):
            try:
                r = self.coll.ps.memory_info().rss / MB
            except psutil.Error:
                continue
            try:
                f = self.coll.flusher.memory_info().rss / MB if self.coll.flusher else 0.0
            except psutil.Error:
                f = 0.0
                self.coll.refresh_flusher()
            anon = anon_mib(self.coll.ps) + anon_mib(self.coll.flusher)
            self.all.add(r, f, anon)
            self.stats.setdefault(self.label, RssStats()).add(r, f, anon)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(2)


# --------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------


@dataclass
class Phase(Sent):
    """One load phase: what the senders did (Sent) and what it cost the collector."""

    name: str = ""
    start: float = 0.0
    end: float = 0.0
    cpu_r: float = 0.0
    cpu_f: float = 0.0
    busy: float = 0.0  # machine CPU seconds busy (all cores)
    target_rate: float = 0.0
    commits: float = 0.0
    commit_reqs: float = 0.0
    cpu_start: tuple | None = None  # (receiver, flusher) CPU seconds at the start
    main_cpu: float = 0.0  # this process (RSS sampler, metrics polling)

    @property
    def other_cpu(self) -> float:
        """Busy CPU seconds not used by the collector, the senders or this process:
        kernel threads (writeback, softirq) and anything else running on the machine."""
        return max(0.0, self.busy - self.cpu_r - self.cpu_f - self.sender_cpu - self.main_cpu)

    @property
    def elapsed(self) -> float:
        return max(1e-9, self.end - self.start)

    @property
    def rate(self) -> float:
        return self.acked_spans / self.elapsed


def run_phase(senders: SenderPool, coll: Collector, sampler: Sampler, name: str, seconds: float, rate: float | None,
              spans_per_request: int) -> Phase:
    """One phase of `seconds`: closed loop, or `rate` spans/s open loop; the CPU of
    the receiver, the flusher, the machine and this process over it, and the WAL's
    group commits."""
    senders.prepare()
    ph = Phase(name=name, target_rate=rate or 0.0)
    m0 = metrics(coll.http_port)
    start_at = senders.start(seconds, rate, spans_per_request)
    sampler.label = name
    r0, f0 = coll.cpu()
    b0, _ = harness.machine_busy()
    ph.cpu_start = (r0, f0)
    m_cpu0 = time.process_time()
    results = senders.results(start_at + seconds + 120, coll.check_alive,
                              "senders did not finish within 120 s of the end of the phase")
    r1, f1 = coll.cpu()
    b1, _ = harness.machine_busy()
    ph.main_cpu = time.process_time() - m_cpu0
    sampler.label = f"after {name}"
    m1 = metrics(coll.http_port)
    ph.add_all(results)
    ph.start = start_at
    ph.end = ph.last_done
    ph.cpu_r, ph.cpu_f, ph.busy = r1 - r0, f1 - f0, b1 - b0
    ph.commits = m1.get("nightshift_wal_group_commit_requests_count", 0) - m0.get("nightshift_wal_group_commit_requests_count", 0)
    ph.commit_reqs = m1.get("nightshift_wal_group_commit_requests_sum", 0) - m0.get("nightshift_wal_group_commit_requests_sum", 0)
    return ph


@dataclass
class Drain:
    done: bool
    at: float  # perf_counter when flushed reached the target
    flushed: float
    cpu_r: float = 0.0
    cpu_f: float = 0.0


def wait_flushed(coll: Collector, target: int, timeout: float) -> Drain:
    deadline = time.perf_counter() + timeout
    flushed = 0.0
    while True:
        coll.check_alive()
        now = time.perf_counter()
        try:
            flushed = metrics(coll.http_port).get(FLUSHED, 0.0)
        except OSError:
            flushed = flushed
        if flushed >= target:
            return Drain(True, now, flushed, *coll.cpu())
        if now > deadline:
            return Drain(False, now, flushed)
        time.sleep(0.1)


def drain_cpu(full: Phase, drain: Drain) -> tuple[float, float] | None:
    """(receiver + flusher CPU, flusher CPU) from the start of the full-load phase
    until the drain completed."""
    if full.cpu_start is None:
        return None
    r0, f0 = full.cpu_start
    return (drain.cpu_r - r0) + (drain.cpu_f - f0), drain.cpu_f - f0


def spans_left_in_wal(wal_dir: Path) -> int:
    """Spans in WAL segments the collector left behind at shutdown (normally none)."""
    segments = [p for p in wal_dir.glob("*") if p.suffix in (".sealed", ".active")]
    if not segments:
        return 0
    from nightshift.collector import wal  # imported late: it pulls in grpc

    n = 0
    for p in segments:
        for kind, _, payload in wal.read_segment(p):
            if kind == wal.KIND_TRACES:
                req = ExportTraceServiceRequest.FromString(payload)
                n += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
    return n


def fs_of(path: Path) -> str:
    best = None
    p = str(path.resolve())
    for part in psutil.disk_partitions(all=True):
        mp_ = part.mountpoint
        if p == mp_ or p.startswith(mp_.rstrip("/") + "/"):
            if best is None or len(mp_) > len(best.mountpoint):
                best = part
    return f"{best.fstype} on {best.device} (mounted at {best.mountpoint})" if best else "unknown filesystem"


# --------------------------------------------------------------------------------------
# The measurement, step by step
# --------------------------------------------------------------------------------------


@dataclass
class Processes:
    """What the run started and must stop, whatever happens."""

    coll: Collector | None = None
    senders: SenderPool | None = None
    sampler: Sampler | None = None
    backlog: "BacklogSampler | None" = None

    def kill(self) -> None:
        if self.backlog is not None:
            self.backlog.stop()
        if self.sampler is not None:
            self.sampler.stop()
        if self.senders is not None:
            self.senders.kill()
        if self.coll is not None:
            self.coll.kill()


@dataclass
class Load:
    """The collector under load: its phases, the waits for Parquet, how it stopped."""

    warm: Phase
    full: Phase
    half: Phase
    drain_full: Drain
    drain_half: Drain
    flushed_at_end: float  # spans written to Parquet during the full-load window
    total_acked: int
    m_end: dict[str, float]  # the collector's counters after the load
    rc: int  # exit code after SIGTERM
    stop_s: float
    rss: Sampler
    sustained: "Sustained | None" = None
    form: str = "process"  # collector.flusher: its own process, or a thread of the receiver's
    resolved: str = ""  # the form the collector reported (`auto` resolved)


@dataclass
class Stored:
    rows: int
    unique: int  # distinct (trace_id, span_id)
    in_wal: int  # spans left in the WAL after shutdown


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__, temp_dir=True, keep=True,
                        peer={"phoenix": "Arize Phoenix in its own venv, see benchmarks/peer_phoenix.py; "
                                         "after the Nightshift phases, with the same load (--seconds, --senders)"})
    otlp_load.add_load_flags(ap)
    ap.add_argument("--half-seconds", type=float, default=None, help="half-load phase duration (default: --seconds)")
    ap.add_argument("--span-kb", default="1,5",
                    help="span sizes in KB, one collector run each (default 1,5; 0: the 1-10 KB mix)")
    ap.add_argument("--transport", choices=("http", "grpc"), default="http")
    ap.add_argument("--no-grpc", action="store_true",
                    help="the collector listens on HTTP alone (--grpc off), as a sidecar for HTTP exporters may: "
                         "gRPC is 16-17 MiB of the receiver's RSS; with --transport http only")
    ap.add_argument("--warmup", type=float, default=1.0, help="warm-up seconds before the full-load phase, not counted")
    ap.add_argument("--raw-seconds", type=float, default=4.0, help="duration of each raw-loop variant (default 4)")
    ap.add_argument("--flush-interval", type=float, default=0.5,
                    help="NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL: seconds before a WAL segment goes to the flusher (default 0.5)")
    ap.add_argument("--secret-fraction", type=float, default=0.0,
                    help="fraction of spans whose user message contains an API key (exercises redaction); default 0")
    ap.add_argument("--drain-timeout", type=float, default=300.0, help="max seconds to wait for Parquet to catch up")
    ap.add_argument("--overload-cap", type=float, default=128.0,
                    help="MiB: the WAL cap of the sustained-overload run (a second collector per size, held at its cap "
                         "by full load: clients get 503 past it); 0 skips it (default 128)")
    ap.add_argument("--overload-seconds", type=float, default=None,
                    help="measured seconds at the cap, after as many seconds filling it (default: --seconds)")
    ap.add_argument("--sustained-rate", type=float, default=float(T_RSS_RATE),
                    help=f"spans/s offered in the sustained phase, open loop (default {T_RSS_RATE}: the rate issue 28's "
                         "targets name); 0 skips the phase")
    ap.add_argument("--sustained-seconds", type=float, default=30.0,
                    help="duration of the sustained phase (default 30: a million spans at 50k/s)")
    ap.add_argument("--flusher", default="auto",
                    help="collector.flusher forms to measure, one collector run each per size: auto (the collector's "
                         "default: a thread on the benchmark's folder), process, thread, or a list (process,thread: "
                         "both in the same run; the sidecar table says which line is which); default auto")
    ap.add_argument("--peer-persist-timeout", type=float, default=120.0,
                    help="max seconds after the peer's load to wait for its spans to be persisted (default 120)")
    args = ap.parse_args()
    if args.senders < 1 or args.spans_per_request < 1 or args.templates < 1 or args.seconds <= 0:
        ap.error("--senders, --spans-per-request, --templates and --seconds must be positive")
    try:
        args.sizes = [float(x) for x in args.span_kb.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--span-kb takes sizes in KB separated by commas (1,5), not {args.span_kb!r}")
    args.forms = [f.strip() for f in args.flusher.split(",") if f.strip()]
    if not args.forms or any(f not in FORMS for f in args.forms) or len(set(args.forms)) < len(args.forms):
        ap.error(f"--flusher takes auto, process, thread or a list of them (process,thread), not {args.flusher!r}")
    if args.no_grpc and args.transport != "http":
        ap.error("--no-grpc needs --transport http (the load's own transport stays on)")
    if args.sustained_rate < 0 or args.sustained_seconds <= 0:
        ap.error("--sustained-rate takes spans/s (0 skips the phase) and --sustained-seconds a positive duration")
    if args.overload_cap < 0 or (args.overload_seconds is not None and args.overload_seconds <= 0):
        ap.error("--overload-cap takes MiB (0 skips the overload run) and --overload-seconds a positive duration")
    if not args.sizes or any(k < 0 for k in args.sizes):
        ap.error(f"--span-kb takes sizes in KB separated by commas (1,5), not {args.span_kb!r}")
    return args


def build_workload(args: argparse.Namespace, rep: harness.Report, kb: float = 0.0) -> list[Template]:
    log(f"building {args.templates} request templates x {args.spans_per_request} spans")
    t0 = time.perf_counter()
    templates = otlp_load.build_templates(args.templates, args.spans_per_request, args.secret_fraction,
                                          otlp_load.span_range(kb))
    sizes = sorted(s for t in templates for s in t.span_sizes)
    req_sizes = [len(t.data) for t in templates]
    buf = bytearray(templates[0].data)
    n = 50
    tp0 = time.perf_counter()
    for _ in range(n):
        templates[0].fresh(buf)
    patch_ms = (time.perf_counter() - tp0) / n * 1e3
    rep.say(f"workload: {args.templates} templates x {args.spans_per_request} GenAI chat spans (built in "
            f"{time.perf_counter() - t0:.1f} s); span size min/median/mean/max "
            f"{sizes[0]:,}/{sizes[len(sizes) // 2]:,}/{sum(sizes) // len(sizes):,}/{sizes[-1]:,} B; "
            f"request {min(req_sizes) / MB:.2f}-{max(req_sizes) / MB:.2f} MiB; new ids per send: {patch_ms:.2f} ms of sender CPU")
    return templates


def measure_raw(tmp: Path, templates: list[Template], seconds: float) -> tuple[dict, dict]:
    """The raw loops, before anything else runs: fdatasync per request, then per 8."""
    log(f"raw loop: FromString + append + fdatasync per request, {seconds:.0f} s")
    raw1 = raw_loop(tmp, templates, seconds, 1)
    log(f"raw loop: group commit every 8 requests, {seconds:.0f} s")
    raw8 = raw_loop(tmp, templates, seconds, 8)
    return raw1, raw8


def measure_collector(tmp: Path, templates: list[Template], args: argparse.Namespace, procs: Processes,
                      form: str = "process") -> Load:
    """warm-up -> full load (closed loop) -> wait until Parquet has everything ->
    half of the measured peak (open loop) -> wait -> SIGTERM; the flusher as
    `form` (collector.flusher)."""
    # senders forked now: before any thread (sampler, grpc, polars) exists
    coll = procs.coll = Collector(tmp, args.flush_interval, grpc=not args.no_grpc, form=form)
    port = coll.http_port if args.transport == "http" else coll.grpc_port
    senders = procs.senders = SenderPool(args.senders, args.transport, port, templates)

    log(f"starting the collector (flusher: {form})" + ("" if coll.grpc else " (HTTP alone: --grpc off)"))
    coll.start()
    sampler = procs.sampler = Sampler(coll)
    sampler.start()

    total_acked = 0
    log(f"warm-up {args.warmup:.0f} s ({args.senders} {args.transport} senders)")
    warm = run_phase(senders, coll, sampler, "warmup", args.warmup, None, args.spans_per_request)
    total_acked += warm.acked_spans
    d = wait_flushed(coll, total_acked, args.drain_timeout)
    if not d.done:
        raise RuntimeError(f"warm-up data not flushed after {args.drain_timeout:.0f} s")

    log(f"full load {args.seconds:.0f} s")
    full = run_phase(senders, coll, sampler, "full", args.seconds, None, args.spans_per_request)
    total_acked += full.acked_spans
    if full.acked_spans == 0:
        raise RuntimeError(f"nothing acknowledged under full load ({full.refused} refused, {full.errors} errors)")
    flushed_at_end = metrics(coll.http_port).get(FLUSHED, 0.0) - warm.acked_spans
    log(f"full load: {fmt(full.rate)} spans/s acknowledged; waiting for Parquet to catch up")
    sampler.label = "drain after full"
    drain_full = wait_flushed(coll, total_acked, args.drain_timeout)

    half_rate = full.rate / 2
    half_seconds = args.half_seconds or args.seconds
    log(f"half load: {fmt(half_rate)} spans/s for {half_seconds:.0f} s")
    half = run_phase(senders, coll, sampler, "half", half_seconds, half_rate, args.spans_per_request)
    total_acked += half.acked_spans
    sampler.label = "drain after half"
    drain_half = wait_flushed(coll, total_acked, args.drain_timeout)

    sustained = None
    if args.sustained_rate:
        sustained = measure_sustained(coll, senders, sampler, args, procs, total_acked)
        total_acked += sustained.phase.acked_spans

    senders.stop()
    procs.senders = None
    m_end = metrics(coll.http_port)
    sampler.label = "shutdown"
    log("SIGTERM: drain and exit")
    rc, stop_s = coll.stop()
    sampler.stop()
    return Load(warm, full, half, drain_full, drain_half, flushed_at_end, total_acked, m_end, rc, stop_s, sampler,
                sustained, form, coll.resolved)


@dataclass
class Sustained:
    """The sustained phase: `rate` spans/s offered open loop for a fixed time, the
    load issue 28's two targets are stated at. Its durable rate is what the
    flushed counter gained over the phase (sampled every 250 ms), not a drain
    afterwards: a sidecar is judged by what it keeps up with while the load runs."""

    phase: Phase
    samples: list[tuple[float, float, float, float]]  # BacklogSampler's (time, WAL bytes, lag s, flushed)
    flushed_before: float  # spans flushed before the phase (everything acknowledged before it: drained)
    spans_per_request: int
    drain: Drain

    def _last(self) -> tuple[float, float, float, float] | None:
        """The last sample taken while the phase ran (its end, to 250 ms)."""
        w = [x for x in self.samples if self.phase.start < x[0] <= self.phase.end + 0.05 and x[3] == x[3]]
        return w[-1] if w else None

    @property
    def offered(self) -> float:
        """Spans/s the senders got out as new batches (a refused batch's resend not
        counted again), against the rate asked."""
        return max(0, self.phase.sent - self.phase.refused) * self.spans_per_request / self.phase.elapsed

    @property
    def durable(self) -> float:
        """Spans/s written to Parquet while the phase ran."""
        last = self._last()
        if last is None:
            return float("nan")
        return (last[3] - self.flushed_before) / (last[0] - self.phase.start)

    @property
    def ratio(self) -> float:
        return self.durable / self.phase.rate if self.phase.rate else float("nan")

    @property
    def written(self) -> float:
        """Spans the flusher wrote while the phase ran."""
        last = self._last()
        return last[3] - self.flushed_before if last is not None else 0.0

    @property
    def backlog_spans(self) -> float:
        """Acknowledged in the phase and not yet in Parquet at its end (the last
        sample, up to 250 ms before the last acknowledgement: an overcount of at
        most that much)."""
        last = self._last()
        if last is None:
            return float("nan")
        return max(0.0, self.phase.acked_spans - (last[3] - self.flushed_before))

    @property
    def backlog_mib(self) -> float:
        last = self._last()
        return last[1] / MB if last is not None else float("nan")

    @property
    def lag_s(self) -> float:
        last = self._last()
        return last[2] if last is not None else float("nan")


def measure_sustained(coll: Collector, senders: SenderPool, sampler: Sampler, args: argparse.Namespace,
                      procs: Processes, acked_before: int) -> Sustained:
    """`--sustained-rate` spans/s for `--sustained-seconds`, open loop (a sender
    told 503 waits its Retry-After, as exporters do), with the backlog sampled;
    then the wait until Parquet holds it all."""
    log(f"sustained: {fmt(args.sustained_rate)} spans/s for {args.sustained_seconds:.0f} s, open loop")
    backlog = procs.backlog = BacklogSampler(coll)
    backlog.start()
    phase = run_phase(senders, coll, sampler, "sustained", args.sustained_seconds, args.sustained_rate,
                      args.spans_per_request)
    backlog.stop()
    procs.backlog = None
    sampler.label = "drain after sustained"
    drain = wait_flushed(coll, acked_before + phase.acked_spans, args.drain_timeout)
    return Sustained(phase, backlog.samples, float(acked_before), args.spans_per_request, drain)


def report_sustained_rate(rep: harness.Report, args: argparse.Namespace, load: Load) -> None:
    """The phase issue 28's targets are stated at, each figure against its target."""
    sus = load.sustained
    if sus is None:
        return
    ph = sus.phase
    rss = load.rss.stats.get("sustained", RssStats())
    rss_mb = rss.max_sum * MB / 1e6
    rep.say()
    rep.say(f"sustained at {fmt(args.sustained_rate)} spans/s, flusher as a {load.resolved or load.form} ({settings_tag(load.form, load.resolved or load.form, args.no_grpc, flush_interval=args.flush_interval)}; {args.senders} {args.transport} senders, open loop, "
            f"{args.sustained_seconds:.0f} s; issue 28's targets{'; the collector on HTTP alone, --grpc off' if args.no_grpc else ''}):")
    rep.extend(phase_lines(ph))
    rep.say(f"  offered {fmt(sus.offered)} spans/s of the {fmt(args.sustained_rate)} asked (sends late by more than "
            f"an interval: {ph.late:,})" + ("" if sus.offered >= 0.95 * args.sustained_rate else
                                          "; the senders, on this machine's cores, could not offer the rate asked"))
    rep.say(f"  acknowledged {fmt(ph.rate)} spans/s; to Parquet while it ran {fmt(sus.durable)} spans/s; "
            f"ratio {sus.ratio:.2f}   {T_SUSTAINED.check(sus.ratio)}")
    if ph.refused:
        rep.say(f"  told to retry (503 + Retry-After): {ph.refused:,} requests; the backlog reached the WAL's cap, so "
                "part of the offered load was pushed back and the ratio is over what the sidecar accepted, not over "
                "what was offered")
    rep.say(f"  backlog at the end: {fmt(sus.backlog_spans)} spans acknowledged and not yet in Parquet "
            f"({sus.backlog_mib:.0f} MiB of WAL, Parquet {sus.lag_s:.1f} s behind); "
            + (f"caught up {sus.drain.at - ph.end:.1f} s after the phase" if sus.drain.done
               else f"NOT caught up within {args.drain_timeout:.0f} s"))
    rep.say(f"  RSS during it: receiver max {rss.max_r:.0f} MiB, flusher max {rss.max_f:.0f} MiB, sum max "
            f"{rss.max_sum:.0f} MiB = {rss_mb:.0f} MB (anon {rss.max_anon_sum * MB / 1e6:.0f} MB)   "
            f"{T_RSS_MB.check(rss_mb)}{rss_note(ph.rate)}")
    written = sus.written
    if ph.acked_spans and written:
        per_f = ph.cpu_f / written  # CPU-s per span the flusher wrote in the phase
        left = (os.cpu_count() or 1) - (ph.cpu_r + ph.sender_cpu) / ph.elapsed
        rep.say(f"  CPU-s per 100k spans: receiver {1e5 * ph.cpu_r / ph.acked_spans:.2f} (acknowledged), flusher "
                f"{1e5 * per_f:.2f} (written), senders {1e5 * ph.sender_cpu / ph.acked_spans:.2f}; keeping up needs "
                f"{per_f * ph.rate:.2f} flusher cores at the acknowledged rate ({per_f * ph.target_rate:.2f} at "
                f"{fmt(ph.target_rate)}/s), {left:.2f} were left beside the receiver and the senders, it got "
                f"{ph.cpu_f / ph.elapsed:.2f}")


def count_stored(coll: Collector) -> Stored:
    log("counting Parquet rows")
    import polars as pl

    lf = pl.scan_parquet(f"{coll.data}/spans/**/*.parquet", hive_partitioning=True)
    rows = lf.select(pl.len()).collect().item()
    unique = lf.select(pl.struct("trace_id", "span_id").n_unique()).collect().item()
    return Stored(rows, unique, spans_left_in_wal(coll.wal))


# --------------------------------------------------------------------------------------
# Sustained overload: the sidecar held at its WAL cap
# --------------------------------------------------------------------------------------

WAL_BYTES = "nightshift_wal_bytes"
FLUSH_LAG = "nightshift_flush_lag_seconds"


class BacklogSampler(threading.Thread):
    """The collector's backlog (WAL bytes, flush lag) and its flushed-span counter
    every 250 ms. Under overload the durable rate is the counter's slope over the
    phase: the senders' totals count acknowledgements, and a drain afterwards would
    credit the flusher with time the load no longer ran."""

    def __init__(self, coll: Collector):
        super().__init__(name="backlog-sampler", daemon=True)
        self.coll = coll
        self.samples: list[tuple[float, float, float, float]] = []  # (perf_counter, WAL bytes, lag s, flushed spans)
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.25):
            try:
                m = metrics(self.coll.http_port)
            except OSError:
                continue
            nan = float("nan")
            self.samples.append((time.perf_counter(), m.get(WAL_BYTES, nan), m.get(FLUSH_LAG, nan), m.get(FLUSHED, nan)))

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(5)


@dataclass
class Overload:
    """A collector whose WAL is capped, under more load than it flushes: what the
    clients got (acknowledged, told 503) and what reached Parquet meanwhile."""

    cap: int  # bytes
    fill: Phase
    phase: Phase
    samples: list[tuple[float, float, float, float]]
    rss: RssStats
    drain: Drain
    rc: int
    stored: Stored

    @property
    def total_acked(self) -> int:
        return self.fill.acked_spans + self.phase.acked_spans

    def _window(self) -> list[tuple[float, float, float, float]]:
        return [x for x in self.samples if self.phase.start <= x[0] <= self.phase.end]

    @property
    def durable(self) -> float:
        """Spans/s written to Parquet while the phase ran (NaN: too few samples)."""
        w = self._window()
        if len(w) < 2 or w[-1][0] <= w[0][0]:
            return float("nan")
        return (w[-1][3] - w[0][3]) / (w[-1][0] - w[0][0])

    def backlog_mib(self) -> tuple[float, float, float]:
        """WAL MiB at the phase's start, its mean and its peak."""
        w = self._window()
        if not w:
            return (float("nan"),) * 3
        b = [x[1] / MB for x in w]
        return b[0], sum(b) / len(b), max(b)

    @property
    def lag_max(self) -> float:
        return max((x[2] for x in self._window()), default=float("nan"))

    @property
    def lost(self) -> int:
        return max(0, self.total_acked - self.stored.unique - self.stored.in_wal)


def measure_overload(tmp: Path, templates: list[Template], args: argparse.Namespace, procs: Processes,
                     form: str = "process") -> Overload:
    """A second collector, its WAL capped at --overload-cap MiB, under full load
    (closed loop): a fill phase takes the log to the cap, then the measured phase
    runs at it, the clients told 503 + Retry-After past it, as a sidecar whose
    agents send more than it can flush is. Then the drain, SIGTERM, and the count
    of what Parquet holds against what was acknowledged."""
    cap = int(args.overload_cap * MB)
    tmp.mkdir(parents=True, exist_ok=True)
    coll = procs.coll = Collector(tmp, args.flush_interval, {"NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES": str(cap)},
                                  grpc=not args.no_grpc, form=form)
    port = coll.http_port if args.transport == "http" else coll.grpc_port
    # spawned, not forked: this process has threads by now (polars' pool)
    senders = procs.senders = SenderPool(args.senders, args.transport, port, templates, start_method="spawn",
                                         name="overload-sender")
    log(f"overload: a collector with its WAL capped at {args.overload_cap:g} MiB")
    coll.start()
    sampler = procs.sampler = Sampler(coll)
    sampler.start()
    backlog = procs.backlog = BacklogSampler(coll)
    backlog.start()
    seconds = args.overload_seconds or args.seconds
    fill_s = max(2.0, seconds / 2)
    log(f"overload: filling the WAL, full load {fill_s:.0f} s")
    fill = run_phase(senders, coll, sampler, "overload fill", fill_s, None, args.spans_per_request)
    log(f"overload: at the cap, full load {seconds:.0f} s")
    phase = run_phase(senders, coll, sampler, "overload", seconds, None, args.spans_per_request)
    backlog.stop()
    procs.backlog = None
    sampler.label = "overload drain"
    drain = wait_flushed(coll, fill.acked_spans + phase.acked_spans, args.drain_timeout)
    senders.stop()
    procs.senders = None
    rc, _ = coll.stop()
    sampler.stop()
    stored = count_stored(coll)
    coll.kill()
    procs.coll = procs.sampler = None
    return Overload(cap, fill, phase, backlog.samples, sampler.stats.get("overload", RssStats()), drain, rc, stored)


def report_overload(rep: harness.Report, args: argparse.Namespace, over: Overload, load: Load) -> None:
    ph = over.phase
    start, mean, peak = over.backlog_mib()
    rss = over.rss
    rep.say()
    rep.say(f"sustained overload (a second collector, WAL capped at {over.cap / MB:g} MiB, full load {args.senders} "
            f"{args.transport} senders, closed loop; a refused sender waits the Retry-After it was sent, then resends the same spans):")
    rep.extend(phase_lines(ph))
    rep.say(f"  acknowledged {fmt(ph.rate)} spans/s; to Parquet while it ran {fmt(over.durable)} spans/s "
            f"(the flushed counter's slope); told to retry (503 / UNAVAILABLE): {ph.refused / ph.elapsed:.1f} requests/s")
    rep.say(f"  backlog (WAL): {start:.0f} MiB at the start, mean {mean:.0f}, peak {peak:.0f} MiB; Parquet at most "
            f"{over.lag_max:.1f} s behind")
    rep.say(f"  RSS: receiver max {rss.max_r:.0f} MiB, flusher max {rss.max_f:.0f} MiB, sum max {rss.max_sum:.0f} MiB "
            f"({rss.max_sum * MB / 1e6:.0f} MB, anon {rss.max_anon_sum * MB / 1e6:.0f} MB)")
    rep.say(f"  to Parquet under overload / unthrottled acknowledged rate ({fmt(load.full.rate)}/s): "
            f"{over.durable / load.full.rate:.2f} (the share of the offered load the sidecar keeps; the capped run's "
            f"own ratio, {over.durable / ph.rate:.2f}, is the cap at work, not the target)")
    total = over.total_acked
    rep.say(f"  verification: acknowledged {total:,} (fill + phase), Parquet rows {over.stored.rows:,} "
            f"({over.stored.unique:,} distinct); lost {over.lost:,}, duplicated {over.stored.rows - over.stored.unique:,}; "
            f"SIGTERM exit code {over.rc}" + ("" if over.drain.done else f"; NOT drained within {args.drain_timeout:.0f} s"))


def measure_peer(args: argparse.Namespace, templates: list[Template]):
    """The peer, same load, after Nightshift is gone."""
    if args.peer != "phoenix":
        return None
    from peer_phoenix import run_phoenix

    log("peer: Arize Phoenix")
    return run_phoenix(templates, senders=args.senders, seconds=args.seconds, spans_per_request=args.spans_per_request,
                       secret_fraction=args.secret_fraction, persist_timeout=args.peer_persist_timeout,
                       parent_dir=args.dir)


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


@dataclass
class Figures:
    """The figures the targets are about, computed once for the report's sections
    and its summary."""

    per_core: float  # acknowledged spans per receiver CPU-second, full load
    raw_ratio: float  # full-load rate / raw loop with an fdatasync per request
    sustained: float  # spans/s, first send -> Parquet has them all (NaN: it did not catch up)
    collector_cpu: tuple[float, float] | None  # (receiver + flusher, flusher) CPU-s until Parquet caught up
    per_collector_core: float
    per_flusher_core: float
    p99_half: float
    rss_half_mb: float  # peak RSS, receiver + flusher, at half load (MB, the target's unit)
    rss_full_mb: float  # peak RSS, receiver + flusher, under full load and until Parquet caught up (MB)
    anon_full_mb: float = float("nan")  # the same for RssAnon (file-backed pages left out)

    def ratio(self, full: Phase) -> float:
        """Sustained to Parquet over acknowledged (NaN: Parquet did not catch up)."""
        return self.sustained / full.rate if full.rate else float("nan")


def figures(load: Load, raw1: dict) -> Figures:
    full, drain = load.full, load.drain_full
    per_core = full.acked_spans / full.cpu_r if full.cpu_r else float("nan")
    sustained = full.acked_spans / (drain.at - full.start) if drain.done else float("nan")
    cpu = drain_cpu(full, drain)
    pc_all = pc_f = float("nan")
    if cpu is not None and drain.done:
        pc_all = full.acked_spans / cpu[0] if cpu[0] else float("nan")
        pc_f = full.acked_spans / cpu[1] if cpu[1] else float("nan")
    hs = load.rss.stats.get("half", RssStats())
    loaded = max((load.rss.stats.get(k, RssStats()).max_sum for k in ("full", "drain after full")), default=0.0)
    anon = max((load.rss.stats.get(k, RssStats()).max_anon_sum for k in ("full", "drain after full")), default=0.0)
    return Figures(per_core, full.rate / raw1["spans_s"], sustained, cpu, pc_all, pc_f, pct(load.half.lat, 99),
                   hs.max_sum * MB / 1e6, loaded * MB / 1e6, anon * MB / 1e6)


def report_raw(rep: harness.Report, raw1: dict, raw8: dict) -> None:
    rep.say()
    rep.say("raw loop (physical reference; 1 process, same request bytes, no collector running):")
    rep.say(f"  FromString + append + fdatasync per request: {fmt(raw1['spans_s'])} spans/s "
            f"({raw1['mb_s']:.0f} MiB/s, {raw1['reqs'] / raw1['elapsed']:.0f} req/s, {fmt(raw1['per_cpu'])} spans per CPU-second)")
    rep.say(f"  same, one fdatasync per 8 requests:         {fmt(raw8['spans_s'])} spans/s "
            f"({raw8['mb_s']:.0f} MiB/s, {raw8['reqs'] / raw8['elapsed']:.0f} req/s, {fmt(raw8['per_cpu'])} spans per CPU-second)")


def phase_lines(ph: Phase) -> list[str]:
    e = ph.elapsed
    ncpu = os.cpu_count() or 1
    out = [
        f"  acknowledged: {ph.acked_spans:,} spans in {ph.acked_reqs:,} requests over {ph.elapsed:.1f} s; "
        f"refused (503): {ph.refused:,}; errors: {ph.errors:,}; rejected spans: {ph.rejected:,}",
        f"  ack latency (send -> 200/OK) ms: p50 {pct(ph.lat, 50):.1f}, p90 {pct(ph.lat, 90):.1f}, "
        f"p99 {pct(ph.lat, 99):.1f}, max {pct(ph.lat, 100):.1f}",
        f"  CPU (cores): receiver {ph.cpu_r / e:.2f}, flusher {ph.cpu_f / e:.2f}, senders {ph.sender_cpu / e:.2f}, "
        f"other (kernel, other processes) {ph.other_cpu / e:.2f}; machine busy {ph.busy / e:.2f} of {ncpu}",
    ]
    if ph.commits:
        out.append(f"  WAL group commit: {ph.commit_reqs / ph.commits:.1f} requests per fsync ({ph.commits:.0f} fsyncs)")
    return out


def report_full(rep: harness.Report, args: argparse.Namespace, load: Load, fig: Figures, raw8: dict) -> None:
    full = load.full
    rep.say()
    rep.say(f"full load ({args.senders} {args.transport} senders, closed loop, {args.spans_per_request} spans/request):")
    rep.extend(phase_lines(full))
    rep.say(f"  acknowledged durable spans/s: {fmt(full.rate)} total; {fmt(fig.per_core)} per receiver core "
            f"(spans / receiver CPU-seconds; machine has {os.cpu_count() or 1} cores)")
    rep.say(f"    {T_ACK_PER_CORE.check(fig.per_core)}")
    rep.say(f"  collector / raw loop (fdatasync per request): {fig.raw_ratio:.3f}   {T_RAW_RATIO.check(fig.raw_ratio)}"
            f"   (vs group-commit raw loop: {full.rate / raw8['spans_s']:.2f})")


def report_sustained(rep: harness.Report, args: argparse.Namespace, load: Load, fig: Figures) -> None:
    full, drain = load.full, load.drain_full
    rep.say()
    rep.say("sustained to Parquet (full-load phase, first send -> flusher has written every acknowledged span):")
    if drain.done:
        rep.say(f"  {fmt(fig.sustained)} spans/s ({full.acked_spans:,} spans in {drain.at - full.start:.1f} s; load stopped "
                f"at {full.elapsed:.1f} s, Parquet caught up {drain.at - full.end:.1f} s later)")
    else:
        rep.say(f"  NOT caught up within {args.drain_timeout:.0f} s: {fmt(drain.flushed - load.warm.acked_spans)} of "
                f"{full.acked_spans:,} flushed")
    rep.say(f"  written during the load window: {fmt(load.flushed_at_end)} spans "
            f"({fmt(load.flushed_at_end / full.elapsed)} spans/s while under full load)")
    if fig.collector_cpu is not None and drain.done:
        cpu_total, _ = fig.collector_cpu
        rep.say(f"  per core: {fmt(fig.per_collector_core)} spans per collector CPU-second (receiver + flusher, "
                f"{cpu_total:.1f} s); flusher alone {fmt(fig.per_flusher_core)} spans per CPU-second")
        rep.say(f"    {T_PARQUET_PER_CORE.check(fig.per_collector_core)}")
        rep.say(f"    {T_FLUSHER_PER_CORE.check(fig.per_flusher_core)}")
    rep.say(f"  to Parquet / acknowledged under full load: {fig.ratio(full):.2f} (closed loop, as fast as the receiver "
            f"acknowledges; {T_SUSTAINED.name} is judged on the sustained phase)")


def report_half(rep: harness.Report, args: argparse.Namespace, load: Load, fig: Figures) -> None:
    half = load.half
    rep.say()
    rep.say(f"half load (target {fmt(half.target_rate)} spans/s = half the full-load rate, {args.senders} senders, open loop):")
    rep.extend(phase_lines(half))
    rep.say(f"  achieved {fmt(half.rate)} spans/s; sends late by more than one interval: {half.late:,}")
    rep.say(f"  ack latency from scheduled send time ms: p50 {pct(half.sched, 50):.1f}, p99 {pct(half.sched, 99):.1f}")
    rep.say(f"  p99 ack latency at half of peak: {fig.p99_half:.1f} ms   {T_HALF_P99_MS.check(fig.p99_half)}")
    if load.drain_half.done:
        rep.say(f"  Parquet caught up {load.drain_half.at - half.end:.1f} s after the phase ended")
    else:
        rep.say(f"  Parquet NOT caught up within {args.drain_timeout:.0f} s after the phase")


def rss_note(rate: float) -> str:
    """Where the rate the RSS was taken at stands against the target's: the
    buffers that grow with load (requests in flight, the flusher's chunk) are
    bounded by sizes, not by the rate, so a lower rate understates little."""
    return "" if abs(rate - T_RSS_RATE) < 0.2 * T_RSS_RATE else f" (at {fmt(rate)} spans/s, not {T_RSS_RATE // 1000}k)"


def report_memory(rep: harness.Report, load: Load, fig: Figures) -> None:
    rep.say()
    rep.say("memory (RSS, sampled every 100 ms):")
    a = load.rss.all
    rep.say(f"  peak over the run: receiver {a.max_r:.0f} MiB, flusher {a.max_f:.0f} MiB, sum {a.max_sum:.0f} MiB (peak of the sum)")
    for label in ("full", "drain after full", "half", "sustained", "drain after sustained"):
        s = load.rss.stats.get(label)
        if s:
            rep.say(f"  {label:>16}: receiver max {s.max_r:.0f} MiB, flusher max {s.max_f:.0f} MiB, "
                    f"sum max {s.max_sum:.0f} / mean {s.mean_sum:.0f} MiB")
    hs = load.rss.stats.get("half", RssStats())
    rep.say(f"  at half load ({fmt(load.half.rate)} spans/s): {hs.max_sum:.0f} MiB ({fig.rss_half_mb:.0f} MB)")
    rep.say(f"  under full load until Parquet caught up ({fmt(load.full.rate)} spans/s, closed loop): "
            f"{fig.rss_full_mb:.0f} MB (the target, {T_RSS_MB.text}, is judged on the sustained phase)")
    ss = load.rss.stats.get("sustained")
    if ss:
        rep.say(f"  sustained phase ({fmt(load.sustained.phase.rate)} spans/s acknowledged): {ss.max_sum * MB / 1e6:.0f} MB   "
                f"{T_RSS_MB.check(ss.max_sum * MB / 1e6)}{rss_note(load.sustained.phase.rate)}")


def report_verification(rep: harness.Report, load: Load, stored: Stored) -> None:
    rep.say()
    rep.say("verification:")
    total, m = load.total_acked, load.m_end
    rep.say(f"  acknowledged spans (warm-up + full + half + sustained): {total:,}; Parquet rows: {stored.rows:,} "
            f"({stored.unique:,} distinct ids)")
    rep.say(f"  Parquet span count {'equals' if stored.rows == total else 'DIFFERS FROM'} the acknowledged count"
            + (f"; {stored.in_wal:,} spans still in the WAL after shutdown (flushed on the next start)" if stored.in_wal else ""))
    rep.say(f"  lost: {lost(load, stored):,}, duplicated: {stored.rows - stored.unique:,}"
            + (f", stored but never acknowledged: {stored.unique - total:,}" if stored.unique > total else ""))
    rep.say(f"  collector counters: accepted {fmt(m.get(ACCEPTED, float('nan')))}, flushed {fmt(m.get(FLUSHED, float('nan')))}, "
            f"duplicates dropped {fmt(m.get('nightshift_duplicates_dropped', float('nan')))}, "
            f"flush errors {fmt(m.get('nightshift_flush_errors', float('nan')))}")
    rep.say(f"  SIGTERM: exit code {load.rc} after {load.stop_s:.1f} s")


def lost(load: Load, stored: Stored) -> int:
    return max(0, load.total_acked - stored.unique - stored.in_wal)


def report_summary(rep: harness.Report, load: Load, fig: Figures, stored: Stored) -> None:
    full, half = load.full, load.half
    rep.say()
    rep.say("summary:")
    rep.say(f"  acknowledged durable: {fmt(full.rate)} spans/s total, {fmt(fig.per_core)}/receiver core "
            f"(target {T_ACK_PER_CORE.threshold // 1000}k/core) {T_ACK_PER_CORE.verdict(fig.per_core)}")
    rep.say(f"  vs raw loop: {fig.raw_ratio:.3f} (target {T_RAW_RATIO.threshold}) {T_RAW_RATIO.verdict(fig.raw_ratio)}")
    if fig.collector_cpu is not None and load.drain_full.done:
        rep.say(f"  sustained to Parquet: {fmt(fig.sustained)} spans/s, {fmt(fig.per_collector_core)}/collector core "
                f"(target {T_PARQUET_PER_CORE.threshold // 1000}k/core) {T_PARQUET_PER_CORE.verdict(fig.per_collector_core)}")
    else:
        rep.say(f"  sustained to Parquet: did not catch up {verdict(False)}")
    rep.say(f"  p50/p99 ack: full load {pct(full.lat, 50):.1f}/{pct(full.lat, 99):.1f} ms; half load "
            f"{pct(half.lat, 50):.1f}/{fig.p99_half:.1f} ms (target p99 < {T_HALF_P99_MS.text}) "
            f"{T_HALF_P99_MS.verdict(fig.p99_half)}")
    hs = load.rss.stats.get("half", RssStats())
    rep.say(f"  RSS: peak {load.rss.all.max_sum:.0f} MiB; at half load ({fmt(half.rate)} spans/s) {hs.max_sum:.0f} MiB; "
            f"under full load {fig.rss_full_mb:.0f} MB")
    sus = load.sustained
    if sus is not None:
        ss_mb = load.rss.stats.get("sustained", RssStats()).max_sum * MB / 1e6
        rep.say(f"  sustained at {fmt(sus.phase.target_rate)} spans/s (offered {fmt(sus.offered)}): acknowledged "
                f"{fmt(sus.phase.rate)}, to Parquet {fmt(sus.durable)} = {sus.ratio:.2f}x ({T_SUSTAINED}) "
                f"{T_SUSTAINED.verdict(sus.ratio)}; RSS {ss_mb:.0f} MB ({T_RSS_MB}) {T_RSS_MB.verdict(ss_mb)}")
    rep.say(f"  lost: {lost(load, stored):,}, duplicated: {stored.rows - stored.unique:,}")
    noisy = [f"{ph.name} {ph.other_cpu / ph.elapsed:.2f}" for ph in (full, half) if ph.other_cpu / ph.elapsed > 0.25]
    if noisy:
        rep.say(f"  WARNING: CPU used outside the benchmark (cores: {', '.join(noisy)}); the machine was not quiet, "
                "throughput and latency are understated")
    rep.say()


def report_peer(rep: harness.Report, args: argparse.Namespace, load: Load, fig: Figures, peer) -> None:
    if peer is not None:
        from peer_phoenix import report_lines

        rep.extend(report_lines(peer, {"ack_rate": load.full.rate, "sustained": fig.sustained,
                                       "p50": pct(load.full.lat, 50), "p99": pct(load.full.lat, 99),
                                       "rss_mib": load.rss.all.max_sum, "refused": load.full.refused,
                                       "spans_per_request": args.spans_per_request}))
        rep.say()
    rep.extend(line for line in PEERS if peer is None or peer.skipped or "Phoenix" not in line)


@dataclass
class SizeRun:
    """One span size's run, for the sidecar table."""

    kb: float
    templates: list[Template]
    load: Load
    fig: Figures
    stored: Stored
    alone: dict
    over: Overload | None = None
    form: str = "process"  # collector.flusher
    settings: str = ""  # `settings_tag`: what the targets' line ran with

    @property
    def label(self) -> str:
        """The span size, and the flusher's form (as resolved): the tables' first columns."""
        return f"{f'~{self.kb:g} KB' if self.kb else '1-10 KB':>9} {self.load.resolved or self.form:>7}"

    @property
    def ok(self) -> bool:
        over_ok = self.over is None or (self.over.lost == 0 and self.over.stored.rows == self.over.stored.unique
                                        and self.over.rc == 0)
        return lost(self.load, self.stored) == 0 and self.stored.rows == self.stored.unique and self.load.rc == 0 \
            and over_ok


def report_sidecar(rep: harness.Report, runs: list[SizeRun]) -> None:
    """Issue 28's two sidecar targets, one line per span size, and what makes the
    ratio interpretable on a machine the load generator shares: the flusher's own
    speed (spans per CPU-second) and the ratio it would reach with the senders'
    CPU given back to the collector."""
    ncpu = os.cpu_count() or 1
    sustained = [r for r in runs if r.load.sustained is not None]
    if sustained:
        rate = sustained[0].load.sustained.phase.target_rate
        rep.say(f"sidecar (receiver + flusher), per span size, sustained at {fmt(rate)} spans/s (open loop, "
                f"{sustained[0].load.sustained.phase.elapsed:.0f} s; issue 28's targets):")
        rep.say(f"  {'spans':>9} {'flusher':>7} {'offered/s':>10} {'acknowledged/s':>15} {'to Parquet/s':>13} {'ratio':>6} "
                f"{'backlog at end':>15} {'ack p99 ms':>10} {'RSS MB':>7} {'anon MB':>8}   targets")
        for r in sustained:
            sus, st = r.load.sustained, r.load.rss.stats.get("sustained", RssStats())
            mb = st.max_sum * MB / 1e6
            rep.say(f"  {r.label} {fmt(sus.offered):>10} {fmt(sus.phase.rate):>15} "
                    f"{fmt(sus.durable):>13} {sus.ratio:>6.2f} {fmt(sus.backlog_spans):>15} "
                    f"{pct(sus.phase.lat, 99):>10.1f} {mb:>7.0f} "
                    f"{st.max_anon_sum * MB / 1e6:>8.0f}   {T_SUSTAINED}: {T_SUSTAINED.verdict(sus.ratio)}; "
                    f"{T_RSS_MB}: {T_RSS_MB.verdict(mb)}{rss_note(sus.phase.rate)}; "
                    f"other cores busy {sus.phase.other_cpu / sus.phase.elapsed:.2f}; settings: {r.settings}")
        rep.say("  (flusher: collector.flusher, its own process or a thread of the receiver's, whose RSS is then the "
                "whole sidecar's; offered: what the senders, on this machine, got out; backlog: spans acknowledged and "
                "not yet in Parquet when the phase ended; ack p99: send -> 200/OK, the GIL's price in the thread form)")
    rep.say("sidecar under full load (closed loop: as fast as the receiver acknowledges; not the targets' load):")
    rep.say(f"  {'spans':>9} {'flusher':>7} {'acknowledged/s':>15} {'to Parquet/s':>13} {'ratio':>6} {'RSS MB':>7} {'anon MB':>8}   "
            "(full load)")
    for r in runs:
        full, ratio = r.load.full, r.fig.ratio(r.load.full)
        rep.say(f"  {r.label} {fmt(full.rate):>15} {fmt(r.fig.sustained):>13} {ratio:>6.2f} {r.fig.rss_full_mb:>7.0f} "
                f"{r.fig.anon_full_mb:>8.0f}   other cores busy {full.other_cpu / full.elapsed:.2f}")
    rep.say("  (anon: RSS less mapped files' pages, which the kernel shares and may drop; the target is on RSS)")
    rep.say("  the flusher alone, the contention-robust figure (a fresh process flushing a 100k-span segment; "
            f"settings: {flusher_tag()}):")
    for r in (r for r in runs if r.form == runs[0].form):  # once per size: the same fresh process for both forms
        a = r.alone
        rep.say(f"    {f'~{r.kb:g} KB' if r.kb else '1-10 KB'}: {1e5 * a['cpu'] / a['spans']:.2f} CPU-s per 100k spans "
                f"({fmt(a['per_cpu'])} spans per CPU-second), peak RSS {a['peak_mib']:.0f} MiB "
                f"({a['imports_mib']:.0f} of them its imports); {steady_line(a)}")
        rep.say(f"      {parts_line(a)}")
    overs = [r for r in runs if r.over is not None]
    if overs:
        rep.say(f"  under sustained overload (WAL capped at {overs[0].over.cap / MB:g} MiB, clients told 503 + Retry-After "
                "past it): the throttled figures, beside the unthrottled ones above, NOT the target")
        rep.say(f"  {'spans':>9} {'flusher':>7} {'acknowledged/s':>15} {'to Parquet/s':>13} {'of unthrottled':>15} {'busy/s':>6} "
                f"{'backlog MiB':>12} {'lag s':>6} {'RSS MB':>7} {'anon MB':>8} {'lost/dup':>9}")
        for r in overs:
            o = r.over
            _, mean, peak = o.backlog_mib()
            rep.say(f"  {r.label} {fmt(o.phase.rate):>15} {fmt(o.durable):>13} "
                    f"{o.durable / r.load.full.rate:>15.2f} {o.phase.refused / o.phase.elapsed:>6.1f} "
                    f"{f'{mean:.0f}/{peak:.0f}':>12} {o.lag_max:>6.1f} {o.rss.max_sum * MB / 1e6:>7.0f} "
                    f"{o.rss.max_anon_sum * MB / 1e6:>8.0f} {f'{o.lost}/{o.stored.rows - o.stored.unique}':>9}")
        rep.say("  (of unthrottled: to Parquet at the cap over the unthrottled acknowledged rate, what the 0.8x target "
                "measures; busy/s: requests told 503 / UNAVAILABLE a second; backlog mean/peak; lag: how far Parquet fell behind, at most)")
    rep.say("  the flusher's own speed, and the ratio it reaches given a core (the measured ratio counts its wait "
            "for one on a machine the senders share):")
    for r in runs:
        full = r.load.full
        own = r.fig.per_flusher_core / full.rate if full.rate else float("nan")
        r_cores, s_cores = full.cpu_r / full.elapsed, full.sender_cpu / full.elapsed
        # Senders on machines of their own (as agents are): the collector keeps every core but the receiver's.
        free = min(1.0, ncpu - r_cores)
        freed = min(1.0, r.fig.per_flusher_core * free / full.rate) if full.rate else float("nan")
        rep.say(f"    {r.label.strip()}: flusher {fmt(r.fig.per_flusher_core)} spans per "
                f"CPU-second ({1e5 / r.fig.per_flusher_core:.2f} CPU-s per 100k spans); on a core of its own "
                f"{own:.2f} of the {fmt(full.rate)} acknowledged; with the senders' {s_cores:.2f} cores given back "
                f"(receiver {r_cores:.2f} of {ncpu}, flusher {free:.2f}) {freed:.2f}   "
                f"(projected, {T_SUSTAINED}: {T_SUSTAINED.verdict(freed)})")
    rep.say()


def run_size(args: argparse.Namespace, rep: harness.Report, tmp: Path, kb: float, procs: Processes) -> list[SizeRun]:
    """The whole measurement on spans of about `kb` KB, in a folder of its own;
    the collector's phases once per flusher form (`--flusher`), the raw loop,
    the flusher alone and the codecs once."""
    rep.say()
    rep.say(f"=== spans of {f'about {kb:g} KB' if kb else '1-10 KB'} ===")
    tmp.mkdir()
    templates = build_workload(args, rep, kb)
    raw1, raw8 = measure_raw(tmp, templates, args.raw_seconds)
    log("the flusher alone: a fresh process flushes a 100k-span segment")
    alone = flusher_alone(tmp / "alone", templates)
    report_raw(rep, raw1, raw8)
    rep.say(f"flusher alone (a fresh process with the flusher's imports and allocator, one {alone['segment_mib']:.0f} MiB "
            f"segment of {alone['spans']:,} of these spans): {1e5 * alone['cpu'] / alone['spans']:.2f} CPU-s per 100k "
            f"spans = {fmt(alone['per_cpu'])} spans per CPU-second; RSS {alone['imports_mib']:.0f} MiB after its imports, "
            f"peak {alone['peak_mib']:.0f} MiB; {steady_line(alone)}")
    rep.say(f"  {parts_line(alone)}")
    rep.say(f"  settings: {flusher_tag()}")
    rep.say()
    rep.say("Parquet codec trade-off (this run's spans converted once, written as the flusher writes them):")
    rep.extend(parquet_tradeoff(templates), indent="  ")
    return [run_form(args, rep, tmp, kb, procs, templates, raw1, raw8, alone, form) for form in args.forms]


def run_form(args: argparse.Namespace, rep: harness.Report, tmp: Path, kb: float, procs: Processes,
             templates: list[Template], raw1: dict, raw8: dict, alone: dict, form: str) -> SizeRun:
    """The collector's phases with the flusher as `form`, in a folder of their own."""
    rep.say()
    rep.say(f"--- spans of {f'about {kb:g} KB' if kb else '1-10 KB'}, the flusher as a {form} (collector.flusher) ---")
    tmp = tmp / f"flusher-{form}"
    tmp.mkdir()
    load = measure_collector(tmp, templates, args, procs, form)
    stored = count_stored(procs.coll)
    procs.coll.kill()  # its log file closed; the process is gone already
    procs.coll = procs.sampler = None
    fig = figures(load, raw1)
    report_full(rep, args, load, fig, raw8)
    report_sustained(rep, args, load, fig)
    report_half(rep, args, load, fig)
    report_sustained_rate(rep, args, load)
    report_memory(rep, load, fig)
    report_verification(rep, load, stored)
    over = None
    if args.overload_cap and form == args.forms[0]:  # once per size: its figures are the WAL cap's, not the form's
        over = measure_overload(tmp / "overload", templates, args, procs, form)
        report_overload(rep, args, over, load)
    report_summary(rep, load, fig, stored)
    return SizeRun(kb, templates, load, fig, stored, alone, over, form,
                   settings_tag(form, load.resolved or form, args.no_grpc, flush_interval=args.flush_interval))


def main() -> int:
    args = parse_args()
    rep = harness.Report()
    rep.extend(harness.header("nightshift ingest benchmark", args))
    procs = Processes()
    with harness.sigterm_as_interrupt(), harness.temp_dir("nightshift-bench-", args.dir, args.keep) as tmp:
        try:
            rep.say(f"temp dir: {tmp} ({fs_of(tmp)})")
            runs = [r for kb in args.sizes for r in run_size(args, rep, tmp / f"spans-{kb:g}kb", kb, procs)]
            report_sidecar(rep, runs)
            last = runs[-1]
            peer = measure_peer(args, last.templates)
            report_peer(rep, args, last.load, last.fig, peer)
            rep.print()
            return 0 if all(r.ok for r in runs) else 1
        except KeyboardInterrupt:
            log("interrupted; cleaning up")
            return 130
        except Exception as e:  # noqa: BLE001
            rep.print()
            log(f"benchmark failed: {type(e).__name__}: {e}")
            if procs.coll is not None and procs.coll.proc is not None:
                log("collector log tail:\n" + procs.coll.log_tail(3000))
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # don't interrupt the cleanup
            procs.kill()


if __name__ == "__main__":
    sys.exit(main())
