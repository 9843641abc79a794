"""Prometheus metrics of one collector, in their own registry (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.accepted = Counter("nightshift_accepted", "Records acknowledged durable (spans, log records) or counted (metric points).", ["signal"], registry=r)
        self.rejected = Counter("nightshift_rejected", "Records refused one by one through OTLP partial success.", ["signal"], registry=r)
        self.refused = Counter("nightshift_refused_requests", "Requests refused whole, by reason.", ["signal", "reason"], registry=r)
        self.refused_records = Counter("nightshift_refused", "Records in requests refused whole (when they could be counted), by reason.", ["signal", "reason"], registry=r)
        self.redacted = Counter("nightshift_redacted_values", "Attribute values rewritten or dropped by redaction.", registry=r)
        self.request_seconds = Histogram("nightshift_request_duration_seconds", "Time from request received to response, by transport.", ["transport", "signal"], buckets=LATENCY_BUCKETS, registry=r)
        self.ack_seconds = Histogram("nightshift_ack_seconds", "Time a request waited for its WAL write and fsync (group commit).", buckets=LATENCY_BUCKETS, registry=r)
        self.fsync_seconds = Histogram("nightshift_wal_fsync_seconds", "Duration of one group-commit write + fsync.", buckets=LATENCY_BUCKETS, registry=r)
        self.fsync_batch = Histogram("nightshift_wal_group_commit_requests", "Requests made durable by one fsync.", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.wal_bytes = Gauge("nightshift_wal_bytes", "Bytes in the write-ahead log (not yet flushed to Parquet).", registry=r)
        self.flush_lag = Gauge("nightshift_flush_lag_seconds", "Age of the oldest WAL segment waiting for the flusher (0 when none).", registry=r)
        self.flushed = Gauge("nightshift_flushed", "Records written to Parquet by the flusher since start.", ["signal"], registry=r)
        self.duplicates = Gauge("nightshift_duplicates_dropped", "Resent records found already stored and dropped, since start.", registry=r)
        self.flush_errors = Gauge("nightshift_flush_errors", "Failed flush attempts since start (the data stays in the WAL and is retried).", registry=r)
        self.flusher_restarts = Counter("nightshift_flusher_restarts", "Flusher processes restarted, by why (exited, stuck past flush_timeout).", ["why"], registry=r)
        self.inflight = Gauge("nightshift_requests_in_flight", "Requests being handled.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
