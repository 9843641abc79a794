#!/usr/bin/env python
"""Peer measurement for the ingest benchmark: Arize Phoenix on this machine.

Used by `benchmarks/ingest.py --peer phoenix` (after the Nightshift phases, same
request templates, same number of senders, same sender code: benchmarks/otlp_load.py),
or on its own:

    python benchmarks/peer_phoenix.py [--seconds 10] [--senders 4] [--spans-per-request 512]

What it does:

1. Makes sure Phoenix is installed in its own virtualenv (default
   ~/.cache/nightshift-bench/phoenix-venv, or $NIGHTSHIFT_BENCH_PHOENIX_VENV):
   reused if it imports, otherwise created with `python -m venv` and
   `pip install arize-phoenix opentelemetry-sdk opentelemetry-exporter-otlp-proto-http`.
   If that fails, the peer is skipped and the report says why.
2. Starts `phoenix serve --no-internet` on free loopback ports with a temp
   PHOENIX_WORKING_DIR (SQLite at phoenix.db), waits for /healthz.
3. One warm-up request of the real size (if Phoenix refuses it, the spans per
   request are halved for the peer only, and the report says so), waits until it
   is in the database.
4. K sender processes (otlp_load.sender_main: HTTP keep-alive POSTs of
   application/x-protobuf, fresh ids per send, 0.1 s back-off on 503) for N seconds,
   closed loop. Counts acknowledged spans (200), 503s, ack latency.
5. Polls `SELECT COUNT(*) FROM spans` on phoenix.db (read-only) until every
   acknowledged span is there or the timeout passes.
6. RSS of the Phoenix process tree sampled every 100 ms; CPU of the tree.
7. Stops Phoenix (SIGTERM, then kill) and removes its temp dir, always.

Phoenix acknowledges a request once its spans are in an in-memory queue; a bulk
inserter writes them to SQLite later. Its 200 is not a durability promise, so the
durable figure compared with Nightshift's (whose ack follows a WAL fsync) is the
persisted rate.
"""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/hardening: the shared process helpers
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
import otlp_load  # noqa: E402
import peer_venv  # noqa: E402
from harness import fmt, pct  # noqa: E402
from hardening.proc import free_port  # noqa: E402  one helper for every harness
from peer_venv import PeerSkipped  # noqa: E402

MB = 1 << 20
DEFAULT_VENV = Path.home() / ".cache" / "nightshift-bench" / "phoenix-venv"
PACKAGES = ("arize-phoenix", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http")
STARTUP_TIMEOUT = 120.0
WARMUP_PERSIST_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0


def log(msg: str) -> None:
    harness.log(msg, "phoenix peer")


@dataclass
class PhoenixResult(otlp_load.Sent):
    """Phoenix's figures; what its senders did (acknowledged spans, latencies, ...)
    as for Nightshift's phases."""

    skipped: str | None = None  # reason, when not measured
    error: str | None = None  # reason, when it failed midway (figures may be partial)
    version: str = "?"
    venv: str = ""
    installed_now: bool = False
    install_s: float = 0.0
    startup_s: float = float("nan")
    senders: int = 0
    seconds: float = 0.0
    spans_per_request: int = 0
    requested_spans_per_request: int = 0
    reduced_because: str | None = None
    request_mib: float = 0.0
    warmup_persist_s: float = float("nan")
    # load phase (and the senders' counts, from otlp_load.Sent)
    elapsed: float = 0.0
    cpu_load: float = float("nan")  # Phoenix tree CPU seconds during the load
    # persistence
    persisted_at_load_end: int = 0
    persisted: int = 0
    persist_done: bool = False
    persist_s: float = float("nan")  # first send -> all persisted (or -> timeout)
    persist_timeout: float = 0.0
    cpu_drain: float = float("nan")
    drain_s: float = float("nan")
    peak_rss_mib: float = 0.0
    peak_rss_load_mib: float = 0.0
    stop_note: str = ""

    @property
    def ack_rate(self) -> float:
        return self.acked_spans / self.elapsed if self.elapsed else float("nan")

    @property
    def persist_rate(self) -> float:
        return self.persisted / self.persist_s if self.persist_s == self.persist_s and self.persist_s > 0 else float("nan")


# --------------------------------------------------------------------------------------
# Install
# --------------------------------------------------------------------------------------


def ensure_venv(venv: Path, res: PhoenixResult) -> None:
    """Reuse the venv if Phoenix imports there; otherwise create it and pip install.
    Raises PeerSkipped with the reason on failure."""
    res.venv = str(venv)
    code = ("import importlib.metadata as m, phoenix.server.main, opentelemetry.sdk; "
            "print(m.version('arize-phoenix'))")
    version = peer_venv.version(venv, code, timeout=180)
    if version:
        res.version = version
        return
    log(f"installing {' '.join(PACKAGES)} into {venv} (first time only; takes a few minutes)")
    t0 = time.perf_counter()
    log_path = venv.parent / "phoenix-install.log"
    peer_venv.install(venv, PACKAGES, log_path)
    res.installed_now = True
    res.install_s = time.perf_counter() - t0
    version = peer_venv.version(venv, code, timeout=180)
    if not version:
        raise PeerSkipped(f"installed into {venv}, but `import phoenix.server.main` fails there (log: {log_path})")
    res.version = version
    log(f"installed arize-phoenix {version} in {res.install_s:.0f} s")


# --------------------------------------------------------------------------------------
# Server process
# --------------------------------------------------------------------------------------


class PhoenixServer:
    def __init__(self, venv: Path, workdir: Path):
        self.venv = venv
        self.workdir = workdir
        self.port = free_port()
        self.grpc_port = free_port()
        self.db = workdir / "phoenix.db"
        self.log_path = workdir / "phoenix.log"
        self.proc: subprocess.Popen | None = None
        self.ps: psutil.Process | None = None
        self._log = None
        self._known: dict[int, psutil.Process] = {}  # every process of the tree seen, for the kill

    def start(self) -> float:
        script = self.venv / "bin" / "phoenix"
        if script.exists():
            cmd = [str(script), "serve", "--no-internet"]
        else:
            cmd = [str(peer_venv.python(self.venv)), "-m", "phoenix.server.main", "serve", "--no-internet"]
        env = peer_venv.clean_env(self.venv)
        env.update({
            "PHOENIX_HOST": "127.0.0.1",
            "PHOENIX_PORT": str(self.port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port),
            "PHOENIX_TELEMETRY_ENABLED": "false",
            "PHOENIX_WORKING_DIR": str(self.workdir),
        })
        self._log = open(self.log_path, "ab")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=self.workdir)
        self.ps = psutil.Process(self.proc.pid)
        self._known[self.proc.pid] = self.ps
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"phoenix exited with {self.proc.returncode} during startup; log tail:\n{self.log_tail()}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    c.close()
                    return time.perf_counter() - t0
                c.close()
            except (OSError, http.client.HTTPException):
                pass
            if time.perf_counter() - t0 > STARTUP_TIMEOUT:
                raise RuntimeError(f"phoenix /healthz not 200 after {STARTUP_TIMEOUT:.0f} s; log tail:\n{self.log_tail()}")
            time.sleep(0.25)

    def tree(self) -> list[psutil.Process]:
        if self.ps is None:
            return []
        try:
            procs = [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return []
        for p in procs:
            self._known.setdefault(p.pid, p)
        return procs

    def rss_mib(self) -> float:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total / MB

    def cpu(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"phoenix exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> str:
        """SIGTERM, then kill whatever of the tree is left. Returns a note."""
        if self.proc is None:
            return ""
        self.tree()  # remember the children before the parent goes
        note = ""
        if self.proc.poll() is None:
            t0 = time.perf_counter()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
                note = f"exited {self.proc.returncode} {time.perf_counter() - t0:.1f} s after SIGTERM"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                note = f"still running {STOP_TIMEOUT:.0f} s after SIGTERM; killed"
        left = []
        for pid, p in self._known.items():
            if pid == self.proc.pid:
                continue
            try:
                if p.is_running():
                    p.kill()
                    left.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5)
        if self._log is not None:
            self._log.close()
            self._log = None
        return note


class RssSampler(threading.Thread):
    def __init__(self, server: PhoenixServer):
        super().__init__(name="phoenix-rss", daemon=True)
        self.server = server
        self.peak = 0.0
        self.label = "start"
        self.peaks: dict[str, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.1):
            r = self.server.rss_mib()
            self.peak = max(self.peak, r)
            self.peaks[self.label] = max(self.peaks.get(self.label, 0.0), r)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(2)


# --------------------------------------------------------------------------------------
# Database, requests
# --------------------------------------------------------------------------------------


class SpanCounter:
    """COUNT(*) of Phoenix's span table, on a read-only connection."""

    def __init__(self, db: Path):
        self.db = db
        self.conn: sqlite3.Connection | None = None
        self.table = "spans"

    def _open(self) -> None:
        if self.conn is None:
            self.conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
            tables = [r[0] for r in self.conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            if "spans" not in tables:
                cands = [t for t in tables if "span" in t.lower() and "annotation" not in t.lower()]
                if not cands:
                    raise RuntimeError(f"no span table in {self.db}: {tables}")
                self.table = cands[0]

    def count(self) -> int | None:
        try:
            self._open()
            return self.conn.execute(f'SELECT COUNT(*) FROM "{self.table}"').fetchone()[0]
        except sqlite3.Error:
            self.close()  # locked or not created yet: try again on the next poll
            return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def post(port: int, body: bytes) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", "/v1/traces", body=body, headers={"Content-Type": "application/x-protobuf"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def wait_count(counter: SpanCounter, server: PhoenixServer, target: int, deadline: float) -> tuple[bool, int, float]:
    """Poll until the count reaches target or the deadline. (done, count, when)."""
    n = 0
    while True:
        server.check_alive()
        now = time.perf_counter()
        c = counter.count()
        if c is not None:
            n = c
        if n >= target:
            return True, n, now
        if now >= deadline:
            return False, n, now
        time.sleep(0.5)


# --------------------------------------------------------------------------------------
# The measurement
# --------------------------------------------------------------------------------------


def run_phoenix(templates: list[otlp_load.Template], *, senders: int, seconds: float, spans_per_request: int,
                secret_fraction: float = 0.0, persist_timeout: float = 120.0, parent_dir: str | None = None,
                venv: Path | None = None) -> PhoenixResult:
    """Measure Phoenix with `templates` (otlp_load.build_templates), the request
    templates Nightshift was measured with. Never raises except KeyboardInterrupt: failures end up in result.skipped / .error."""
    venv = Path(venv or os.environ.get("NIGHTSHIFT_BENCH_PHOENIX_VENV") or DEFAULT_VENV)
    res = PhoenixResult(senders=senders, seconds=seconds, spans_per_request=spans_per_request,
                        requested_spans_per_request=spans_per_request, persist_timeout=persist_timeout)
    try:
        ensure_venv(venv, res)
    except PeerSkipped as e:
        res.skipped = str(e)
        log(f"skipped: {e}")
        return res

    workdir = Path(tempfile.mkdtemp(prefix="nightshift-bench-phoenix-", dir=parent_dir))
    server = PhoenixServer(venv, workdir)
    sampler: RssSampler | None = None
    counter = SpanCounter(server.db)
    pool: otlp_load.SenderPool | None = None
    try:
        log(f"starting arize-phoenix {res.version} (http {server.port}, grpc {server.grpc_port}, dir {workdir})")
        res.startup_s = server.start()
        log(f"/healthz 200 after {res.startup_s:.1f} s")
        sampler = RssSampler(server)
        sampler.start()

        # Warm-up request at the real size; halve the spans per request if refused.
        n = spans_per_request
        while True:
            tpl = templates[0] if n == spans_per_request else otlp_load.build_template(1000, n, secret_fraction)
            try:
                status, body = post(server.port, tpl.fresh(bytearray(tpl.data)))
                why = f"HTTP {status} {body[:120]!r}" if status != 200 else None
            except (OSError, http.client.HTTPException) as e:
                status, why = 0, f"{type(e).__name__}: {e}"
            server.check_alive()
            if status == 200:
                break
            if n <= 1:
                raise RuntimeError(f"phoenix refuses even a 1-span request: {why}")
            log(f"{n}-span request ({len(tpl.data) / MB:.2f} MiB) refused: {why}; halving")
            res.reduced_because = f"{spans_per_request}-span requests ({len(templates[0].data) / MB:.2f} MiB) refused: {why}"
            n //= 2
        if n != spans_per_request:
            log(f"building {len(templates)} templates x {n} spans for the peer")
            templates = otlp_load.build_templates(len(templates), n, secret_fraction)
        res.spans_per_request = n
        res.request_mib = sum(len(t.data) for t in templates) / len(templates) / MB
        t0 = time.perf_counter()
        done, _, at = wait_count(counter, server, n, t0 + WARMUP_PERSIST_TIMEOUT)
        if done:
            res.warmup_persist_s = at - t0
        log(f"warm-up request ({n} spans) persisted after {res.warmup_persist_s:.1f} s" if done
            else f"warm-up request not persisted after {WARMUP_PERSIST_TIMEOUT:.0f} s; going on")
        base = counter.count() or 0

        # Load: same sender code as the Nightshift phases.
        log(f"starting {senders} sender processes")
        # spawn, not fork: by now this process has threads (RSS sampler, polars' pool).
        pool = otlp_load.SenderPool(senders, "http", server.port, templates, start_method="spawn", name="phoenix-sender")
        pool.prepare(120, server.check_alive)
        log(f"full load {seconds:.0f} s ({senders} http senders, {n} spans/request)")
        start_at = pool.start(seconds, None, n)
        sampler.label = "load"
        cpu0 = server.cpu()
        results = pool.results(time.perf_counter() + seconds + 180, server.check_alive)
        load_end = time.perf_counter()
        cpu1 = server.cpu()
        sampler.label = "drain"
        res.persisted_at_load_end = max(0, (counter.count() or base) - base)
        pool.stop()
        pool = None
        res.add_all(results)
        res.elapsed = max(1e-9, res.last_done - start_at)
        res.cpu_load = cpu1 - cpu0
        log(f"acknowledged {res.acked_spans:,} spans ({fmt(res.ack_rate)} spans/s), {res.refused:,} refused (503), "
            f"{res.errors:,} errors; {res.persisted_at_load_end:,} in SQLite so far; waiting up to {persist_timeout:.0f} s")

        # Persistence.
        done, count, at = wait_count(counter, server, base + res.acked_spans, load_end + persist_timeout)
        res.persist_done = done
        res.persisted = max(0, count - base)
        res.persist_s = at - start_at
        res.drain_s = at - load_end
        res.cpu_drain = server.cpu() - cpu1
        log(f"persisted {res.persisted:,} of {res.acked_spans:,} "
            + (f"after {res.persist_s:.1f} s" if done else f"at the {persist_timeout:.0f} s timeout"))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001
        res.error = f"{type(e).__name__}: {e}"
        log(f"failed: {res.error}")
    finally:
        counter.close()
        if pool is not None:
            pool.stop()
        if sampler is not None:
            sampler.stop()
            res.peak_rss_mib = sampler.peak
            res.peak_rss_load_mib = sampler.peaks.get("load", 0.0)
        try:
            res.stop_note = server.stop()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        log("stopped; temp dir removed")
    return res


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def report_lines(res: PhoenixResult, ns: dict | None = None) -> list[str]:
    """Report lines; `ns` holds Nightshift's figures from the same run for the
    side-by-side table: ack_rate, sustained, p50, p99, rss_mib, spans_per_request."""
    out = []
    if res.skipped:
        out.append(f"peer Arize Phoenix: NOT measured: {res.skipped}")
        return out
    out.append(f"peer, measured in this run: Arize Phoenix {res.version} (venv {res.venv}"
               + (f", installed now in {res.install_s:.0f} s" if res.installed_now else "") + ")")
    out.append("  OTLP/HTTP application/x-protobuf to /v1/traces; storage SQLite (phoenix.db in a temp PHOENIX_WORKING_DIR "
               "on the same filesystem)")
    if res.error:
        out.append(f"  FAILED: {res.error.splitlines()[0]}")
    if res.startup_s == res.startup_s:
        out.append(f"  startup: /healthz 200 after {res.startup_s:.1f} s; warm-up request persisted after "
                   + (f"{res.warmup_persist_s:.1f} s" if res.warmup_persist_s == res.warmup_persist_s else "n/a"))
    if res.reduced_because:
        out.append(f"  NOTE: spans per request reduced to {res.spans_per_request} for Phoenix only "
                   f"({res.reduced_because})")
    if res.acked_reqs or res.elapsed:
        out.append(f"  load: {res.senders} http senders, closed loop, {res.seconds:.0f} s, {res.spans_per_request} spans/request "
                   f"({res.request_mib:.2f} MiB), same request templates and sender code as Nightshift, fresh ids per send")
        out.append(f"  acknowledged (HTTP 200): {res.acked_spans:,} spans in {res.acked_reqs:,} requests over {res.elapsed:.1f} s; "
                   f"refused (503, span queue full): {res.refused:,}; errors: {res.errors:,}")
        out.append(f"  ack latency (send -> 200) ms: p50 {pct(res.lat, 50):.1f}, p90 {pct(res.lat, 90):.1f}, "
                   f"p99 {pct(res.lat, 99):.1f}, max {pct(res.lat, 100):.1f}")
        out.append(f"  acknowledged spans/s: {fmt(res.ack_rate)}   (NOT durable: Phoenix acks once spans are in its in-memory "
                   "queue; a crash loses what is not yet in SQLite)")
        if res.persist_s == res.persist_s:
            if res.persist_done:
                out.append(f"  persisted to SQLite: {fmt(res.persist_rate)} spans/s ({res.persisted:,} spans in {res.persist_s:.1f} s, "
                           f"first send -> all acknowledged spans in the spans table; caught up {res.drain_s:.1f} s after the load)")
            else:
                out.append(f"  persisted to SQLite: NOT all within {res.persist_timeout:.0f} s after the load: "
                           f"{res.persisted:,} of {res.acked_spans:,} ({res.persisted / max(1, res.acked_spans):.0%}); "
                           f"{fmt(res.persist_rate)} spans/s over {res.persist_s:.1f} s (first send -> timeout)")
            out.append(f"  persisted during the load window: {res.persisted_at_load_end:,} spans "
                       f"({fmt(res.persisted_at_load_end / res.elapsed)} spans/s while under load)")
            out.append(f"  CPU of the Phoenix process tree (cores): {res.cpu_load / res.elapsed:.2f} during the load, "
                       f"{res.cpu_drain / res.drain_s:.2f} while persisting after it; senders {res.sender_cpu / res.elapsed:.2f}")
    if res.peak_rss_mib:
        out.append(f"  RSS of the Phoenix process tree (sampled every 100 ms): peak {res.peak_rss_mib:.0f} MiB "
                   f"(during the load {res.peak_rss_load_mib:.0f} MiB)")
    if res.stop_note:
        out.append(f"  stop: {res.stop_note}")

    if ns and res.acked_reqs and not res.error:
        out.append("")
        out.append("Nightshift vs Phoenix (same machine, same run, same workload and senders):")
        ph_durable = res.persist_rate
        star = "" if res.persist_done else "*"
        out.extend(harness.table([
            ("acknowledged spans/s", fmt(ns["ack_rate"]), fmt(res.ack_rate)),
            ("ack is durable (fsync'd before 200)", "yes (WAL)", "no"),
            ("durable spans/s (ack / persisted to SQLite)", fmt(ns["ack_rate"]), fmt(ph_durable) + star),
            ("to queryable storage spans/s (Parquet/SQLite)", fmt(ns.get("sustained", float("nan"))), fmt(ph_durable) + star),
            ("ack latency p50 / p99 ms", f"{ns['p50']:.1f} / {ns['p99']:.1f}", f"{pct(res.lat, 50):.1f} / {pct(res.lat, 99):.1f}"),
            ("refused (503) under full load", f"{ns.get('refused', 0):,}", f"{res.refused:,}"),
            ("peak RSS MiB (whole run / Phoenix tree)", f"{ns['rss_mib']:.0f}", f"{res.peak_rss_mib:.0f}"),
        ], header=("", "Nightshift", "Phoenix")))
        ratio = ns["ack_rate"] / ph_durable if ph_durable and ph_durable == ph_durable else float("nan")
        out.append(f"  durable throughput, Nightshift / Phoenix: {ratio:,.1f}x"
                   + ("" if res.persist_done else f"  (* Phoenix had not persisted everything {res.persist_timeout:.0f} s "
                                                  "after the load: rate at the timeout)"))
        sus = ns.get("sustained", float("nan"))
        if sus == sus and ph_durable == ph_durable and ph_durable:
            out.append(f"  to queryable storage, Nightshift Parquet / Phoenix SQLite: {sus / ph_durable:,.1f}x")
        if ns.get("spans_per_request") and ns["spans_per_request"] != res.spans_per_request:
            out.append(f"  (request sizes differ: Nightshift {ns['spans_per_request']} spans/request, Phoenix {res.spans_per_request})")
    return out


def main() -> int:
    ap = harness.parser("Measure Arize Phoenix with the ingest benchmark's workload.", temp_dir=True)
    otlp_load.add_load_flags(ap)
    ap.add_argument("--persist-timeout", type=float, default=120.0,
                    help="max seconds after the load to wait for the spans to be persisted (default 120)")
    args = ap.parse_args()

    log(f"building {args.templates} request templates x {args.spans_per_request} spans")
    templates = otlp_load.build_templates(args.templates, args.spans_per_request)
    res = run_phoenix(templates, senders=args.senders, seconds=args.seconds,
                      spans_per_request=args.spans_per_request, persist_timeout=args.persist_timeout,
                      parent_dir=args.dir)
    print("\n".join(report_lines(res)), flush=True)
    return 0 if not res.skipped and not res.error else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
