"""OTLP/HTTP: POST /v1/traces, /v1/logs, /v1/metrics (protobuf or JSON, answered in
the request's content type), POST /v1/feedback (JSON labels, see `feedback`), plus
GET /healthz and GET /metrics."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

from google.protobuf import json_format

from . import decode, listen, otlp_json
from .errors import (BadRequest, NotFound, Overloaded, Refused, RequestTimeout, TooLarge, Unauthenticated,
                     UnsupportedMediaType, wire_status)
from .pipeline import Pipeline
from .responses import export_response, retry_after_header, status

log = logging.getLogger("nightshift.collector.http")

_DRAIN_BYTES = 16 << 20

PATHS = {"/v1/traces": "traces", "/v1/logs": "logs", "/v1/metrics": "metrics", "/v1/feedback": "feedback"}


def feedback_media_type(content_type: str | None) -> str:
    """Labels are JSON only: anything else is refused (415) before the body is read."""
    if (content_type or "").split(";", 1)[0].strip().lower() != decode.JSON:
        raise UnsupportedMediaType(f"unsupported Content-Type {content_type!r}: /v1/feedback takes {decode.JSON}")
    return decode.JSON


@dataclass
class Reply:
    code: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False  # the body was left unread (or the request was broken): hang up after answering


def make_post(pipeline: Pipeline, *, token: str, limit: int) -> Callable[..., Reply]:
    """`post(path, headers, read_body, client, skip_body) -> Reply`: everything a
    POST does but the socket. Headers are looked up in lower case. `read_body` is
    called only once the path, token, content type and the client's limits allow
    it, so a refused request never costs a request slot while it uploads. A client
    told to retry later (429, 503) has its body read and dropped by `skip_body`
    (which says whether it could), so it hears the answer on a connection it can
    keep instead of a reset mid-upload. Kept apart from the socket so the fuzzing
    campaigns drive exactly what the server runs."""
    expected = f"Bearer {token}".encode() if token else b""
    metrics = pipeline.metrics

    def post(path: str, headers: Mapping[str, str], read_body: Callable[[], bytes], client: str,
             skip_body: Callable[[], bool] = lambda: False) -> Reply:
        try:
            return answer(path, headers, read_body, client, skip_body)
        except Exception:  # a bug, even in building a refusal: 500 instead of a dropped connection
            log.exception("unexpected error handling %s", path)
            return Reply(500, b'{"code":13,"message":"internal error"}', decode.JSON, close=True)

    def answer(path: str, headers: Mapping[str, str], read_body: Callable[[], bytes], client: str,
               skip_body: Callable[[], bool]) -> Reply:
        t0 = time.perf_counter()
        signal = PATHS.get(path.split("?", 1)[0])
        media = decode.JSON
        body_read = False
        try:
            if signal is None:
                raise NotFound(f"no endpoint at {path}; use /v1/traces, /v1/logs, /v1/metrics or /v1/feedback")
            if expected and not hmac.compare_digest(headers.get("authorization", "").encode(), expected):
                raise Unauthenticated("missing or wrong bearer token (header `Authorization: Bearer <token>`)")
            ctype = headers.get("content-type")
            media = feedback_media_type(ctype) if signal == "feedback" else decode.media_type(ctype)
            with pipeline.admit(client, _content_length(headers), signal) as slot:
                body_read = True
                body = decode.decompress(read_body(), headers.get("content-encoding"), limit)
                slot.charge(len(body))
                if signal == "feedback":
                    result = pipeline.export_feedback(body)
                else:
                    result = pipeline.export(signal, decode.parse(signal, body, media))
            if signal == "feedback":
                return Reply(200, json.dumps({"accepted": result.accepted}).encode(), media)
            resp = export_response(signal, result)
            return Reply(200, resp.SerializeToString() if media == decode.PROTOBUF else otlp_json.encode(resp), media)
        except Refused as e:
            metrics.refused.labels(signal or "unknown", e.reason).inc()
            st = status(e)
            out = st.SerializeToString() if media == decode.PROTOBUF else json_format.MessageToJson(st, indent=None).encode()
            headers_out = {"Retry-After": retry_after_header(e)} if isinstance(e, Overloaded) else {}
            close = not body_read and not (isinstance(e, Overloaded) and skip_body())
            return Reply(wire_status(e).http, out, media, headers_out, close=close)
        finally:
            metrics.request_seconds.labels("http", signal or "unknown").observe(time.perf_counter() - t0)

    return post


def _content_length(headers: Mapping[str, str]) -> int:
    """The body's size as sent (before decompression), 0 when not given or not a
    number (reading the body deals with that)."""
    value = headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_handler(pipeline: Pipeline, *, token: str, limit: int, health: Callable[[], tuple[bool, dict]],
                 before_scrape: Callable[[], None] = lambda: None, request_timeout: float | None = 60.0):
    metrics = pipeline.metrics
    post = make_post(pipeline, token=token, limit=limit)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "nightshift"
        timeout = request_timeout  # per socket read: a stalled or idle client is let go, a slow one is not

        def log_message(self, fmt, *args):  # access logs at debug level only
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _discard(self, n: int) -> bool:
            """Reads and drops `n` body bytes (at most `limit` + 16 MiB): True if done."""
            if n < 0 or n > limit + _DRAIN_BYTES:
                return False
            while n > 0:
                got = self.rfile.read(min(n, 1 << 20))
                if not got:
                    return False
                n -= len(got)
            return True

        def _skip_body(self) -> bool:
            try:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    return False  # rare from exporters: hang up rather than parse a body we refuse
                return self._discard(int(self.headers.get("Content-Length", "0")))
            except (ValueError, OSError):
                return False

        def _read_body(self) -> bytes:
            try:
                return self._read_body_or_stall()
            except TimeoutError:
                self.close_connection = True
                raise RequestTimeout(f"the request body stalled for over {request_timeout:.0f} s") from None

        def _read_body_or_stall(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    line = self.rfile.readline(1024)
                    try:
                        n = int(line.split(b";")[0].strip(), 16)
                    except ValueError:
                        self.close_connection = True
                        raise BadRequest("malformed chunked body") from None
                    if n < 0:
                        self.close_connection = True
                        raise BadRequest("malformed chunked body")
                    if n == 0:
                        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    if len(out) + n > limit:
                        self.close_connection = True
                        raise TooLarge(f"request body is over the {limit}-byte limit")
                    chunk = self.rfile.read(n)
                    if len(chunk) < n:
                        self.close_connection = True
                        raise BadRequest("request body ended early")
                    out += chunk
                    self.rfile.readline(16)
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                self.close_connection = True
                raise BadRequest("invalid Content-Length") from None
            if length < 0:
                self.close_connection = True
                raise BadRequest("invalid Content-Length")
            if length > limit:
                # Read and discard a moderately oversized body so the client sees
                # the 413 instead of a reset; past that, answer and hang up.
                self.close_connection = not self._discard(length)
                raise TooLarge(f"request body is {length} bytes, over the {limit}-byte limit")
            body = self.rfile.read(length)
            if len(body) < length:
                self.close_connection = True
                raise BadRequest("request body ended early")
            return body

        def do_POST(self) -> None:  # noqa: N802
            headers = {k.lower(): v for k, v in self.headers.items()}
            r = post(self.path, headers, self._read_body, self.client_address[0], self._skip_body)
            if r.close:
                self.close_connection = True
            self._send(r.code, r.body, r.content_type, r.headers)

        def do_GET(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            if path in ("/healthz", "/health", "/readyz"):
                ok, info = health()
                self._send(200 if ok else 503, json.dumps(info).encode(), "application/json")
            elif path == "/metrics":
                before_scrape()  # gauges read from the WAL folder and the flusher's counters
                self._send(200, metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
            else:
                self._send(404, b'{"message":"not found"}', "application/json")

    return Handler


def bind(address: str, pipeline: Pipeline, *, token: str, limit: int, tls: ssl.SSLContext | None,
         health: Callable[[], tuple[bool, dict]], before_scrape: Callable[[], None] = lambda: None,
         request_timeout: float | None = 60.0) -> tuple[_Server, int]:
    """The server bound to `address` but not yet answering (`serve`), so that a
    collector that cannot listen stops before it starts anything else;
    CannotListen says why."""
    host, port = listen.host_port(address)
    handler = make_handler(pipeline, token=token, limit=limit, health=health, before_scrape=before_scrape,
                           request_timeout=request_timeout)
    try:
        server = (_Server6 if ":" in host else _Server)((host, port), handler)
    except OSError as e:
        raise listen.CannotListen(address, listen.why(address, e)) from None
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    return server, server.server_address[1]


def serve(server: _Server) -> None:
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True).start()
