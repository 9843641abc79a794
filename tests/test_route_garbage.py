"""A streamed answer leaves no garbage for the collector: what the proxy made for
it is freed by reference counting when it ends. Objects left in reference cycles
wait for a collection, and at 200 streams in flight each young-generation pass
walked hundreds of finished exchanges (their futures, their writer closure, a
prompt trial's StreamMarker): a pause that lands on every stream at once, where
issue 27's p99 target is measured."""

from __future__ import annotations

import asyncio
import gc
import weakref

from nightshift.route import proxy, upstream
from route_loopback import proxy_before

EVENTS = [b'data: {"model": "m", "choices": [{"delta": {"content": "tok %d"}}]}\n\n' % i for i in range(3)]


class Upstream(asyncio.Protocol):
    """A stand-in vLLM: every request gets a short SSE stream, chunked and paced, kept alive.
    `bodies` counts the parsed request bodies still alive as each answer starts."""

    bodies: list[int] = []

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        if sep and len(rest) >= n:
            self.buf = rest[n:]
            Upstream.bodies.append(sum(r() is not None for r in parsed))
            chunks = [b"%x\r\n%s\r\n" % (len(e), e) for e in EVENTS + [b"data: [DONE]\n\n"]]
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            loop = asyncio.get_running_loop()
            for i, c in enumerate(chunks):  # paced, as decoding is: the proxy streams it, not reads it whole
                loop.call_later(0.01 * (i + 1), self.t.write, c)
            loop.call_later(0.01 * (len(chunks) + 1), self.t.write, b"0\r\n\r\n")


async def _streams(tmp_path, n: int) -> list[weakref.ref]:
    body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    async with proxy_before(Upstream, tmp_path) as listen:
        reader, writer = await asyncio.open_connection("127.0.0.1", listen)
        try:
            for _ in range(n):
                writer.write(request)
                got = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 3)
                assert got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got
            await asyncio.sleep(0.05)  # the handler's last steps after its end went out
            return made
        finally:
            writer.close()
            await writer.wait_closed()


made: list[weakref.ref] = []
parsed: list[weakref.ref] = []


def test_a_finished_stream_leaves_its_exchange_to_reference_counting(tmp_path, monkeypatch):
    init = upstream.Exchange.__init__

    def tracked(self, *a, **kw) -> None:
        init(self, *a, **kw)
        made.append(weakref.ref(self))

    monkeypatch.setattr(upstream.Exchange, "__init__", tracked)
    made.clear()
    parsed.clear()
    Upstream.bodies = []
    gc.collect()
    gc.disable()
    try:
        refs = asyncio.run(_streams(tmp_path, 5))
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
        gc.unfreeze()  # serve() froze the test process's heap, as it does the proxy's
    assert len(refs) == 5
    assert alive == 0, f"{alive} of 5 finished exchanges wait for the garbage collector (a reference cycle)"


def test_the_parsed_body_is_not_kept_while_the_upstream_answers(tmp_path, monkeypatch):
    """The request's body read as JSON (two dozen dicts and lists for an agent's call)
    is what the route decides on; kept through the answer, it was a third of what the
    collector walked in each young pass at 200 streams."""
    read = proxy.read

    def tracked(body: bytes):
        got = read(body)
        if got is not None:
            parsed.append(weakref.ref(got))
        return got

    monkeypatch.setattr(proxy, "read", tracked)
    parsed.clear()
    Upstream.bodies = []
    gc.collect()
    gc.disable()
    try:
        asyncio.run(_streams(tmp_path, 3))
    finally:
        gc.enable()
        gc.unfreeze()
    assert len(parsed) == 3 and Upstream.bodies == [0, 0, 0]
