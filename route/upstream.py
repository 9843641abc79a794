"""The proxy's HTTP/1.1 client to the upstream: kept-alive connections, responses
parsed by llhttp (httptools, as in uvicorn), and a streamed body written straight
from the socket callback to the client's socket, with no task woken per chunk.

Measured (benchmarks/route.py, 200 streams): aiohttp's client cost the proxy
about 45 us of CPU per SSE chunk and 300 us per request on this machine; this
one about half. What it leaves to the caller: which bytes to send, and what to
do with a head, a body, or a broken exchange.

An https upstream is spoken to over TLS, its certificate verified against the
system's CAs (or `route.upstream_ca_file`) for the upstream's host name: the
proxy may send `upstream_api_key` and every prompt, which must not go out in
clear or to whoever answers on that address.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

import httptools


class UpstreamError(Exception):
    """The upstream could not be reached (`kind` connect), failed the TLS handshake
    (tls: its certificate not trusted, or not TLS at all), fell silent (timeout),
    or dropped the connection inside an answer (broken)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Exchange:
    """One request's answer as it arrives: `head` resolves to (status, reason-less
    raw headers), `done` when the body is complete. Body pieces are kept until
    `pipe` gives a writer, then written through it as they come."""

    def __init__(self, loop: asyncio.AbstractEventLoop, head_only: bool) -> None:
        self.head: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()
        self.head_only = head_only
        self.status, self.headers = 0, []
        self.body: list[bytes] = []  # pieces not yet given to `write` (all of them until `pipe`)
        self.write = None  # set by pipe(): called with the pieces of each read from the upstream
        self.conn: Connection | None = None
        self.dropped = False  # the caller is done with it (Pool.drop): a retry sends nothing

    def pipe(self, write) -> None:
        """Hand the body to `write` from now on: what came before goes out at once, as
        one piece. Once `done`, the pieces of the last read stay in `body` (`tail`),
        for the caller to send with its answer's end in one write."""
        if self.body and not self.done.done():
            write(b"".join(self.body))
            self.body = []
        self.write = write

    def tail(self) -> bytes:
        """The pieces of the read that completed the answer, not yet written."""
        tail, self.body = b"".join(self.body), []
        return tail

    def fail(self, error: UpstreamError) -> None:
        for f in (self.head, self.done):
            if not f.done():
                f.set_exception(error)
                f.exception()  # retrieved: a caller that only awaits `head` leaves no warning behind


class Connection(asyncio.Protocol):
    def __init__(self, pool: "Pool") -> None:
        self.pool, self.transport, self.ex = pool, None, None
        self.parser = httptools.HttpResponseParser(self)
        self.last = time.monotonic()
        self.paused = False
        self.sent = 0  # requests sent on it: from the second on, it was kept alive in between
        self.unanswered: bytes | None = None  # the request in flight, until its answer's first byte

    # asyncio
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a request goes out in one write, but never wait on Nagle for it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        """One write to the client per read from the upstream, not one per chunk: the
        send is most of a piece's cost, and a proxy that falls behind reads several
        chunks at once. The read that ends the answer is left for the caller
        (`Exchange.tail`), which sends it with the answer's end."""
        self.last, self.unanswered = time.monotonic(), None
        ex = self.ex
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if ex is not None and ex.write is not None and ex.body:  # what was good goes out, as it did per chunk
                ex.write(b"".join(ex.body))
                ex.body = []
            self._broken(f"the upstream sent bad HTTP: {e}")
            return
        if ex is not None and ex.write is not None and ex.body and not ex.done.done():
            piece, ex.body = b"".join(ex.body) if len(ex.body) > 1 else ex.body[0], []
            ex.write(piece)

    def connection_lost(self, exc) -> None:
        self.pool.forget(self)
        reason = self.pool.closing_reason.pop(self, "broken")
        # a closed connection is garbage in a cycle (its parser calls it back) until the proxy's next collector
        # pass (gcidle.py): it must not keep the request it was sending, up to max_body_bytes, until then
        request, self.unanswered = self.unanswered, None
        if self.ex is not None:
            ex, self.ex = self.ex, None
            if reason == "broken" and self.sent > 1 and request is not None and not self.pool.closed:
                self.pool.retry(ex, request)
                return
            where = "inside its answer" if ex.head.done() else "before answering"
            if reason == "timeout":
                why = (f"nothing came for {self.pool.read_timeout:g} s {where} (route.read_timeout), so the proxy "
                       "gave up")
            else:
                why = f"the upstream closed the connection {where}" + (f" ({exc})" if exc else "")
            ex.fail(UpstreamError(reason, why))

    # httptools
    def on_header(self, name: bytes, value: bytes) -> None:
        self.ex.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.ex
        ex.status = self.parser.get_status_code()
        if not ex.head.done():
            ex.head.set_result(ex.status)
        if ex.head_only:  # a HEAD's answer has no body, whatever its Content-Length says
            self.ex = None
            if not ex.done.done():
                ex.done.set_result(None)
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        ex = self.ex
        if ex is not None:
            ex.body.append(body)  # written once this read is parsed (data_received)

    def on_message_complete(self) -> None:
        ex, self.ex = self.ex, None
        if ex is None:
            return
        reusable = self.parser.should_keep_alive()
        if not ex.done.done():
            ex.done.set_result(None)
        if reusable:
            self.pool.release(self)
        else:
            self.transport.close()

    # the exchange
    def send(self, request: bytes, ex: Exchange) -> None:
        self.ex, self.last, ex.conn = ex, time.monotonic(), self
        self.sent, self.unanswered = self.sent + 1, request
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(request)

    def _broken(self, why: str) -> None:
        if self.ex is not None:
            ex, self.ex = self.ex, None
            ex.fail(UpstreamError("broken", why))
        self.transport.abort()


class Pool:
    """Idle kept-alive connections to one host:port, and a sweep that cuts off an
    exchange silent for longer than `read_timeout`."""

    def __init__(self, host: str, port: int, connect_timeout: float, read_timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.idle: list[Connection] = []
        self.busy: set[Connection] = set()
        self.closing_reason: dict[Connection, str] = {}
        self._sweeper: asyncio.Task | None = None
        self._retries: set[asyncio.Task] = set()
        self.closed = False  # stopping: nothing is sent again

    async def exchange(self, request: bytes, head_only: bool = False) -> Exchange:
        """Send `request` on an idle connection (or a new one); the Exchange to wait on."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        loop = asyncio.get_running_loop()
        while self.idle:
            conn = self.idle.pop()
            if not conn.transport.is_closing():
                break
        else:
            conn = await self._connect(loop)
        ex = Exchange(loop, head_only)
        self.busy.add(conn)
        conn.send(request, ex)
        return ex

    async def _connect(self, loop) -> Connection:
        tls = {"ssl": self.tls, "server_hostname": self.host} if self.tls else {}
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: Connection(self), self.host, self.port,
                                                                    **tls), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError("timeout", f"no connection within {self.connect_timeout:g} s (route.connect_timeout)"
                                ) from None
        except ssl.SSLCertVerificationError as e:
            raise UpstreamError("tls", f"its TLS certificate is not trusted ({e.verify_message}; a private CA goes "
                                       "in route.upstream_ca_file)") from None
        except ssl.SSLError as e:
            raise UpstreamError("tls", f"the TLS handshake failed ({e.reason or e}); is it serving https?") from None
        except OSError as e:
            raise UpstreamError("connect", f"{type(e).__name__}: {e.strerror or e}") from None
        return conn

    def retry(self, ex: Exchange, request: bytes) -> None:
        """Send `request` again, on a new connection: the kept-alive one it went out on
        closed before a byte of its answer came. That is the upstream's idle timeout
        crossing the request (vLLM closes a connection idle for 5 s), not an answer
        that broke, and the upstream never began it; a client got a 502 for it. Once
        only, and never for a connection's first request: an upstream that closes on
        every request is still a 502 that says so."""
        async def again() -> None:
            try:
                conn = await self._connect(asyncio.get_running_loop())
            except UpstreamError as e:
                ex.fail(e)
                return
            if ex.dropped:  # its client went away meanwhile
                self.release(conn)
                return
            self.busy.add(conn)
            conn.send(request, ex)  # its first request: lost again, it is the upstream's answer (a 502)

        task = asyncio.get_running_loop().create_task(again())
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    def release(self, conn: Connection) -> None:
        self.busy.discard(conn)
        self.idle.append(conn)

    def forget(self, conn: Connection) -> None:
        self.busy.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)

    def drop(self, ex: Exchange) -> None:
        """The caller is done with an exchange: if it is still in flight (its client
        went away), close its connection, so the upstream stops generating for nobody.
        Its writer goes too: a closure over the exchange, a reference cycle that left
        every streamed answer (its futures, a prompt trial's marker) to the collector,
        whose passes over hundreds of them at 200 streams stalled every stream at once."""
        ex.write, ex.dropped = None, True
        conn = ex.conn
        if conn is not None and conn.ex is ex:
            conn.ex = None
            conn.transport.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.read_timeout / 4))
            now = time.monotonic()
            for conn in list(self.busy):
                if conn.ex is not None and now - conn.last > self.read_timeout:
                    self.closing_reason[conn] = "timeout"
                    conn.transport.abort()

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in self.idle + list(self.busy):
            conn.transport.close()


def tls_context(ca_file: str = "") -> ssl.SSLContext:
    """Verification on, host name checked: Python's defaults for a client, with a
    private CA's file when one is given (OSError or ssl.SSLError when it cannot
    be read, for start-up to report)."""
    return ssl.create_default_context(cafile=ca_file or None)
