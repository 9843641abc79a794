"""OTLP/HTTP: POST /v1/traces, /v1/logs, /v1/metrics (protobuf or JSON, answered in
the request's content type), POST /v1/feedback (JSON labels, see `feedback`), plus
GET /healthz and GET /metrics."""

from __future__ import annotations

import hmac
import json
import logging
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from google.protobuf import json_format

from . import decode, otlp_json
from .errors import (BadRequest, NotFound, Overloaded, Refused, TooLarge, Unauthenticated, UnsupportedMediaType,
                     wire_status)
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def make_handler(pipeline: Pipeline, *, token: str, limit: int, health: Callable[[], tuple[bool, dict]],
                 before_scrape: Callable[[], None] = lambda: None):
    expected = f"Bearer {token}".encode() if token else b""
    metrics = pipeline.metrics

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "nightshift"

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

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = bytearray()
                while True:
                    line = self.rfile.readline(1024)
                    try:
                        n = int(line.split(b";")[0].strip(), 16)
                    except ValueError:
                        self.close_connection = True
                        raise BadRequest("malformed chunked body") from None
                    if n == 0:
                        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                            pass
                        return bytes(out)
                    if len(out) + n > limit:
                        self.close_connection = True
                        raise TooLarge(f"request body is over the {limit}-byte limit")
                    out += self.rfile.read(n)
                    self.rfile.readline(16)
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                self.close_connection = True
                raise BadRequest("invalid Content-Length") from None
            if length > limit:
                # Read and discard a moderately oversized body so the client sees
                # the 413 instead of a reset; past that, answer and hang up.
                if length <= limit + _DRAIN_BYTES:
                    left = length
                    while left > 0:
                        got = self.rfile.read(min(left, 1 << 20))
                        if not got:
                            break
                        left -= len(got)
                    self.close_connection = left > 0
                else:
                    self.close_connection = True
                raise TooLarge(f"request body is {length} bytes, over the {limit}-byte limit")
            body = self.rfile.read(length)
            if len(body) < length:
                self.close_connection = True
                raise BadRequest("request body ended early")
            return body

        def do_POST(self) -> None:  # noqa: N802
            t0 = time.perf_counter()
            signal = PATHS.get(self.path.split("?", 1)[0])
            media = decode.JSON
            try:
                if signal is None:
                    self.close_connection = True
                    raise NotFound(f"no endpoint at {self.path}; use /v1/traces, /v1/logs, /v1/metrics or /v1/feedback")
                if expected and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                    self.close_connection = True
                    raise Unauthenticated("missing or wrong bearer token (header `Authorization: Bearer <token>`)")
                try:
                    ctype = self.headers.get("Content-Type")
                    media = feedback_media_type(ctype) if signal == "feedback" else decode.media_type(ctype)
                except Refused:
                    self.close_connection = True
                    raise
                body = self._read_body()
                with pipeline.admit():
                    body = decode.decompress(body, self.headers.get("Content-Encoding"), limit)
                    if signal == "feedback":
                        result = pipeline.export_feedback(body)
                    else:
                        result = pipeline.export(signal, decode.parse(signal, body, media))
                if signal == "feedback":
                    out = json.dumps({"accepted": result.accepted}).encode()
                else:
                    resp = export_response(signal, result)
                    out = resp.SerializeToString() if media == decode.PROTOBUF else otlp_json.encode(resp)
                self._send(200, out, media)
            except Refused as e:
                metrics.refused.labels(signal or "unknown", e.reason).inc()
                st = status(e)
                out = st.SerializeToString() if media == decode.PROTOBUF else json_format.MessageToJson(st, indent=None).encode()
                headers = {"Retry-After": retry_after_header(e)} if isinstance(e, Overloaded) else {}
                self._send(wire_status(e).http, out, media, headers)
            except Exception:  # a bug: answer 500 instead of dropping the connection
                log.exception("unexpected error handling %s", self.path)
                self.close_connection = True
                self._send(500, b'{"code":13,"message":"internal error"}', decode.JSON)
            finally:
                metrics.request_seconds.labels("http", signal or "unknown").observe(time.perf_counter() - t0)

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


def start(address: str, pipeline: Pipeline, *, token: str, limit: int, tls: ssl.SSLContext | None,
          health: Callable[[], tuple[bool, dict]], before_scrape: Callable[[], None] = lambda: None) -> tuple[_Server, int]:
    host, _, port = address.rpartition(":")
    server = _Server((host.strip("[]"), int(port)), make_handler(pipeline, token=token, limit=limit, health=health, before_scrape=before_scrape))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True)
    t.start()
    return server, server.server_address[1]
