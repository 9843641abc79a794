"""The proxy takes the collector's passes itself (route/gcidle.py): the interpreter's
automatic collector is off while it serves, a full pass runs when the last request
in flight ends, and a proxy that is never idle still collects (every `max_gap`
seconds of serving, or once the tracked objects grew by `max_growth`). Each
automatic pass stalled every stream in flight (issue 27's p99).

What could leak is cyclic garbage, and the error paths make it (counted with the
collector off, per request, its new connection's 7 included: unreachable ~47
objects, a malformed request ~29, a client gone inside a stream ~28, upstream
broken inside a stream or silent past read_timeout ~27, 69 and 58 before route9,
which also held the request's body): after many of them the proxy's own passes
leave none behind, and what waits for a pass holds no body."""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import time
import tracemalloc

import pytest

from nightshift.route import gcidle
from nightshift.route.gcidle import IdleCollector
from route_loopback import proxy_before

DONE = b"data: [DONE]\n\n"


class Upstream(asyncio.Protocol):
    """A stand-in vLLM whose answer the request's `model` picks: `ok` a short stream,
    `slow` a stream of 40 events 50 ms apart, `break` one event then the connection
    cut, `silent` nothing (the proxy's read_timeout answers 504)."""

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        n = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)) if sep else -1
        if not sep or len(rest) < n:
            return
        self.buf, mode = rest[n:], re.search(rb'"model": "(\w+)"', rest[:n]).group(1)
        if mode == b"silent":
            return
        loop, event = asyncio.get_running_loop(), b'data: {"model": "m"}\n\n'
        self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n" % (len(event), event))
        if mode == b"break":
            loop.call_later(0.005, self.t.abort)
            return
        for i in range(1, 40 if mode == b"slow" else 1):
            loop.call_later(0.05 * i, self.t.write, b"%x\r\n%s\r\n" % (len(event), event))
        loop.call_later(0.05 * (39 if mode == b"slow" else 0) + 0.001, self.t.write,
                        b"%x\r\n%s\r\n0\r\n\r\n" % (len(DONE), DONE))


def request(model: str, pad: int = 0) -> bytes:
    body = b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "hi%s"}]}' % (
        model.encode(), b"x" * pad)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


MALFORMED = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nBad\x01Header: x\r\n\r\n"


def send(port: int, data: bytes, n: int, hang_up: bool = False) -> None:
    """n requests, each on a connection of its own, read to the end (or, hang_up,
    closed after the first bytes of the answer). Blocking sockets in a thread: they
    make no cycles of their own, so what the collector finds is the proxy's."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(data)
            buf = b""
            while not hang_up or not buf:
                piece = s.recv(65536)
                buf += piece
                head, sep, rest = buf.partition(b"\r\n\r\n")
                m = re.search(rb"(?i)content-length: *(\d+)", head)
                if not piece or (sep and (len(rest) >= int(m.group(1)) if m else buf.endswith(b"0\r\n\r\n"))):
                    break


def proxy(tmp_path):
    """The proxy before this file's scripted upstream, reads timing out at 0.1 s."""
    return proxy_before(Upstream, tmp_path, read_timeout=0.1)


async def metric(port: int, name: str) -> float:
    """A figure of the proxy's /metrics (read from a thread: the proxy serves in this loop)."""
    return await asyncio.to_thread(_metric, port, name)


def _metric(port: int, name: str) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        text = b"".join(iter(lambda: s.recv(65536), b"")).decode()
    m = re.search(r"^%s (\S+)$" % re.escape(name), text, re.M)
    return float(m.group(1)) if m else 0.0


IDLE = 'nightshift_route_gc_scheduled_passes_total{why="idle"}'


def test_the_collector_is_off_while_the_proxy_serves_and_as_it_was_after(tmp_path):
    """Fails before route9: the interpreter's collector ran its passes mid-stream."""
    assert gc.isenabled()

    async def go() -> tuple[bool, int]:
        async with proxy(tmp_path) as port:
            await asyncio.to_thread(send, port, request("ok"), 1)
            return gc.isenabled(), port

    serving, _ = asyncio.run(go())
    assert not serving
    assert gc.isenabled()


def test_no_cycles_left_after_many_error_requests(tmp_path, monkeypatch):
    """Streams cut by the upstream, upstreams silent past read_timeout, clients gone
    mid-stream, malformed requests: what they leave in reference cycles is collected
    by the proxy's own pass once it is idle, nothing left for a later one."""
    monkeypatch.setattr(IdleCollector, "tick", 0.1)
    n = 25

    async def go() -> tuple[float, float, int]:
        async with proxy(tmp_path) as port:
            await asyncio.sleep(IdleCollector.min_gap)
            gc.collect()  # what start-up and the test's own set-up left, out of the count
            for data, hang_up in ((request("break"), False), (request("silent"), False), (request("slow"), True),
                                  (MALFORMED, False)):
                await asyncio.to_thread(send, port, data, n, hang_up)
            idle = await metric(port, IDLE)
            t = time.monotonic()
            while await metric(port, IDLE) == idle and time.monotonic() - t < 5:  # the pass as the proxy goes idle
                await asyncio.sleep(0.1)
            left = gc.collect()
            return idle, await metric(port, IDLE), left

    before, after, left = asyncio.run(go())
    assert after > before
    assert left < 100  # with the proxy's passes made no-ops: 2,785 (measured), ~28 a request


def test_what_a_failed_request_leaves_for_the_collector_does_not_hold_its_body(tmp_path, monkeypatch):
    """An upstream silent past read_timeout, or gone before answering: the exception
    (its traceback through the request's frame) and the dead upstream connection
    (its parser calls it back) are garbage in cycles until a pass, and they held the
    request, body and all (1 MB a request measured), for as long as the collector is
    off. Fails before route9: 10 MB held by 5 such requests of 1 MB."""
    monkeypatch.setattr(IdleCollector, "collect", lambda self, why: None)  # what waits for a pass, counted
    big = request("silent", pad=1_000_000)

    async def go() -> int:
        async with proxy(tmp_path) as port:
            gc.collect()
            tracemalloc.start()
            try:
                await asyncio.to_thread(send, port, big, 5)
                await asyncio.sleep(0.2)
                held = tracemalloc.get_traced_memory()[0]
                gc.collect()
                return held - tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()

    gc.disable()  # the interpreter's passes too, as while the proxy serves (before route9 they would have run)
    try:
        freed = asyncio.run(go())
    finally:
        gc.enable()
    assert freed < 1_000_000


def test_a_proxy_never_idle_still_collects_every_max_gap(tmp_path, monkeypatch):
    """One stream in flight all along: no idle moment, and a pass still comes within
    max_gap of serving, counted as a stall of the streams in flight."""
    monkeypatch.setattr(IdleCollector, "max_gap", 0.4)
    monkeypatch.setattr(IdleCollector, "tick", 0.1)

    async def go() -> tuple[float, float]:
        async with proxy(tmp_path) as port:
            await asyncio.to_thread(send, port, request("slow"), 1)  # ~2 s in flight
            return (await metric(port, 'nightshift_route_gc_scheduled_passes_total{why="gap"}'),
                    await metric(port, "nightshift_route_gc_stall_seconds_count"))

    gaps, stalls = asyncio.run(go())
    assert gaps >= 2 and stalls >= 2


def test_a_burst_of_cyclic_garbage_is_collected_before_max_gap(tmp_path, monkeypatch):
    """Growth bound: the tracked objects grow by max_growth (here cycles the test
    makes while a stream is in flight) and a pass comes at the next tick."""
    monkeypatch.setattr(IdleCollector, "max_growth", 20_000)
    monkeypatch.setattr(IdleCollector, "tick", 0.1)

    async def go() -> float:
        async with proxy(tmp_path) as port:
            stream = asyncio.create_task(asyncio.to_thread(send, port, request("slow"), 1))
            await asyncio.sleep(0.3)
            for _ in range(15_000):
                a: list = []
                a.append([a])  # two lists in a cycle
            await stream
            return await metric(port, 'nightshift_route_gc_scheduled_passes_total{why="growth"}')

    assert asyncio.run(go()) >= 1


def test_idle_passes_come_when_the_last_request_ends_at_most_every_min_gap():
    async def go() -> list[str]:
        seen: list[str] = []
        c = IdleCollector(seen.append)
        c.start()
        try:
            c.last -= c.min_gap
            c.begin(), c.begin()
            c.end()
            await asyncio.sleep(0)
            assert seen == []  # one still in flight
            c.end()
            await asyncio.sleep(0)
            assert seen == ["idle"]
            c.begin(), c.end()
            await asyncio.sleep(0)
            assert seen == ["idle"]  # within min_gap of the last pass
            return seen
        finally:
            c.stop()

    assert asyncio.run(go()) == ["idle"]


def test_two_proxies_in_one_process_leave_the_collector_as_it_was():
    gc.disable()
    try:
        gcidle.hold(), gcidle.hold()
        gcidle.release()
        assert not gc.isenabled()
        gcidle.release()
        assert not gc.isenabled()  # it was off before the first
    finally:
        gc.enable()
    gcidle.hold(), gcidle.hold()
    gcidle.release()
    assert not gc.isenabled()  # one proxy still serves
    gcidle.release()
    assert gc.isenabled()
