"""Sustained load for the fault campaigns: sender threads that behave like OTLP
exporters (a request of unique spans, resent as is after a retryable answer or a
dropped connection, the way the SDKs retry) and remember exactly which spans
were acknowledged."""

from __future__ import annotations

import http.client
import os
import threading
import time
from collections import Counter

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

TRACE_SERVICE = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def make_request(n: int, content: str, service: str = "load") -> tuple[bytes, list[tuple[str, str]]]:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=service)))
    ss = rs.scope_spans.add()
    ids = []
    t = time.time_ns()
    for i in range(n):
        s = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name="chat", kind=3,
                 start_time_unix_nano=t + i, end_time_unix_nano=t + i + 1000)
        s.attributes.append(KeyValue(key="gen_ai.operation.name", value=AnyValue(string_value="chat")))
        s.attributes.append(KeyValue(key="content", value=AnyValue(string_value=content)))
        ss.spans.append(s)
        ids.append((s.trace_id.hex(), s.span_id.hex()))
    return req.SerializeToString(), ids


class Load:
    """`senders` threads, alternating HTTP and gRPC, until `stop()`."""

    def __init__(self, http_port: int, grpc_port: int, senders: int = 4, spans: int = 20, content: str = "y" * 500,
                 max_attempts: int = 50, source: str = "127.0.0.1", grpc_share: bool = True, pace_s: float = 0.0,
                 upload_s: float = 0.0):
        self.http_port, self.grpc_port = http_port, grpc_port
        self.senders, self.spans, self.content = senders, spans, content
        self.max_attempts = max_attempts
        self.source = source
        self.grpc_share = grpc_share
        self.pace_s = pace_s  # pause between requests, per sender: a steady rate instead of flat out
        self.upload_s = upload_s  # HTTP bodies trickled out over this long (an agent on a slow link)
        self.acked: list[tuple[str, str]] = []
        self.given_up: list[tuple[str, str]] = []
        self.answers: Counter = Counter()
        self.retry_after_missing = 0
        self.latencies: list[float] = []
        self.timeline: list[tuple[float, str]] = []  # (time, answer) of every attempt
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self) -> "Load":
        for i in range(self.senders):
            use_grpc = self.grpc_share and i % 2 == 1
            t = threading.Thread(target=self._run, args=(use_grpc,), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def first_after(self, t: float, answers: tuple[str, ...] = ("200", "OK")) -> float | None:
        """When the first of `answers` came after time `t`, or None."""
        with self._lock:
            return next((ts for ts, a in self.timeline if ts >= t and a in answers), None)

    def _http(self, conn_box: list, body: bytes) -> tuple[str, bool]:
        conn = conn_box[0]
        if conn is None:
            conn = conn_box[0] = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=15,
                                                            source_address=(self.source, 0))
        headers = {"Content-Type": "application/x-protobuf"}
        payload: bytes | object = body
        if self.upload_s:
            headers["Content-Length"] = str(len(body))
            payload = self._trickle(body)
        try:
            conn.request("POST", "/v1/traces", body=payload, headers=headers)
            r = conn.getresponse()
            r.read()
            if r.status in (429, 503) and not r.getheader("retry-after"):
                with self._lock:
                    self.retry_after_missing += 1
            if r.getheader("connection", "").lower() == "close":
                conn.close()
                conn_box[0] = None
            return str(r.status), r.status == 200
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            conn_box[0] = None
            return type(e).__name__, False

    def _trickle(self, body: bytes):
        step = max(1, len(body) // 10)
        for i in range(0, len(body), step):
            yield body[i:i + step]
            time.sleep(self.upload_s / 10)

    def _grpc(self, box: list, body: bytes) -> tuple[str, bool]:
        if box[0] is None:
            ch = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}", options=[
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)])
            box[0] = (ch, ch.unary_unary(TRACE_SERVICE))
        ch, call = box[0]
        try:
            call(body, timeout=15)
            return "OK", True
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                md = dict(e.trailing_metadata() or ())
                # the collector's own answers carry a status detail; a dead connection does not
                if "grpc-status-details-bin" in md and "google.rpc.retryinfo-bin" not in md:
                    with self._lock:
                        self.retry_after_missing += 1
            if code == grpc.StatusCode.UNAVAILABLE:
                ch.close()
                box[0] = None
            return code.name, False

    def _run(self, use_grpc: bool) -> None:
        box: list = [None]
        while not self._stop.is_set():
            body, ids = make_request(self.spans, self.content)
            for _attempt in range(self.max_attempts):  # the same bytes again, as exporters resend
                t0 = time.perf_counter()
                answer, ok = (self._grpc if use_grpc else self._http)(box, body)
                with self._lock:
                    self.answers[("grpc:" if use_grpc else "http:") + answer] += 1
                    self.timeline.append((time.time(), answer))
                    if ok:
                        self.acked.extend(ids)
                        self.latencies.append(time.perf_counter() - t0)
                if ok:
                    break
                if self._stop.is_set():
                    with self._lock:
                        self.given_up.extend(ids)
                    return
                time.sleep(0.05)
            else:
                with self._lock:
                    self.given_up.extend(ids)
            if self.pace_s:
                self._stop.wait(self.pace_s)
