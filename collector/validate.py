"""Per-record validation: a bad span or log record is removed and counted, so the
rest of its batch is still stored (OTLP partial success), never the whole batch
refused for one record.
"""

from __future__ import annotations

from google.protobuf.message import Message

_MAX_TIME = (1 << 63) - 1  # timestamps are stored as int64 nanoseconds


_ZERO16 = b"\0" * 16
_ZERO8 = b"\0" * 8


def _span_ok(s) -> bool:
    """The fast path: true for a well-formed span (nearly all of them)."""
    t, i, p = s.trace_id, s.span_id, s.parent_span_id
    return (
        len(t) == 16 and len(i) == 8 and (not p or len(p) == 8) and t != _ZERO16 and i != _ZERO8
        and s.start_time_unix_nano <= _MAX_TIME and s.end_time_unix_nano <= _MAX_TIME
        and (not s.links or all(len(ln.trace_id) == 16 and len(ln.span_id) == 8 for ln in s.links))
        and (not s.events or all(ev.time_unix_nano <= _MAX_TIME for ev in s.events))
    )


def _span_problem(s) -> str | None:
    if _span_ok(s):
        return None
    if len(s.trace_id) != 16 or s.trace_id == _ZERO16:
        return f"span {s.name!r}: trace_id must be 16 non-zero bytes (got {len(s.trace_id)})"
    if len(s.span_id) != 8 or s.span_id == _ZERO8:
        return f"span {s.name!r}: span_id must be 8 non-zero bytes (got {len(s.span_id)})"
    if len(s.parent_span_id) not in (0, 8):
        return f"span {s.name!r}: parent_span_id must be empty or 8 bytes (got {len(s.parent_span_id)})"
    if s.start_time_unix_nano > _MAX_TIME or s.end_time_unix_nano > _MAX_TIME:
        return f"span {s.name!r}: timestamp out of range"
    for link in s.links:
        if len(link.trace_id) != 16 or len(link.span_id) != 8:
            return f"span {s.name!r}: a link has a wrong-length id"
    return f"span {s.name!r}: an event timestamp is out of range"


def _log_ok(r) -> bool:
    t, i = r.trace_id, r.span_id
    return (len(t) in (0, 16) and len(i) in (0, 8) and r.time_unix_nano <= _MAX_TIME
            and r.observed_time_unix_nano <= _MAX_TIME)


def _log_problem(r) -> str | None:
    if _log_ok(r):
        return None
    if len(r.trace_id) not in (0, 16):
        return f"log record: trace_id must be empty or 16 bytes (got {len(r.trace_id)})"
    if len(r.span_id) not in (0, 8):
        return f"log record: span_id must be empty or 8 bytes (got {len(r.span_id)})"
    if r.time_unix_nano > _MAX_TIME or r.observed_time_unix_nano > _MAX_TIME:
        return "log record: timestamp out of range"
    return None


def _filter(groups, scoped: str, items: str, problem, ok) -> tuple[int, int, str]:
    """Returns (kept, rejected, first error), removing rejected records in place."""
    kept = rejected = 0
    first = ""
    for g in groups:
        for sg in getattr(g, scoped):
            recs = getattr(sg, items)
            if all(map(ok, recs)):
                kept += len(recs)
                continue
            bad = [i for i, r in enumerate(recs) if problem(r) is not None]
            if bad:
                first = first or problem(recs[bad[0]])
                bad_set = set(bad)
                keep = [r for i, r in enumerate(recs) if i not in bad_set]
                copies = [type(r)() for r in keep]
                for c, r in zip(copies, keep):
                    c.CopyFrom(r)
                del recs[:]
                recs.extend(copies)
                rejected += len(bad)
            kept += len(recs)
    return kept, rejected, first


def filter_traces(req: Message) -> tuple[int, int, str]:
    return _filter(req.resource_spans, "scope_spans", "spans", _span_problem, _span_ok)


def filter_logs(req: Message) -> tuple[int, int, str]:
    return _filter(req.resource_logs, "scope_logs", "log_records", _log_problem, _log_ok)


def count_metric_points(req: Message) -> int:
    n = 0
    for rm in req.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = m.WhichOneof("data")
                if kind:
                    n += len(getattr(m, kind).data_points)
    return n
