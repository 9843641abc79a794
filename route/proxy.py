"""The request path: one request in, the same request out to the upstream with
only its body's `model` rewritten when it asks for a stable name in the table,
and the upstream's answer back as it came.

- Non-streamed answers (with a Content-Length) are read whole, then sent: a
  connection that breaks inside one becomes a 502 the client retries.
- Streamed answers (SSE, or chunked) go out chunk by chunk as they arrive. If the
  upstream's connection breaks or falls silent inside one, the client's connection
  is aborted: no closing chunk, no `data: [DONE]`, so an OpenAI client raises
  instead of returning a short answer as whole. A client that goes away closes its
  upstream request, so vLLM stops generating for nobody.
- A version the upstream answers 404 "does not exist" for is remembered as missing
  for `missing_ttl`; its requests go to the route's serving version (or, missing
  too, the stable name itself), with a warning, a metric and the response header
  `X-Nightshift-Route-Fallback`.

What may pass at all is decided before any of this: the path (`paths.py`, an
allow-list of the inference API), the headers (`headers.py`) and the body's one
rewrite (`rewrite.py`). A request refused there never reaches the upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import urlsplit

from aiohttp import web
from multidict import CIMultiDict

from .choose import choose, sticky_key
from .config import RouteConfig
from .gcidle import IdleCollector
from .headers import HeaderError, to_client, to_upstream
from .mark import StreamMarker, mark_body, tag
from .metrics import Metrics
from .paths import Target, judge
from .prompt import Ambiguous, Match, PromptRouter
from .rewrite import Body, RewriteError, edited, read
from .table import RouteTable
from .upstream import Exchange, Pool, UpstreamError, tls_context

log = logging.getLogger("nightshift.route")

ROUTE_HEADER = "X-Nightshift-Route"
PROMPT_HEADER = "X-Nightshift-Route-Prompt"  # the prompt version the model saw, when the route put a candidate in
FALLBACK_HEADER = "X-Nightshift-Route-Fallback"
HIGH_WATER = 1 << 20  # bytes waiting for a slow client before the upstream is paused


class BodyTooLarge(Exception):
    pass


def error(status: int, etype: str, message: str, headers: dict | None = None) -> web.Response:
    """An error of the proxy's own, in the shape OpenAI clients and vLLM use."""
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json",
                        headers=headers)


def _is_missing(status: int, body: bytes) -> bool:
    """vLLM's answer for a model or adapter it does not serve: 404 NotFoundError,
    "The model `x` does not exist." (older versions: the same without the
    `error` envelope)."""
    return status == 404 and (b"does not exist" in body or b"NotFoundError" in body)


async def read_body(request: web.BaseRequest, limit: int) -> bytes:
    n = request.content_length
    if n is not None:
        if n > limit:
            raise BodyTooLarge
        return await request.content.readexactly(n) if n else b""
    parts, size = [], 0
    async for part in request.content.iter_any():
        size += len(part)
        if size > limit:
            raise BodyTooLarge
        parts.append(part)
    return b"".join(parts)


def held_head(resp: web.StreamResponse) -> bytes:
    """The head of a prepared response that aiohttp still holds, taken (b"" once sent).

    A response that opts out of sending its head at once (`_send_headers_immediately`,
    as aiohttp's own `Response` does) has it held until its first body write; the
    proxy writes a stream's pieces to the socket itself, from the upstream's callback,
    so it takes the head and sends it with the first event in one send. Apart, it was
    one send in every ~22 of a streamed answer (and a wake-up of the client) for
    bytes no OpenAI client acts on before the first event. An aiohttp that sends the
    head in `prepare` regardless holds nothing: b"". A head never taken (an answer
    with no body piece) goes out with the end, as aiohttp sends it."""
    w = resp._payload_writer
    if w is None or getattr(w, "_headers_written", True) or not getattr(w, "_headers_buf", None):
        return b""
    head, w._headers_buf, w._headers_written = w._headers_buf, None, True
    return head


class Proxy:
    def __init__(self, cfg: RouteConfig, table: RouteTable, metrics: Metrics) -> None:
        self.cfg, self.table, self.metrics = cfg, table, metrics
        self.base = cfg.upstream.rstrip("/")
        u = urlsplit(self.base)
        self.host_header = u.netloc.encode()
        tls = tls_context(cfg.upstream_ca_file) if u.scheme == "https" else None
        self.pool = Pool(u.hostname or "127.0.0.1", u.port or (443 if tls else 80), cfg.connect_timeout,
                         cfg.read_timeout, tls)
        self.missing: dict[str, float] = {}  # versioned name -> monotonic time it may be tried again
        self.prompts = PromptRouter()
        # started by `serve`: the collector's passes where they stall no stream (gcidle.py)
        self.gc = IdleCollector(lambda why: metrics.gc_passes.labels(why).inc())

    async def close(self) -> None:
        await self.pool.close()

    # --- missing versions -------------------------------------------------------------

    def is_missing(self, version: str) -> bool:
        until = self.missing.get(version)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self.missing[version]
        self.metrics.missing.set(len(self.missing))
        return False

    def forget_missing(self, *versions: str | None) -> None:
        for v in versions:
            self.missing.pop(v or "", None)
        self.metrics.missing.set(len(self.missing))

    def missing_now(self) -> dict[str, float]:
        now = time.monotonic()
        return {v: round(t - now, 1) for v, t in sorted(self.missing.items()) if t > now}

    # --- the request path -------------------------------------------------------------

    def _refuse(self, status: int, etype: str, message: str, headers: dict | None = None) -> web.Response:
        """A request the upstream never hears of: counted, and answered with why."""
        self.metrics.refused.labels(str(status)).inc()
        return error(status, etype, f"nightshift route: {message}", headers)

    async def forward(self, request: web.BaseRequest, target: Target) -> web.StreamResponse:
        verdict = judge(request.method, target.path)
        if verdict.status:
            etype = {403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowed"}[verdict.status]
            return self._refuse(verdict.status, etype, verdict.message, {"Allow": verdict.allow} if verdict.allow
                                else None)
        t0 = time.perf_counter()
        self.metrics.inflight.inc()
        self.gc.begin()
        try:
            return await self._forward(request, target, t0)
        finally:
            self.metrics.inflight.dec()
            self.gc.end()

    def _head(self, request: web.BaseRequest, target: Target) -> bytes:
        """The request line and headers for the upstream, less Content-Length."""
        lines = [b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (request.method.encode(), target.upstream(), self.host_header)]
        lines += [k + b": " + v + b"\r\n" for k, v in to_upstream(request.raw_headers, self.cfg.upstream_api_key)]
        return b"".join(lines)

    async def _forward(self, request: web.BaseRequest, target: Target, t0: float) -> web.StreamResponse:
        try:
            head = self._head(request, target)
        except HeaderError as e:
            return self._refuse(400, "BadRequestError", str(e))
        try:
            body = await read_body(request, self.cfg.max_body_bytes)
        except BodyTooLarge:
            return self._refuse(413, "RequestEntityTooLarge", f"the request body is larger than "
                                f"{self.cfg.max_body_bytes} bytes (route.max_body_bytes)")
        plan = self._plan(request, body)
        if isinstance(plan, web.Response):
            return plan
        return await self._send(request, head, t0, body, *plan)

    def _plan(self, request: web.BaseRequest, body: bytes) -> web.Response | tuple:
        """What to send where: (model span, route name, targets, skipped, edits, mark),
        or the refusal. Apart from `_forward` so that the parsed body (two dozen dicts
        and lists) is freed here, not kept for the whole answer: at 200 streams the
        collector's young passes walked every one of them, a third of what they walked."""
        try:
            parsed = read(body) if request.method == "POST" else None
        except RecursionError:
            return self._refuse(400, "BadRequestError", "the JSON body nests too deeply to be read")
        model = parsed.obj.get("model") if parsed is not None else None
        route = self.table.get(model) if isinstance(model, str) else None
        prompt = self.prompts.find(parsed, self.table.prompts) if parsed is not None and self.table.prompts else None
        if route is None and prompt is None:
            return None, "-", ["-"], [], None, None
        span = None
        if route is not None:
            try:
                span = parsed.model_span()
            except RewriteError as e:
                return self._refuse(400, "BadRequestError", str(e))
        kind, key = sticky_key(request.headers, parsed.obj)
        edits, mark = self._prompt(prompt, parsed, kind, key) if prompt is not None else ([], None)
        if route is None:
            return None, "-", ["-"], [], edits, mark
        chosen, arm, x = choose(route, key)
        targets = [chosen] + ([route.serving] if chosen == route.candidate else [])
        targets += [] if model in targets else [model]
        self.metrics.decision(model, chosen, arm, kind).inc()
        skipped: list[str] = []
        while len(targets) > 1 and self.is_missing(targets[0]):
            skipped.append(targets.pop(0))
            self.metrics.fallbacks.labels(model, skipped[-1], targets[0]).inc()
        if self.cfg.log_decisions and log.isEnabledFor(logging.DEBUG):  # counted in nightshift_route_decisions
            where = "" if x < 0 else f", point {x:.3f} {'<' if arm == 'candidate' else '>='} share {route.share:g}"
            gone = f"; {', '.join(skipped)} missing on the upstream" if skipped else ""
            log.debug("route %s -> %s (%s; %s key %s%s)%s", model, targets[0], arm, kind, key[:12], where, gone)
        return span, model, targets, skipped, edits, mark

    def _prompt(self, m: Match, parsed: Body, kind: str, key: str) -> tuple[list[tuple[int, int, bytes]], bytes | None]:
        """The edits that put a prompt route's candidate in this request, and the mark
        its answer gets; none when the conversation stays on the agent's own prompt or
        the prompt cannot be replaced without guessing."""
        r = m.route
        _, arm, x = choose(r, key)
        self.metrics.prompt_decision(m.name, arm, kind).inc()
        if arm == "candidate":
            try:
                edits = self.prompts.edits(m, parsed)
            except Ambiguous as e:
                self.metrics.prompt_skipped.labels(m.name, str(e)).inc()
                self.prompts.skip(m, str(e))
                return [], None
            vid = self.prompts.version(r, parsed)
            self.prompts.seen[r.serving].rewritten += 1
        # at DEBUG, as the model route's: a line per request was 12-25 us of the prompt arm's ~70 (formatted,
        # written); nightshift_route_prompt_decisions counts them by arm, and a route change is logged at INFO
        if self.cfg.log_decisions and log.isEnabledFor(logging.DEBUG):
            log.debug("prompt route %s%s -> %s (%s; %s key %s, point %.3f %s share %g)", m.name,
                      f" (agent {r.agent})" if r.agent else "", vid if arm == "candidate" else "the agent's own prompt",
                      arm, kind, key[:12], x, "<" if arm == "candidate" else ">=", r.share)
        return (edits, tag(vid)) if arm == "candidate" else ([], None)

    async def _send(self, request: web.BaseRequest, head: bytes, t0: float, body: bytes,
                    span: tuple[int, int] | None, name: str, targets: list[str],
                    skipped: list[str], edits: list | None = None, mark: bytes | None = None) -> web.StreamResponse:
        """To the first target; after a "does not exist" 404 with targets left, to the next."""
        waited, ex = 0.0, None
        try:
            while True:
                version = targets[0]
                changes = list(edits or []) + ([(*span, json.dumps(version).encode())] if span is not None else [])
                data = edited(body, changes) if changes else body
                length = b"Content-Length: %d\r\n" % len(data) if data or request.method not in ("GET", "HEAD") else b""
                t = time.perf_counter()
                try:
                    ex = await self.pool.exchange(head + length + b"\r\n" + data, head_only=request.method == "HEAD")
                    status = await ex.head
                    if span is not None and len(targets) > 1 and status == 404:
                        await ex.done
                except UpstreamError as e:
                    return self._failed(name, version, e)
                finally:
                    waited += time.perf_counter() - t
                if span is None or len(targets) == 1 or status != 404:
                    break
                answer = b"".join(ex.body)
                if not _is_missing(status, answer):
                    return self._buffered(ex, answer, t0, waited, name, version, skipped, mark)
                self.missing[version] = time.monotonic() + self.cfg.missing_ttl
                self.metrics.missing.set(len(self.missing))
                skipped.append(targets.pop(0))
                self.metrics.fallbacks.labels(name, version, targets[0]).inc()
                log.warning("route %s: the upstream %s does not have %s (404 \"does not exist\"); sent to %s "
                            "instead, and so for the next %g s", name, self.base, version, targets[0],
                            self.cfg.missing_ttl)
            if mark is not None and not 200 <= ex.status < 300:
                mark = None  # an error's body is the upstream's, as it came
            if not self._whole(ex) and (mark is None or self._sse(ex)):
                return await self._stream(request, ex, t0, waited, name, version, skipped, mark)
            t = time.perf_counter()
            try:
                await ex.done
            except UpstreamError as e:
                return self._failed(name, version, e)
            return self._buffered(ex, b"".join(ex.body), t0, waited + time.perf_counter() - t, name, version, skipped,
                                  mark)
        finally:
            if ex is not None:  # still in flight only when the client went away (a cancelled await
                self.pool.drop(ex)  # cancels ex.done too): the upstream stops generating for nobody

    @staticmethod
    def _whole(ex: Exchange) -> bool:
        """Read whole before answering: a body of known length that is not an event
        stream (an answer, an error), or none at all."""
        if ex.done.done():
            return True
        length = sse = False
        for k, v in ex.headers:
            k = k.lower()
            length = length or k == b"content-length"
            sse = sse or (k == b"content-type" and v.lstrip().lower().startswith(b"text/event-stream"))
        return length and not sse

    @staticmethod
    def _sse(ex: Exchange) -> bool:
        return any(k.lower() == b"content-type" and v.lstrip().lower().startswith(b"text/event-stream")
                   for k, v in ex.headers)

    def _headers(self, ex: Exchange, name: str, version: str, skipped: list[str],
                 mark: bytes | None = None) -> CIMultiDict:
        out = to_client(ex.headers)
        if name != "-":
            out[ROUTE_HEADER] = version
            if skipped:
                out[FALLBACK_HEADER] = ", ".join(skipped)
        if mark is not None:
            out[PROMPT_HEADER] = mark[3:].decode()
        return out

    def _done(self, name: str, version: str, status: int, t0: float, waited: float) -> None:
        self.metrics.request(name, version, str(status)).inc()
        self.metrics.overhead.observe(max(0.0, time.perf_counter() - t0 - waited))

    def _failed(self, name: str, version: str, e: UpstreamError) -> web.Response:
        # its traceback is never logged, and kept it holds the caller's frame (the request's body, up to
        # max_body_bytes) in a cycle with the exchange's futures until the next collector pass (gcidle.py)
        e.__traceback__ = None
        status = 504 if e.kind == "timeout" else 502
        self.metrics.upstream_errors.labels(e.kind).inc()
        self.metrics.request(name, version, str(status)).inc()
        where = {"connect": "is unreachable", "tls": "cannot be reached safely", "timeout": "did not answer in time",
                 "broken": "broke its answer"}[e.kind]
        message = f"the upstream {self.base} {where}: {e}"
        log.warning("route %s: %s", name, message)
        return error(status, "BadGateway" if status == 502 else "GatewayTimeout", f"nightshift route: {message}")

    def _buffered(self, ex: Exchange, answer: bytes, t0: float, waited: float, name: str, version: str,
                  skipped, mark: bytes | None = None) -> web.Response:
        if mark is not None:
            if self._sse(ex):  # a short stream, all in before the head was answered
                marker = StreamMarker(mark)
                answer = marker.feed(answer) + marker.flush()
                marked = answer if marker.marked else None
            else:
                marked = mark_body(answer, mark)
            if marked is None:
                self.metrics.prompt_unmarked.inc()
            answer = marked or answer
        resp = web.Response(status=ex.status, headers=self._headers(ex, name, version, skipped, mark), body=answer)
        self._done(name, version, ex.status, t0, waited)
        return resp

    async def _stream(self, request, ex: Exchange, t0: float, waited: float, name: str, version: str,
                      skipped, mark: bytes | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(status=ex.status, headers=self._headers(ex, name, version, skipped, mark))
        resp.enable_chunked_encoding()
        resp._send_headers_immediately = False  # the head held for the first piece (or the end): one send, not two
        try:
            await resp.prepare(request)
        except ConnectionError:
            return self._client_gone(resp, name, version)
        self._done(name, version, ex.status, t0, waited)
        out, loop = request.transport, asyncio.get_running_loop()
        if out is None:
            return self._client_gone(resp, name, version)

        marker = StreamMarker(mark) if mark is not None else None

        head = True  # still held by aiohttp: it goes out with the first piece

        def write(piece: bytes) -> None:  # called from the upstream socket's callback, per read as it arrives
            nonlocal head
            if out.is_closing():
                return
            if marker is not None and not (piece := marker.feed(piece)):
                return
            if head:
                head = False
                out.write(b"%s%x\r\n%s\r\n" % (held_head(resp), len(piece), piece))
            else:
                out.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            if out.get_write_buffer_size() > HIGH_WATER and not ex.conn.paused:
                ex.conn.paused = True
                ex.conn.transport.pause_reading()
                loop.create_task(self._resume_when_drained(out, ex))

        ex.pipe(write)
        try:
            await ex.done
        except UpstreamError as e:
            self._abort(request, name, version, e)
            return resp
        except asyncio.CancelledError:  # the client hung up (aiohttp cancels its handler)
            self._client_gone(resp, name, version)
            raise
        if out.is_closing():
            return self._client_gone(resp, name, version)
        last = ex.tail()  # the read that ended the answer: sent with the end, in one write
        if marker is not None:
            last = marker.feed(last) + marker.flush() if last else marker.flush()
            if not marker.marked:
                self.metrics.prompt_unmarked.inc()
        try:
            await resp.write_eof(last)
        except ConnectionError:
            return self._client_gone(resp, name, version)
        return resp

    @staticmethod
    async def _resume_when_drained(out, ex: Exchange) -> None:
        while out.get_write_buffer_size() > HIGH_WATER // 4 and not out.is_closing():
            await asyncio.sleep(0.01)
        ex.conn.paused = False
        if not ex.conn.transport.is_closing():
            ex.conn.transport.resume_reading()

    def _client_gone(self, resp: web.StreamResponse, name: str, version: str) -> web.StreamResponse:
        self.metrics.stream_aborts.labels("client").inc()
        log.info("route %s: the client went away inside a streamed answer from %s; upstream request closed",
                 name, version)
        return resp

    def _abort(self, request: web.BaseRequest, name: str, version: str, e: UpstreamError) -> None:
        """The upstream broke inside a stream: cut the client off without an ending,
        so it sees an error and retries instead of taking a short answer as whole."""
        e.__traceback__ = None  # as in _failed: no cycle through the stream's frame
        self.metrics.upstream_errors.labels(e.kind).inc()
        self.metrics.stream_aborts.labels("upstream").inc()
        log.warning("route %s: the upstream %s broke inside a streamed answer from %s (%s); the client's connection "
                    "is aborted so it sees an error", name, self.base, version, e)
        if request.transport is not None:
            request.transport.abort()
