"""Delayed feedback: the one set of rules for a label, shared by `POST /v1/feedback`
and `nightshift feedback FILE`, and the WAL payload that carries labels to the
flusher.

Rewards are what training optimizes, so a label that is silently wrong costs more
than one refused loudly: every item is checked field by field, unknown fields are
refused (a `reward` typed for `value` must not vanish), and each problem names the
item and the field. Nothing here imports Arrow, so the receiver stays small.

A normalized record is a plain dict with the keys of `RECORD_KEYS`: ids in
lowercase hex, `value` a finite float, `time` UTC nanoseconds or None, and
`feedback_id` the client's `id` or else a content hash of the rest, so a client
that resends the same label gets it stored once.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Callable, Iterable, Mapping

DEFAULT_NAME = "feedback"

#: Fields a client may send, and nothing else.
FIELDS = ("trace_id", "conversation_id", "span_id", "name", "value", "comment", "time", "id")

#: Keys of a normalized record (the WAL payload's lines, the dataset's columns
#: less `source` and `received_time`).
RECORD_KEYS = ("feedback_id", "trace_id", "conversation_id", "span_id", "name", "value", "comment", "time")

_TRACE_ID = re.compile(r"[0-9a-fA-F]{32}")
_SPAN_ID = re.compile(r"[0-9a-fA-F]{16}")
_MAX_NS = (1 << 63) - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

#: Names people reach for instead of ours, for the "did you mean" of an unknown field.
_ALIASES = {"reward": "value", "score": "value", "rating": "value", "traceId": "trace_id", "spanId": "span_id",
            "conversationId": "conversation_id", "feedback_id": "id", "timestamp": "time"}

#: Violations listed in one refusal; past that the message says how many more.
MAX_VIOLATIONS = 100


class InvalidFeedback(ValueError):
    """Labels refused, each problem as (`feedback[2].value`, why). Raised for the
    whole request or file: all-or-nothing, so a client never has to work out
    which half of its batch was stored."""

    def __init__(self, violations: list[tuple[str, str]], bad_items: int | None = None):
        self.violations = violations
        self.bad_items = len(violations) if bad_items is None else bad_items  # 0: the body itself is wrong
        shown = "; ".join(f"{where}: {why}" if where else why for where, why in violations[:10])
        more = max(self.bad_items, len(violations)) - min(len(violations), 10)
        super().__init__(shown + (f" (and {more} more)" if more > 0 else ""))


class FieldError(ValueError):
    """One item's problem: which field and why (the caller adds where the item is)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field
        self.why = why


def describe(v: Any) -> str:
    """A value as the client wrote it, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, (int, float)):
        r = repr(v)
        return r if len(r) <= 40 else r[:40] + "…"
    if isinstance(v, str):
        return f"string {v[:60]!r}" + ("…" if len(v) > 60 else "")
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _hex_id(item: Mapping, field: str, pattern: re.Pattern, digits: int) -> str | None:
    v = item.get(field)
    if v is None:
        return None
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise FieldError(field, f"must be {digits} hex digits, got {describe(v)}")
    if v.strip("0") == "":
        raise FieldError(field, "must not be all zeros (an invalid id in OpenTelemetry)")
    return v.lower()


def _text(item: Mapping, field: str, *, empty_ok: bool) -> str | None:
    v = item.get(field)
    if v is None:
        return None
    if not isinstance(v, str):
        raise FieldError(field, f"must be a string, got {describe(v)}")
    if not v and not empty_ok:
        raise FieldError(field, "must not be empty")
    _check_unicode(field, v)
    return v


def _check_unicode(field: str, v: str) -> None:
    """JSON's `\ud800` escape gives a string no UTF-8 can hold (a lone surrogate):
    refused here, or it would fail later, in the hash or the log, as a crash."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(field, f"is not valid Unicode text: a lone surrogate at position {e.start}") from None


def _value(item: Mapping) -> float:
    if "value" not in item:
        raise FieldError("value", "required: a finite number, or true/false")
    v = item["value"]
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, (int, float)):
        try:
            f = float(v)
        except OverflowError:
            f = math.inf
        if math.isfinite(f):
            return f
    raise FieldError("value", f"must be a finite number, got {describe(v)}")


def parse_time(v: Any) -> int | None:
    """RFC 3339 text (with its offset) or a number of unix seconds, as UTC ns.
    Text without an offset is refused: guessing a time zone shifts the label."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise FieldError("time", "must be an RFC 3339 string or unix seconds, got a boolean")
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            raise FieldError("time", f"must be a finite number of unix seconds, got {describe(v)}")
        if not 0 <= v <= _MAX_NS // 1_000_000_000:
            raise FieldError("time", f"{describe(v)} is out of range for unix seconds (milliseconds or nanoseconds?)")
        return int((Decimal(repr(v)) * 1_000_000_000).to_integral_value())  # 0.25 s is 250000000 ns, exactly
    if not isinstance(v, str):
        raise FieldError("time", f"must be an RFC 3339 string or unix seconds, got {describe(v)}")
    try:
        dt = datetime.fromisoformat(v.strip().upper())  # RFC 3339 allows a lowercase t and z
    except ValueError:
        raise FieldError("time", f"not an RFC 3339 time: {v[:60]!r} (e.g. 2025-11-22T10:15:00Z)") from None
    if dt.tzinfo is None:
        raise FieldError("time", f"{v[:60]!r} has no UTC offset; add Z or +hh:mm (RFC 3339)")
    delta = dt - _EPOCH
    ns = (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1000
    if not 0 <= ns <= _MAX_NS:
        raise FieldError("time", f"{v[:60]!r} is out of range")
    return ns


def content_id(record: Mapping) -> str:
    """sha256 (32 hex) of a record's content: what makes a resent label the same row."""
    body = {k: record[k] for k in RECORD_KEYS if k != "feedback_id"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def normalize(item: Any, default_name: str = DEFAULT_NAME,
              redact: Callable[[str], str] | None = None) -> dict:
    """One label (a JSON object, or a file's row as a dict) to a normalized record.

    Raises FieldError naming the first field at fault. A field set to null counts
    as absent. `redact` rewrites the free-text comment before anything else sees
    it (ids stay joinable); the content hash is taken after it, so it never
    fingerprints a secret."""
    if not isinstance(item, Mapping):
        raise FieldError("", f"must be an object, got {describe(item)}")
    unknown = [k for k in item if k not in FIELDS]
    if unknown:
        k = unknown[0]
        import difflib  # here: only a label with an unknown field needs it

        close = [_ALIASES[k]] if k in _ALIASES else difflib.get_close_matches(str(k), FIELDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(FIELDS)})"
        name = str(k).encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        raise FieldError(name, "unknown field" + hint)
    trace_id = _hex_id(item, "trace_id", _TRACE_ID, 32)
    conversation_id = _text(item, "conversation_id", empty_ok=False)
    if trace_id is None and conversation_id is None:
        raise FieldError("trace_id", "trace_id or conversation_id is required")
    record = {
        "feedback_id": None,
        "trace_id": trace_id,
        "conversation_id": conversation_id,
        "span_id": _hex_id(item, "span_id", _SPAN_ID, 16),
        "name": _text(item, "name", empty_ok=False) or default_name,
        "value": _value(item),
        "comment": _text(item, "comment", empty_ok=True),
        "time": parse_time(item.get("time")),
    }
    if redact is not None and record["comment"]:
        record["comment"] = redact(record["comment"])
    record["feedback_id"] = _text(item, "id", empty_ok=False) or content_id(record)
    return record


def items_of(doc: Any) -> list:
    """The labels of a request body: one object, a list of objects, or
    `{"feedback": [...]}`."""
    if isinstance(doc, list):
        return doc
    if isinstance(doc, dict):
        if "feedback" not in doc:
            return [doc]
        others = sorted(k for k in doc if k != "feedback")
        if others:
            raise InvalidFeedback([("", f"unknown field(s) beside `feedback`: {', '.join(others)}")], 0)
        items = doc["feedback"]
        if not isinstance(items, list):
            raise InvalidFeedback([("feedback", f"must be a list of objects, got {describe(items)}")], 0)
        return items
    raise InvalidFeedback([("", f"body must be a JSON object, a list of objects or {{\"feedback\": [...]}}, "
                                f"got {describe(doc)}")], 0)


def parse_request(body: bytes, redact: Callable[[str], str] | None = None) -> list[dict]:
    """A `POST /v1/feedback` body to normalized records, all or none: raises
    InvalidFeedback listing every bad item (`feedback[2].value: ...`)."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise InvalidFeedback([("", "body is nested too deeply")], 0) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidFeedback([("", f"body is not valid JSON: {e}")], 0) from None
    return normalize_all(items_of(doc), redact=redact)


def normalize_all(items: Iterable, default_name: str = DEFAULT_NAME,
                  redact: Callable[[str], str] | None = None) -> list[dict]:
    records, bad, total = [], [], 0
    for i, item in enumerate(items):
        try:
            records.append(normalize(item, default_name, redact))
        except FieldError as e:
            total += 1
            if len(bad) < MAX_VIOLATIONS:
                where = f"feedback[{i}]" + (f".{e.field}" if e.field else "")
                bad.append((where, e.why))
    if bad:
        raise InvalidFeedback(bad, total)
    return records


def encode(records: list[dict]) -> bytes:
    """The WAL payload: one compact JSON object per line, keys sorted. Text, so a
    segment can be read with `strings`, and small next to the spans around it."""
    return b"".join(
        json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n" for r in records
    )


def decode(payload: bytes) -> list[dict]:
    return [json.loads(line) for line in payload.splitlines() if line]
