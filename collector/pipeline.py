"""The consumer behind both transports: validate, redact, make durable, answer.

Transport code hands it a parsed request and gets back how many records were
rejected (partial success), or an exception from `errors` to map to the wire.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from . import feedback, validate, wal
from .decode import Parsed
from .errors import BadRequest, Overloaded
from .fairness import ClientLimits
from .metrics import Metrics
from .redact import Redactor


@dataclass
class Result:
    accepted: int
    rejected: int = 0
    message: str = ""


class Pipeline:
    def __init__(self, log: wal.WriteAheadLog, redactor: Redactor, metrics: Metrics, max_inflight: int,
                 limits: ClientLimits | None = None, max_inflight_bytes: int = 0):
        self.log = log
        self.redactor = redactor
        self.metrics = metrics
        self.limits = limits or ClientLimits(0)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self.max_inflight_bytes = max_inflight_bytes  # 0: only max_inflight bounds them
        self._bytes = 0  # request bytes admitted and not yet answered
        self._bytes_lock = threading.Lock()

    def admit(self, client: str = "", nbytes: int = 0, signal: str = "") -> "_Slot":
        """A context manager holding one of the client's slots and one of the
        collector's, or Throttled / Overloaded at once. A log at its cap refuses
        first (`WriteAheadLog.check_room`: nobody's request could be kept, so none
        is read). Then the client's own limit, so a noisy client is turned away
        before it can take one of the shared slots. `nbytes` is the request's size
        as far as it is known before it is read (HTTP's Content-Length). Metric
        points are counted, never logged: a full log is no reason to refuse them."""
        if signal != "metrics":
            self.log.check_room()
        self.limits.acquire(client)
        if not self._slots.acquire(blocking=False):
            self.limits.release(client)
            raise Overloaded("too many requests in flight", retry_after=1.0)
        try:
            self._reserve(nbytes)
        except Overloaded:
            self._slots.release()
            self.limits.release(client)
            raise
        return _Slot(self, client, nbytes)

    def _reserve(self, nbytes: int) -> None:
        """Counts a request's bytes in flight, or refuses it past
        `max_inflight_bytes`. The receiver's memory is its requests in flight (the
        bytes, then their parsed messages, 1-2x as large), so a count of requests
        alone let it grow with their sizes and the number of clients: measured on
        5 KB spans, 4 senders of 2.4 MiB requests took the receiver from 31 to 65
        MiB, 16 senders to 151. One request is always let in when none is, whatever
        its size (up to max_request_bytes)."""
        with self._bytes_lock:
            budget = self.max_inflight_bytes
            if budget and self._bytes and self._bytes + max(nbytes, 1) > budget:
                raise Overloaded(f"{self._bytes} bytes of requests in flight, at the {budget}-byte budget "
                                 "(collector.max_inflight_bytes)", retry_after=1.0)
            self._bytes += nbytes

    def _resize(self, old: int, new: int) -> None:
        with self._bytes_lock:
            self._bytes += new - old

    def export(self, signal: str, parsed: Parsed) -> Result:
        msg = parsed.message
        if signal == "metrics":
            n = validate.count_metric_points(msg)
            self.metrics.accepted.labels("metrics").inc(n)
            return Result(n)
        if signal == "traces":
            kept, rejected, error = validate.filter_traces(msg)
        else:
            kept, rejected, error = validate.filter_logs(msg)
        rejected += parsed.rejected
        error = error or parsed.error
        if rejected:
            self.metrics.rejected.labels(signal).inc(rejected)
        if kept == 0:  # empty request, or nothing valid in it
            return Result(0, rejected, error)
        payload = parsed.raw if parsed.raw is not None and rejected == 0 else msg.SerializeToString()
        if self.redactor.enabled:
            n = self.redactor.redact(signal, msg, payload)
            if n:
                self.metrics.redacted.inc(n)
                payload = msg.SerializeToString()
        # The parsed message (1-2x the request's bytes) is let go before the wait
        # for the fsync, most of a request's time: every request waiting held one.
        del msg, parsed
        t0 = time.perf_counter()
        try:
            self.log.append(wal.KINDS[signal], payload)
        except Overloaded as e:
            self.metrics.refused_records.labels(signal, e.reason).inc(kept)
            raise
        self.metrics.ack_seconds.observe(time.perf_counter() - t0)
        self.metrics.accepted.labels(signal).inc(kept)
        return Result(kept, rejected, error)

    def export_feedback(self, body: bytes) -> Result:
        """A `POST /v1/feedback` body: every label valid or none stored (BadRequest
        lists each problem), comments redacted, then one durable WAL record."""
        redact = self._redact_comment if self.redactor.enabled else None
        try:
            records = feedback.parse_request(body, redact=redact)
        except feedback.InvalidFeedback as e:
            self.metrics.rejected.labels("feedback").inc(e.bad_items)
            raise BadRequest(f"invalid feedback: {e}", e.violations) from None
        if not records:
            return Result(0)
        t0 = time.perf_counter()
        try:
            self.log.append(wal.KIND_FEEDBACK, feedback.encode(records))
        except Overloaded as e:
            self.metrics.refused_records.labels("feedback", e.reason).inc(len(records))
            raise
        self.metrics.ack_seconds.observe(time.perf_counter() - t0)
        self.metrics.accepted.labels("feedback").inc(len(records))
        return Result(len(records))

    def _redact_comment(self, text: str) -> str:
        new, n = self.redactor.redact_text(text)
        if n:
            self.metrics.redacted.inc(n)
        return new


class _Slot:
    def __init__(self, p: Pipeline, client: str, nbytes: int = 0):
        self.p = p
        self.client = client
        self.nbytes = nbytes  # counted in the pipeline's bytes in flight

    def charge(self, nbytes: int) -> None:
        """Bills the request's decompressed size to its client's write rate, and
        counts it in flight in place of the size known at admission (it is read
        by now: never refused for it)."""
        self.p.limits.charge(self.client, nbytes)
        self.p._resize(self.nbytes, nbytes)
        self.nbytes = nbytes

    def __enter__(self):
        self.p.metrics.inflight.inc()
        return self

    def __exit__(self, *exc):
        self.p.metrics.inflight.dec()
        self.p._resize(self.nbytes, 0)
        self.p._slots.release()
        self.p.limits.release(self.client)
        return False
