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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .choose import choose, sticky_key
from .config import RouteConfig
from .metrics import Metrics
from .table import RouteTable

log = logging.getLogger("nightshift.route")

ROUTE_HEADER = "X-Nightshift-Route"
FALLBACK_HEADER = "X-Nightshift-Route-Fallback"
_HOP = frozenset(("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                  "transfer-encoding", "upgrade", "host", "content-length"))
_SKIP_AUTO = frozenset(("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
_UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


class BodyTooLarge(Exception):
    pass


def error(status: int, etype: str, message: str, headers: dict | None = None) -> web.Response:
    """An error of the proxy's own, in the shape OpenAI clients and vLLM use."""
    body = {"error": {"message": message, "type": etype, "param": None, "code": status}}
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json",
                        headers=headers)


def _without_hop(headers) -> CIMultiDict:
    named = {h.strip().lower() for h in headers.get("Connection", "").split(",") if h.strip()}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP and k.lower() not in named)


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


class Proxy:
    def __init__(self, cfg: RouteConfig, table: RouteTable, metrics: Metrics) -> None:
        self.cfg, self.table, self.metrics = cfg, table, metrics
        self.base = cfg.upstream.rstrip("/")
        self.missing: dict[str, float] = {}  # versioned name -> monotonic time it may be tried again
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout,
                                        sock_connect=self.cfg.connect_timeout, sock_read=self.cfg.read_timeout)
        connector = aiohttp.TCPConnector(limit=self.cfg.max_connections, limit_per_host=0, ttl_dns_cache=300,
                                         keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=_SKIP_AUTO, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

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

    async def forward(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = time.perf_counter()
        self.metrics.inflight.inc()
        try:
            return await self._forward(request, t0)
        finally:
            self.metrics.inflight.dec()

    async def _forward(self, request: web.BaseRequest, t0: float) -> web.StreamResponse:
        try:
            body = await read_body(request, self.cfg.max_body_bytes)
        except BodyTooLarge:
            return error(413, "RequestEntityTooLarge", f"the request body is larger than {self.cfg.max_body_bytes} "
                         "bytes (route.max_body_bytes)")
        headers = _without_hop(request.headers)
        if self.cfg.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.cfg.upstream_api_key}"
        url = URL(self.base + request.raw_path, encoded=True)
        obj = None
        if request.method == "POST" and body[:1] in (b"{", b" ", b"\n", b"\r", b"\t"):
            try:
                obj = json.loads(body)
            except ValueError:
                pass  # not ours to judge: the upstream answers it
        model = obj.get("model") if isinstance(obj, dict) else None
        route = self.table.get(model) if isinstance(model, str) else None
        if route is None:
            return await self._send(request, url, headers, t0, body, None, "-", ["-"], [])
        kind, key = sticky_key(request.headers, obj)
        chosen, arm, x = choose(route, key)
        targets = [chosen] + ([route.serving] if chosen == route.candidate else [])
        targets += [] if model in targets else [model]
        self.metrics.decisions.labels(model, chosen, arm, kind).inc()
        skipped: list[str] = []
        while len(targets) > 1 and self.is_missing(targets[0]):
            skipped.append(targets.pop(0))
            self.metrics.fallbacks.labels(model, skipped[-1], targets[0]).inc()
        if self.cfg.log_decisions:
            where = "" if x < 0 else f", point {x:.3f} {'<' if arm == 'candidate' else '>='} share {route.share:g}"
            gone = f"; {', '.join(skipped)} missing on the upstream" if skipped else ""
            log.info("route %s -> %s (%s; %s key %s%s)%s", model, targets[0], arm, kind, key[:12], where, gone)
        return await self._send(request, url, headers, t0, body, obj, model, targets, skipped)

    async def _send(self, request: web.BaseRequest, url: URL, headers: CIMultiDict, t0: float, body: bytes,
                    obj: dict | None, name: str, targets: list[str], skipped: list[str]) -> web.StreamResponse:
        """To the first target; after a "does not exist" 404 with targets left, to the next."""
        waited = 0.0
        while True:
            version = targets[0]
            data = body if obj is None else json.dumps({**obj, "model": version}, separators=(",", ":")).encode()
            t = time.perf_counter()
            try:
                up = await self.session.request(request.method, url, data=data or None, headers=headers,
                                                allow_redirects=False)
            except asyncio.TimeoutError:
                return self._failed(name, version, 504, "timeout", f"the upstream {self.base} did not answer within "
                                    f"{self.cfg.connect_timeout:g} s to connect / {self.cfg.read_timeout:g} s to reply")
            except aiohttp.ClientError as e:
                return self._failed(name, version, 502, "connect", f"the upstream {self.base} is unreachable: "
                                    f"{type(e).__name__}: {e}")
            waited += time.perf_counter() - t
            if obj is None or len(targets) == 1 or up.status != 404:
                break
            try:
                answer = await up.read()
            except _UPSTREAM_BROKEN as e:
                up.close()
                return self._failed(name, version, 502, "broken", f"the upstream {self.base} broke its answer: {e!r}")
            if not _is_missing(up.status, answer):
                return self._buffered(up, answer, t0, waited, name, version, skipped)
            self.missing[version] = time.monotonic() + self.cfg.missing_ttl
            self.metrics.missing.set(len(self.missing))
            skipped.append(targets.pop(0))
            self.metrics.fallbacks.labels(name, version, targets[0]).inc()
            log.warning("route %s: the upstream %s does not have %s (404 \"does not exist\"); sent to %s instead, "
                        "and so for the next %g s", name, self.base, version, targets[0], self.cfg.missing_ttl)
        try:
            if up.content_length is not None and up.content_type != "text/event-stream":
                t = time.perf_counter()
                try:
                    answer = await up.read()
                except _UPSTREAM_BROKEN as e:
                    return self._failed(name, version, 502, "broken", f"the upstream {self.base} broke its answer: "
                                        f"{e!r}")
                return self._buffered(up, answer, t0, waited + time.perf_counter() - t, name, version, skipped)
            return await self._stream(request, up, t0, waited, name, version, skipped)
        finally:
            up.close()  # after release() (a complete answer) this does nothing; otherwise it drops the connection

    def _headers(self, up: aiohttp.ClientResponse, name: str, version: str, skipped: list[str]) -> CIMultiDict:
        out = _without_hop(up.headers)
        if name != "-":
            out[ROUTE_HEADER] = version
            if skipped:
                out[FALLBACK_HEADER] = ", ".join(skipped)
        return out

    def _done(self, name: str, version: str, status: int, t0: float, waited: float) -> None:
        self.metrics.requests.labels(name, version, str(status)).inc()
        self.metrics.overhead.observe(max(0.0, time.perf_counter() - t0 - waited))

    def _failed(self, name: str, version: str, status: int, kind: str, message: str) -> web.Response:
        self.metrics.upstream_errors.labels(kind).inc()
        self.metrics.requests.labels(name, version, str(status)).inc()
        log.warning("%s", message)
        return error(status, "BadGateway" if status == 502 else "GatewayTimeout", f"nightshift route: {message}")

    def _buffered(self, up, answer: bytes, t0: float, waited: float, name: str, version: str, skipped) -> web.Response:
        resp = web.Response(status=up.status, reason=up.reason, headers=self._headers(up, name, version, skipped),
                            body=answer)
        up.release()
        self._done(name, version, up.status, t0, waited)
        return resp

    async def _stream(self, request, up, t0: float, waited: float, name: str, version: str, skipped) -> web.StreamResponse:
        resp = web.StreamResponse(status=up.status, reason=up.reason, headers=self._headers(up, name, version, skipped))
        if up.content_length is not None:
            resp.content_length = up.content_length
        else:
            resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            self._done(name, version, up.status, t0, waited)
            while True:
                try:
                    chunk = await up.content.readany()
                except _UPSTREAM_BROKEN as e:
                    self._abort(request, name, version, e)
                    return resp
                if not chunk:
                    break
                await resp.write(chunk)
            await resp.write_eof()
        except ConnectionError:
            self.metrics.stream_aborts.labels("client").inc()
            log.info("route %s: the client went away inside a streamed answer from %s; upstream request closed",
                     name, version)
            return resp
        up.release()
        return resp

    def _abort(self, request: web.BaseRequest, name: str, version: str, e: BaseException) -> None:
        """The upstream broke inside a stream: cut the client off without an ending,
        so it sees an error and retries instead of taking a short answer as whole."""
        self.metrics.upstream_errors.labels("timeout" if isinstance(e, asyncio.TimeoutError) else "broken").inc()
        self.metrics.stream_aborts.labels("upstream").inc()
        log.warning("route %s: the upstream %s broke inside a streamed answer from %s (%s); the client's connection "
                    "is aborted so it sees an error", name, self.base, version, type(e).__name__)
        if request.transport is not None:
            request.transport.abort()
