"""The ingest benchmark's senders back off as OTLP exporters do: for the delay
the collector asked for (HTTP `Retry-After`, gRPC `RetryInfo`), then resend the
refused batch. A fixed 0.1 s pause made four senders knock ten times a second
each on a sidecar held at its WAL cap, and the refusals it measured were the
benchmark's, not an exporter's."""

from __future__ import annotations

import http.server
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

import pytest

from nightshift.collector.errors import Overloaded, Throttled
from nightshift.collector.responses import retry_after_header, retry_info, status

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import otlp_load  # noqa: E402

del sys.path[0]


def test_retry_after_is_read_as_seconds_or_a_date():
    assert otlp_load.retry_after_s(retry_after_header(Overloaded("full", retry_after=2.2))) == 3.0
    assert otlp_load.retry_after_s("7") == 7.0
    def date(offset_s: float) -> str:
        return time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + offset_s))

    assert otlp_load.retry_after_s(date(3600)) == otlp_load.MAX_RETRY_S  # capped
    assert otlp_load.retry_after_s(date(-3600)) == 0.0  # already past
    for absent in (None, "", "soon", "nan"):
        assert otlp_load.retry_after_s(absent) == otlp_load.DEFAULT_RETRY_S
    assert otlp_load.retry_after_s("-5") == 0.0


def test_the_collectors_grpc_retry_info_is_read_from_its_trailers():
    """What collector/grpc_server.py puts in the trailers, read back."""
    e = Overloaded("the write-ahead log is full", retry_after=1.5)
    both = (("grpc-status-details-bin", status(e).SerializeToString()),
            ("google.rpc.retryinfo-bin", retry_info(e).SerializeToString()))
    assert otlp_load.grpc_retry_s(both) == 1.5
    assert otlp_load.grpc_retry_s(both[1:]) == 1.5
    assert otlp_load.grpc_retry_s((("grpc-status-details-bin", status(Throttled("yours", 0.25)).SerializeToString()),)) == 0.25
    assert otlp_load.grpc_retry_s((("grpc-status-details-bin", b"\xff not a status"),)) is None
    assert otlp_load.grpc_retry_s(()) is None


class _Refuser(http.server.BaseHTTPRequestHandler):
    """503 + Retry-After to the first POST, 200 to the rest; keeps every body."""

    protocol_version = "HTTP/1.1"
    bodies: list[bytes] = []
    retry_after = "30"

    def do_GET(self):  # noqa: N802 - the client's opening /healthz
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        first = not self.bodies
        self.bodies.append(body)
        self.send_response(503 if first else 200)
        if first:
            self.send_header("Retry-After", self.retry_after)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def refuser():
    _Refuser.bodies = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuser)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _phase(port: int, retry_after: str, seconds: float) -> dict:
    """One closed-loop phase of one sender process against the refuser."""
    _Refuser.retry_after = retry_after
    templates = otlp_load.build_templates(1, 4, span_bytes=otlp_load.span_range(1))
    parent, child = mp.get_context("fork").Pipe()
    p = mp.get_context("fork").Process(target=otlp_load.sender_main, args=(0, "http", port, templates, child), daemon=True)
    p.start()
    try:
        parent.send(("prepare",))
        assert parent.recv() == ("ready",)
        start = time.perf_counter()
        parent.send(("run", start, start + seconds, 0.0, 0.0))
        assert parent.poll(60)
        out = parent.recv()
        parent.send(("stop",))
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    return out


def test_a_refused_sender_waits_as_asked_then_resends_the_same_batch(refuser):
    port = refuser.server_address[1]
    out = _phase(port, "30", 0.5)
    # Asked for 30 s in a 0.5 s phase: one knock, no retry before the phase ended
    # (the fixed 0.1 s pause knocked again and again).
    assert (out["refused"], out["acked_reqs"], len(_Refuser.bodies)) == (1, 0, 1)
    _Refuser.bodies = []
    out = _phase(port, "0", 0.5)
    assert out["refused"] == 1 and out["acked_reqs"] >= 1
    assert _Refuser.bodies[1] == _Refuser.bodies[0]  # the batch resent, not new spans in its place
    assert len(set(_Refuser.bodies[1:])) == len(_Refuser.bodies) - 1  # then new ids on every send
