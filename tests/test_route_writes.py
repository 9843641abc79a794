"""The proxy's CPU per streamed answer (issue 27's route target: p99 < 2 ms at 200
streams on 2 shared cores, where the p99 is queueing behind CPU): a write to the
client costs a send, so the upstream connection hands its writer one piece per
read, and leaves the read that ends the answer for the caller to send with the
answer's end (`Exchange.tail`, then `write_eof` in one write)."""

from __future__ import annotations

import asyncio

from nightshift.route.upstream import Connection, Exchange, Pool


class Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str):
        return None

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def exchange() -> tuple[Connection, Exchange, list[bytes]]:
    loop = asyncio.new_event_loop()
    conn = Connection(Pool("127.0.0.1", 1, 1.0, 1.0))
    conn.connection_made(Transport())
    ex = Exchange(loop, head_only=False)
    conn.send(b"POST / HTTP/1.1\r\n\r\n", ex)
    written: list[bytes] = []
    return conn, ex, written


def test_one_write_per_read_from_the_upstream():
    conn, ex, written = exchange()
    conn.data_received(HEAD + chunk(b"data: 1\n\n"))
    ex.pipe(written.append)
    assert written == [b"data: 1\n\n"]  # what came before pipe, at once
    conn.data_received(chunk(b"data: 2\n\n") + chunk(b"data: 3\n\n") + chunk(b"data: 4\n\n"))
    assert written == [b"data: 1\n\n", b"data: 2\n\ndata: 3\n\ndata: 4\n\n"]  # three chunks in one read: one write
    conn.data_received(chunk(b"data: 5\n\n"))
    assert written[-1] == b"data: 5\n\n" and not ex.done.done()


def test_the_read_that_ends_the_answer_is_left_for_its_end():
    conn, ex, written = exchange()
    conn.data_received(HEAD)
    ex.pipe(written.append)
    conn.data_received(chunk(b"data: 1\n\n"))
    conn.data_received(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    assert ex.done.done() and written == [b"data: 1\n\n"]
    assert ex.tail() == b"data: [DONE]\n\n" and ex.tail() == b""  # sent once, by the caller, with the end


def test_an_answer_complete_before_pipe_is_all_tail():
    conn, ex, written = exchange()
    conn.data_received(HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n") + b"0\r\n\r\n")
    ex.pipe(written.append)
    assert written == [] and ex.tail() == b"data: 1\n\ndata: 2\n\n"


def test_the_request_paths_metrics_are_looked_up_once(monkeypatch):
    """prometheus_client's labels() takes a lock and checks its arguments each call:
    the request path's counters keep their children, and the counts still land."""
    from prometheus_client import Counter

    from nightshift.route.metrics import Metrics

    m = Metrics()
    calls = []
    real = Counter.labels
    monkeypatch.setattr(Counter, "labels", lambda self, *v: calls.append(v) or real(self, *v))
    for _ in range(5):
        m.request("agent", "agent@v0002", "200").inc()
        m.decision("agent", "agent@v0002", "candidate", "trace").inc()
        m.prompt_decision("prompt:ab12", "serving", "trace").inc()
    assert len(calls) == 3
    text = m.render().decode()
    assert 'nightshift_route_requests_total{route="agent",status="200",version="agent@v0002"} 5.0' in text
    assert 'nightshift_route_prompt_decisions_total{arm="serving",key="trace",route="prompt:ab12"} 5.0' in text
