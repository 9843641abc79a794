"""Per-record validation: a bad span or log record is removed and counted, so the
rest of its batch is still stored (OTLP partial success), never the whole batch
refused for one record.
"""

from __future__ import annotations

from google.protobuf.message import Message

_MAX_TIME = (1 << 63) - 1  # timestamps are stored as int64 nanoseconds


def _span_problem(s) -> str | None:
    if len(s.trace_id) != 16 or s.trace_id == b"\0" * 16:
        return f"span {s.name!r}: trace_id must be 16 non-zero bytes (got {len(s.trace_id)})"
    if len(s.span_id) != 8 or s.span_id == b"\0" * 8:
        return f"span {s.name!r}: span_id must be 8 non-zero bytes (got {len(s.span_id)})"
    if len(s.parent_span_id) not in (0, 8):
        return f"span {s.name!r}: parent_span_id must be empty or 8 bytes (got {len(s.parent_span_id)})"
    if s.start_time_unix_nano > _MAX_TIME or s.end_time_unix_nano > _MAX_TIME:
        return f"span {s.name!r}: timestamp out of range"
    for link in s.links:
        if len(link.trace_id) != 16 or len(link.span_id) != 8:
            return f"span {s.name!r}: a link has a wrong-length id"
    for ev in s.events:
        if ev.time_unix_nano > _MAX_TIME:
            return f"span {s.name!r}: event {ev.name!r} timestamp out of range"
    return None


def _log_problem(r) -> str | None:
    if len(r.trace_id) not in (0, 16):
        return f"log record: trace_id must be empty or 16 bytes (got {len(r.trace_id)})"
    if len(r.span_id) not in (0, 8):
        return f"log record: span_id must be empty or 8 bytes (got {len(r.span_id)})"
    if r.time_unix_nano > _MAX_TIME or r.observed_time_unix_nano > _MAX_TIME:
        return "log record: timestamp out of range"
    return None


def _filter(groups, scoped: str, items: str, problem) -> tuple[int, int, str]:
    """Returns (kept, rejected, first error), removing rejected records in place."""
    kept = rejected = 0
    first = ""
    for g in groups:
        for sg in getattr(g, scoped):
            recs = getattr(sg, items)
            bad = [i for i, r in enumerate(recs) if problem(r) is not None]
            if bad:
                first = first or problem(recs[bad[0]])
                keep = [r for i, r in enumerate(recs) if i not in set(bad)]
                copies = [type(r)() for r in keep]
                for c, r in zip(copies, keep):
                    c.CopyFrom(r)
                del recs[:]
                recs.extend(copies)
                rejected += len(bad)
            kept += len(recs)
    return kept, rejected, first


def filter_traces(req: Message) -> tuple[int, int, str]:
    return _filter(req.resource_spans, "scope_spans", "spans", _span_problem)


def filter_logs(req: Message) -> tuple[int, int, str]:
    return _filter(req.resource_logs, "scope_logs", "log_records", _log_problem)


def count_metric_points(req: Message) -> int:
    n = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind:
                    n += len(getattr(m, kind).data_points)
    return n
