"""A streamed answer's head goes out with its first event, in one send: the proxy
sent it apart as soon as the upstream's head came, one send in every ~22 of a
20-event answer (and a wake-up of the client) for bytes no OpenAI client acts on
before the first event. What the client receives is unchanged."""

from __future__ import annotations

import asyncio

from nightshift.route import upstream
from route_loopback import proxy_before

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b'data: {"model": "m", "choices": [{"delta": {"content": "tok"}}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream(asyncio.Protocol):
    """A stand-in vLLM that sends its head at once and each event only when told."""

    last: Upstream | None = None

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\r\n\r\n" in self.buf and self.buf.endswith(b"}"):
            self.t.write(HEAD)
            Upstream.last = self


class Client(asyncio.Protocol):
    def connection_made(self, transport) -> None:
        self.t, self.reads, self.more = transport, [], asyncio.Event()

    def data_received(self, data: bytes) -> None:
        self.reads.append(data)
        self.more.set()


async def _one_answer(tmp_path, monkeypatch, empty: bool = False) -> list[bytes]:
    """The client's reads of one streamed answer, the upstream's first event held
    until the proxy is streaming it (its writer piped) and the loop has turned."""
    piped = asyncio.Event()
    pipe = upstream.Exchange.pipe
    monkeypatch.setattr(upstream.Exchange, "pipe", lambda self, write: (pipe(self, write), piped.set())[0])
    loop = asyncio.get_running_loop()
    async with proxy_before(Upstream, tmp_path) as listen:
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
        transport, client = await loop.create_connection(Client, "127.0.0.1", listen)
        try:
            transport.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            await asyncio.wait_for(piped.wait(), 5)
            for _ in range(20):  # turns of the loop: a head already sent would be read by now
                await asyncio.sleep(0)
            before = list(client.reads)
            if empty:
                Upstream.last.t.write(b"0\r\n\r\n")
            else:
                Upstream.last.t.write(chunk(EVENT))
                while not client.reads[len(before):]:
                    client.more.clear()
                    await asyncio.wait_for(client.more.wait(), 5)
                Upstream.last.t.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            while not b"".join(client.reads).endswith(b"\r\n0\r\n\r\n"):
                client.more.clear()
                await asyncio.wait_for(client.more.wait(), 5)
            return [*before, b"--"] + client.reads[len(before):]
        finally:
            transport.close()


def test_the_head_goes_out_with_the_first_event_in_one_send(tmp_path, monkeypatch):
    reads = asyncio.run(_one_answer(tmp_path, monkeypatch))
    assert reads[0] == b"--", "the head went out before the first event, in a send of its own"
    first = reads[1]
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\n" + chunk(EVENT))
    whole = b"".join(reads[1:])
    assert whole.endswith(chunk(EVENT) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    assert b"transfer-encoding: chunked" in whole.lower() and b"text/event-stream" in whole


def test_an_answer_with_no_event_still_gets_its_head_with_its_end(tmp_path, monkeypatch):
    reads = asyncio.run(_one_answer(tmp_path, monkeypatch, empty=True))
    whole = b"".join(x for x in reads if x != b"--")
    assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\n0\r\n\r\n")
    assert whole.count(b"HTTP/1.1") == 1
