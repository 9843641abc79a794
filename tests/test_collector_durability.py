"""Nothing acknowledged is lost: kill -9 under load, a full write-ahead log, restarts."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from conftest import read_spans
from helpers import grpc_export, make_request, post


def _load(port: int, stop: threading.Event, acked: list, refused: list, use_grpc: bool = False) -> None:
    """Sends unique spans until `stop`; records the ids of every acknowledged request."""
    while not stop.is_set():
        req, ids = make_request(20, content="y" * 500)
        body = req.SerializeToString()
        try:
            if use_grpc:
                _, err = grpc_export(port, body, timeout=5)
                ok = err is None
            else:
                ok = post(port, "/v1/traces", body)[0] == 200
        except OSError:
            ok = False
        (acked if ok else refused).extend(ids if ok else [1])
        if not ok:
            time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["process", "thread"])  # collector.flusher: the thread dies with the receiver
def test_kill9_under_load_loses_no_acknowledged_span(collector_factory, form):
    env = {"NIGHTSHIFT_COLLECTOR_FLUSHER": form}
    c = collector_factory(env=env)
    c.start()
    acked: list = []
    refused: list = []
    for round_ in range(3):
        stop = threading.Event()
        senders = [threading.Thread(target=_load, args=(c.http_port if i % 2 == 0 else c.grpc_port, stop, acked, refused, i % 2 == 1)) for i in range(4)]
        for t in senders:
            t.start()
        time.sleep(1.5)
        c.kill9()  # mid-load, mid-flush
        time.sleep(0.3)
        stop.set()
        for t in senders:
            t.join()
        # Restart on the same WAL and data: recovery replays what was acknowledged.
        c = collector_factory(grpc_port=c.grpc_port, http_port=c.http_port, env=env)
        c.start()
    assert c.health()["flusher"] == form
    assert c.stop() == 0
    spans = read_spans(c.data)
    stored = list(zip(spans["trace_id"], spans["span_id"]))
    assert len(acked) > 1000, "the load generator acknowledged too little to mean anything"
    assert len(stored) == len(set(stored)), "a span is stored twice"
    missing = set(acked) - set(stored)
    assert not missing, f"{len(missing)} acknowledged spans lost"
    assert not list(c.wal.glob("*.sealed"))


def test_full_wal_pushes_back_with_retryable_codes_then_recovers(collector_factory):
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES": "200KiB"}).start()
    flusher_pid = c.health()["flusher_pid"]
    os.kill(flusher_pid, signal.SIGSTOP)  # the flusher falls behind
    acked = []
    try:
        status = headers = None
        for _ in range(200):
            req, ids = make_request(20, content="z" * 1000)
            status, headers, _ = post(c.http_port, "/v1/traces", req.SerializeToString())
            if status != 200:
                break
            acked += ids
        assert status == 503, "the WAL cap never pushed back"
        assert int(headers["retry-after"]) >= 1
        req, ids = make_request(20, content="z" * 1000)
        _, err = grpc_export(c.grpc_port, req.SerializeToString())
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
        trailers = dict(err.trailing_metadata())
        assert "google.rpc.retryinfo-bin" in trailers
        assert c.health()["status"] == "ok"  # pushing back, not falling over
    finally:
        os.kill(flusher_pid, signal.SIGCONT)
    # Recovers by itself once the flusher catches up.
    deadline = time.time() + 30
    while time.time() < deadline:
        req, ids = make_request(20)
        if post(c.http_port, "/v1/traces", req.SerializeToString())[0] == 200:
            acked += ids
            break
        time.sleep(0.2)
    else:
        pytest.fail("collector never accepted again after the flusher caught up")
    assert c.stop() == 0
    spans = read_spans(c.data)
    assert sorted(zip(spans["trace_id"], spans["span_id"])) == sorted(acked)


def test_flusher_crash_is_survived(collector_factory):
    c = collector_factory().start()
    req, ids = make_request(10)
    assert post(c.http_port, "/v1/traces", req.SerializeToString())[0] == 200
    old = c.health()["flusher_pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.time() + 20
    while time.time() < deadline:
        h = c.health() or {}
        if h.get("flusher_pid") != old and h.get("flusher_alive"):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the collector did not restart its flusher")
    req2, ids2 = make_request(10)
    assert post(c.http_port, "/v1/traces", req2.SerializeToString())[0] == 200
    assert c.stop() == 0
    spans = read_spans(c.data)
    assert sorted(zip(spans["trace_id"], spans["span_id"])) == sorted(ids + ids2)


def _healthz(c) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{c.http_url}/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _until(cond, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            pytest.fail("condition never became true")
        time.sleep(0.05)


def test_a_deleted_wal_folder_is_refused_with_retryable_codes_and_red_health_not_acknowledged(collector_factory):
    """An operator's `rm -rf` of the WAL (or a volume gone) under a running collector:
    exports are refused (503 / UNAVAILABLE, the clients keep their spans) instead of
    acknowledged into an unlinked file, health is red, a recreated folder is used
    again, and SIGTERM with the folder gone again exits 0 with every acknowledged
    span in Parquet (it used to die with a FileNotFoundError traceback, or hang)."""
    import shutil

    from hardening.proc import drained

    # segments never roll by age here: what is acknowledged stays in the open segment,
    # the one only the process holds once its folder is gone
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "1h"}).start()
    acked, refused = [], []

    def send() -> int:
        req, ids = make_request(5)
        status = post(c.http_port, "/v1/traces", req.SerializeToString())[0]
        (acked if status == 200 else refused).extend(ids)
        return status

    assert send() == 200
    shutil.rmtree(c.wal)
    assert send() == 503
    req, ids = make_request(5)
    _, err = grpc_export(c.grpc_port, req.SerializeToString())
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    refused += ids
    code, health = _healthz(c)
    assert code == 503 and str(c.wal) in health["problem"]
    c.wal.mkdir()  # put back: the collector takes it again by itself
    _until(lambda: _healthz(c)[0] == 200)
    drained(c, timeout=60)  # what was held is written back and flushed
    assert send() == 200
    shutil.rmtree(c.wal)  # and gone again at shutdown
    _until(lambda: _healthz(c)[0] == 503)
    assert c.stop(timeout=60) == 0
    log = c.log_tail(200_000)
    assert "Traceback" not in log, log
    stored = set(zip(*[read_spans(c.data)[k] for k in ("trace_id", "span_id")]))
    assert set(acked) <= stored, f"{len(set(acked) - stored)} acknowledged spans lost"
    assert not set(refused) & stored
