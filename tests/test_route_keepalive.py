"""The proxy keeps its upstream connections open between requests (no idle limit
or timeout of its own: 200 streams reuse 200 connections), and the upstream closes
one when it has been idle for its keep-alive timeout (vLLM: 5 s). A request sent
on it as it closes was a 502 to the agent ("closed the connection before
answering"), though the upstream never began it: it goes out again, once, on a new
connection. An upstream that closes on a connection's first request is still a 502."""

from __future__ import annotations

import asyncio
import json

from route_loopback import proxy_before


class Upstream(asyncio.Protocol):
    """A stand-in vLLM whose keep-alive timeout crosses every second request on a
    connection: it answers a connection's first request and closes the connection,
    unanswered, when the next one comes (or, `always_close`, on the first)."""

    connections = 0
    always_close = False

    def connection_made(self, transport) -> None:
        self.t, self.buf, self.answered = transport, b"", 0
        Upstream.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        head, sep, rest = self.buf.partition(b"\r\n\r\n")
        n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]) if sep else -1
        if not sep or len(rest) < n:
            return
        self.buf = rest[n:]
        if self.answered or Upstream.always_close:
            self.t.close()
            return
        self.answered += 1
        out = json.dumps({"model": "m", "connection": Upstream.connections}).encode()
        self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(out), out))


async def _answers(tmp_path, n: int) -> list[bytes]:
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    answers = []
    async with proxy_before(Upstream, tmp_path) as listen:
        for _ in range(n):  # one at a time: each goes out on the pool's one idle connection
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            answers.append(await asyncio.wait_for(reader.read(), 5))
            writer.close()
    return answers


def test_a_kept_alive_connection_closed_under_a_request_sends_it_again_on_a_new_one(tmp_path):
    Upstream.connections, Upstream.always_close = 0, False
    answers = asyncio.run(_answers(tmp_path, 3))
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 3, answers
    assert [json.loads(a.partition(b"\r\n\r\n")[2])["connection"] for a in answers] == [1, 2, 3]
    assert Upstream.connections == 3  # each retry a connection of its own, nothing more


def test_an_upstream_that_closes_on_a_first_request_is_still_a_502(tmp_path):
    Upstream.connections, Upstream.always_close = 0, True
    answers = asyncio.run(_answers(tmp_path, 1))
    assert answers[0].startswith(b"HTTP/1.1 502") and b"closed the connection before answering" in answers[0]
    assert Upstream.connections == 1  # not sent again: a fresh connection's loss is the upstream's answer
