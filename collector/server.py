"""`nightshift collect`: wires WAL, flusher process, gRPC and HTTP receivers, and
runs until SIGTERM or SIGINT, then drains: stop accepting, seal the log, let the
flusher write everything to Parquet, exit 0.

Start-up takes everything that can be refused (the WAL's lock, the TLS files,
both listening addresses) before it starts anything that would have to be
stopped (the flusher process, the receivers' threads): a collector that cannot
start says so in one sentence (`CannotStart`) and leaves nothing running."""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import ssl
import threading
import time
from pathlib import Path

from nightshift.settings import logs

from . import flusher_process, flusher_stats, flusher_thread, http_server, listen, receiver_main, wal
from .config import CollectorConfig
from .fairness import ClientLimits
from .metrics import Metrics
from .pipeline import Pipeline
from .redact import Redactor

log = logging.getLogger("nightshift.collector")


class CannotStart(Exception):
    """The collector cannot start; the message is the one sentence to show."""


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Collector:
    def __init__(self, cfg: CollectorConfig):
        self.cfg = cfg
        self.metrics = Metrics()
        self.wal_dir = Path(cfg.wal_dir())
        self.ready = False
        self.grpc_port = self.http_port = 0
        self._stop = threading.Event()
        self._flusher_stop = flusher_process.StopSignal.pair()
        self._stats = flusher_process.SharedStats()
        self._flusher: flusher_process.FlusherProcess | flusher_thread.FlusherThread | None = None
        self._stuck_reported = 0.0  # the stuck flush (its start) already reported, in the thread form
        self._grpc = self._http = None

    # --- flusher process ----------------------------------------------------------------

    def _start_flusher(self) -> None:
        """The flusher, in the receiver's log format: both write to the same stderr,
        which a log pipeline reads as one stream."""
        settings = {"wal_dir": str(self.wal_dir), "data": self.cfg.data, "storage_options": self.cfg.storage_options,
                    "dedup_window": self.cfg.dedup_window, "dedup_memory": self.cfg.dedup_memory,
                    "compression": self.cfg.compression, "chunk_bytes": self.cfg.flush_chunk_bytes,
                    "log_level": logging.getLogger().level,
                    "log_format": logs.current()}
        if self.cfg.flusher_form() == "thread":
            self._flusher = flusher_thread.FlusherThread(settings, self._stats, self._flusher_stop)
            log.info("flusher started (thread %d of this process)", self._flusher.tid)
            return
        self._flusher = flusher_process.FlusherProcess(settings, self._stats, self._flusher_stop)
        log.info("flusher started (pid %d)", self._flusher.pid)

    def _health(self) -> tuple[bool, dict]:
        ok = self.ready and not self.log.lost  # a log without its folder acknowledges nothing
        info = {
            "status": "ok" if ok else "unavailable",
            "wal_bytes": self.log.bytes_on_disk,
            "flusher_pid": self._flusher.pid if self._flusher else None,
            "flusher_alive": bool(self._flusher and self._flusher.is_alive()),
            "flusher": self.cfg.flusher_form(),
        }
        if isinstance(self._flusher, flusher_thread.FlusherThread):
            info["flusher_tid"] = self._flusher.tid
        if self.log.lost:
            info["problem"] = self.log.lost
        return ok, info

    def _refresh_gauges(self) -> None:
        m, s = self.metrics, self._stats
        m.wal_bytes.set(self.log.bytes_on_disk)
        oldest = s[flusher_stats.OLDEST_PENDING_NS]
        m.flush_lag.set(max(0.0, time.time() - oldest / 1e9) if oldest else 0.0)
        m.flushed.labels("traces").set(s[flusher_stats.SPANS])
        m.flushed.labels("logs").set(s[flusher_stats.LOGS])
        m.flushed.labels("feedback").set(s[flusher_stats.FEEDBACK])
        m.duplicates.set(s[flusher_stats.DUPLICATES])
        m.flush_errors.set(s[flusher_stats.ERRORS])

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Everything up, or CannotStart with nothing left running."""
        cfg = self.cfg
        tls_pair, http_tls = self._tls()
        try:
            self.wal_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CannotStart(f"cannot create the write-ahead log's folder {self.wal_dir}: {e.strerror}") from None
        for addr in (cfg.grpc, cfg.http):
            if addr and addr != "off" and not _is_loopback(addr) and not cfg.token:
                log.warning("listening on non-loopback %s WITHOUT a bearer token: anyone who can reach it can write "
                            "spans. Set NIGHTSHIFT_COLLECTOR_TOKEN or collector.token.", addr)
        redactor = Redactor.from_config(cfg.redact.presets, cfg.redact.rules, cfg.redact.drop_keys)
        self.log = wal.WriteAheadLog(
            self.wal_dir, segment_bytes=cfg.segment_bytes, roll_interval=cfg.flush_interval,
            cap_bytes=cfg.wal_cap_bytes, sync=cfg.fsync, lock=True,
        )

        def on_sync(seconds: float, n: int) -> None:
            self.metrics.fsync_seconds.observe(seconds)
            self.metrics.fsync_batch.observe(n)

        self.log.on_sync = on_sync
        try:
            self.log.open()
        except wal.LogInUse as e:
            raise CannotStart(str(e)) from None
        except OSError as e:  # a folder it may not write, a segment it cannot read back
            raise CannotStart(f"cannot use the write-ahead log's folder {self.wal_dir}: "
                              f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}") from None
        limits = ClientLimits(cfg.client_max_inflight, cfg.client_bytes_per_s, cfg.client_burst_bytes)
        self.pipeline = Pipeline(self.log, redactor, self.metrics, cfg.max_inflight, limits, cfg.max_inflight_bytes)
        try:
            self._bind(tls_pair, http_tls)
            wal.instance_id(self.wal_dir)  # now, while there is room: the flusher needs it to name its files
        except (CannotStart, OSError) as e:
            self._unbind()
            self.log.close()
            if isinstance(e, CannotStart):
                raise
            raise CannotStart(f"cannot write in the write-ahead log's folder {self.wal_dir}: {e.strerror}") from None
        self._start_flusher()
        if self._http:
            http_server.serve(self._http)
        if self._grpc:
            self._grpc.start()
        self.ready = True
        log.info(
            "collector ready: grpc=%s http=%s%s data=%s wal=%s redaction=%s",
            f"{cfg.grpc.rpartition(':')[0]}:{self.grpc_port}" if self._grpc else "off",
            f"{cfg.http.rpartition(':')[0]}:{self.http_port}" if self._http else "off",
            " (tls)" if tls_pair else "", cfg.data, self.wal_dir,
            ",".join(cfg.redact.presets + [r["name"] for r in cfg.redact.rules]) or "off",
        )

    def _tls(self) -> tuple[tuple[bytes, bytes] | None, ssl.SSLContext | None]:
        """The certificate and key for gRPC (bytes) and HTTP (a context), read now
        so that a missing or broken file is a sentence before anything starts."""
        cfg = self.cfg
        if not (cfg.tls_cert or cfg.tls_key):
            return None, None
        try:
            pair = (Path(cfg.tls_cert).read_bytes(), Path(cfg.tls_key).read_bytes())
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except ssl.SSLError as e:
            raise CannotStart(f"the TLS certificate {cfg.tls_cert} and key {cfg.tls_key} cannot be used ({e.reason or e}): "
                              "give a PEM certificate and its private key") from None
        except OSError as e:
            raise CannotStart(f"cannot read {e.filename or 'the TLS certificate or key'} (collector.tls_cert / "
                              f"tls_key): {e.strerror}") from None
        return pair, context

    def _bind(self, tls_pair: tuple[bytes, bytes] | None, http_tls: ssl.SSLContext | None) -> None:
        """Both receivers bound, neither answering yet."""
        cfg = self.cfg
        try:
            if cfg.grpc and cfg.grpc != "off":
                name = "grpc"
                from . import grpc_server  # here: gRPC is 16 MiB of a receiver that listens on HTTP alone

                self._grpc, self.grpc_port = grpc_server.bind(
                    cfg.grpc, self.pipeline, token=cfg.token, limit=cfg.max_request_bytes, workers=cfg.grpc_workers,
                    tls=tls_pair,
                )
            if cfg.http and cfg.http != "off":
                name = "http"
                self._http, self.http_port = http_server.bind(
                    cfg.http, self.pipeline, token=cfg.token, limit=cfg.max_request_bytes, tls=http_tls,
                    health=self._health, before_scrape=self._refresh_gauges, request_timeout=cfg.request_timeout or None,
                )
        except listen.CannotListen as e:
            raise CannotStart(f"cannot listen on {e.address} (collector.{name}): {e.reason}") from None

    def _unbind(self) -> None:
        if self._http:
            self._http.server_close()
            self._http = None
        if self._grpc:
            self._grpc.stop(None)
            self._grpc = None

    def _watch_flusher(self) -> None:
        """Restarts a flusher that died, or that has been stuck on one segment for
        longer than `flush_timeout` (an object store that hangs instead of
        failing). The WAL keeps the segment; the new flusher redoes it."""
        if not self._flusher:
            return
        started = self._stats[flusher_stats.FLUSH_STARTED_S]
        stuck = self._flusher.is_alive() and started and time.time() - started > self.cfg.flush_timeout
        if stuck and isinstance(self._flusher, flusher_thread.FlusherThread):
            if started != self._stuck_reported:  # once per stuck flush: a thread cannot be killed
                self._stuck_reported = started
                log.error("flusher stuck for %.0fs on one segment (flush_timeout %.0fs); a flusher thread cannot be "
                          "killed: restart the collector (nothing is lost: the WAL keeps the data), or run "
                          "collector.flusher: process, whose flusher is restarted by itself",
                          time.time() - started, self.cfg.flush_timeout)
            return
        if stuck:
            log.error("flusher stuck for %.0fs on one segment (flush_timeout %.0fs); killing and restarting it "
                      "(nothing is lost: the WAL keeps the data)", time.time() - started, self.cfg.flush_timeout)
            self._flusher.kill()
            self._flusher.join(10)
            why = "stuck"
        elif not self._flusher.is_alive():
            log.error("flusher exited with code %s; restarting it (nothing is lost: the WAL keeps the data)",
                      self._flusher.exitcode)
            why = "exited"
        else:
            return
        self._stats[flusher_stats.FLUSH_STARTED_S] = 0.0
        self.metrics.flusher_restarts.labels(why).inc()
        self._start_flusher()

    def serve_forever(self) -> int:
        while not self._stop.wait(1.0):
            self._watch_flusher()
        return self.shutdown()

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def shutdown(self) -> int:
        """Stops the receivers, seals the log, lets the flusher drain. Each step runs
        whatever the one before met (a WAL folder deleted under it once raised here
        and left the flusher waiting forever)."""
        log.info("shutting down: refusing new requests, draining")
        self.ready = False
        try:
            if self._http:
                self._http.shutdown()
                self._http.server_close()
            if self._grpc:
                self._grpc.stop(grace=5.0).wait()
        finally:
            try:
                self.log.close()
            finally:
                self._flusher_stop.set()
                self._stop_flusher()
        try:
            left = sum(p.stat().st_size for p in wal.sealed_segments(self.wal_dir))
        except OSError:
            left = 0
        s = self._stats
        log.info("stopped: %d spans, %d log records and %d feedback labels written to Parquet this run, "
                 "%d duplicates dropped%s",
                 s[flusher_stats.SPANS], s[flusher_stats.LOGS], s[flusher_stats.FEEDBACK], s[flusher_stats.DUPLICATES],
                 f"; {left} bytes left in the WAL for next start" if left else "")
        return 0

    def _stop_flusher(self) -> None:
        if not self._flusher:
            return
        self._flusher.join(self.cfg.shutdown_timeout)
        if self._flusher.is_alive():
            log.warning("flusher did not finish within %.0fs; stopping it. Unflushed data stays in %s and is "
                        "flushed on the next start.", self.cfg.shutdown_timeout, self.wal_dir)
            self._flusher.terminate()
            self._flusher.join(5)


#: glibc malloc arenas the receiver's threads share (`few_arenas`).
MALLOC_ARENAS = 2


def few_arenas(environ=os.environ) -> None:
    """Caps the receiver's malloc arenas. glibc gives each thread that allocates an
    arena of its own (up to 8 per core) and an arena keeps what it freed, so each
    connection's thread held about one request's bytes and parsed message after
    answering it: measured with 16 senders of 2.4 MiB requests (5 KB spans), the
    receiver peaked at 107-115 MiB with `max_inflight_bytes` alone and at 77 MiB
    with two arenas (120-138 with neither), its CPU per span unchanged within the
    noise (the GIL serializes its allocations anyway). An operator's
    MALLOC_ARENA_MAX wins; another C library decides for itself."""
    if environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, MALLOC_ARENAS)  # -8: M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def run(cfg: CollectorConfig) -> int:
    """Serves until told to stop. Started from the full command line (which imports
    every stage), it first restarts itself lean: see `receiver_main`."""
    if receiver_main.worth_it():
        receiver_main.exec_lean(cfg, logging.getLogger().level, logs.current())
    few_arenas()  # before the servers' threads allocate
    if cfg.flusher_form() == "thread":
        flusher_thread.prepare_process()
    c = Collector(cfg)
    c.start()
    signal.signal(signal.SIGTERM, c.request_stop)
    signal.signal(signal.SIGINT, c.request_stop)
    return c.serve_forever()
