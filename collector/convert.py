"""OTLP protobuf messages to Arrow tables of the `spans` and `logs` schemas.

Columns are built as flat Python lists and assembled with offsets (no dict per
row), which is what keeps this loop fast enough for the flusher.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from typing import Any

import pyarrow as pa

from nightshift.schemas import logs as logs_schema
from nightshift.schemas import spans as spans_schema
from nightshift.schemas.common import ANY_VALUE, ATTRIBUTE

_PROMOTED_KEYS = {}
for _col, _keys in spans_schema.PROMOTED.items():
    for _rank, _k in enumerate(_keys):
        _PROMOTED_KEYS[_k] = (_col, _rank)
_PROMOTED_COLS = list(spans_schema.PROMOTED)
_KINDS = spans_schema.KINDS
_STATUS = spans_schema.STATUS_CODES


def _json_safe(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "string_value":
        return v.string_value
    if kind == "int_value":
        return v.int_value
    if kind == "double_value":
        d = v.double_value
        if math.isfinite(d):
            return d
        return "NaN" if math.isnan(d) else ("Infinity" if d > 0 else "-Infinity")
    if kind == "bool_value":
        return v.bool_value
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    if kind == "array_value":
        return [_json_safe(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _json_safe(kv.value) for kv in v.kvlist_value.values}
    return None


class _Values:
    """Column builders for a run of AnyValue structs."""

    __slots__ = ("type", "s", "i", "d", "b", "by", "j")

    def __init__(self) -> None:
        self.type: list = []
        self.s: list = []
        self.i: list = []
        self.d: list = []
        self.b: list = []
        self.by: list = []
        self.j: list = []

    def add(self, v) -> None:
        kind = v.WhichOneof("value")
        t, s, i, d, b, by, j = self.type, self.s, self.i, self.d, self.b, self.by, self.j
        if kind == "string_value":
            t.append("string"); s.append(v.string_value); i.append(None); d.append(None); b.append(None); by.append(None); j.append(None)  # noqa: E702
        elif kind == "int_value":
            t.append("int"); s.append(None); i.append(v.int_value); d.append(None); b.append(None); by.append(None); j.append(None)  # noqa: E702
        elif kind == "double_value":
            t.append("double"); s.append(None); i.append(None); d.append(v.double_value); b.append(None); by.append(None); j.append(None)  # noqa: E702
        elif kind == "bool_value":
            t.append("bool"); s.append(None); i.append(None); d.append(None); b.append(v.bool_value); by.append(None); j.append(None)  # noqa: E702
        elif kind == "bytes_value":
            t.append("bytes"); s.append(None); i.append(None); d.append(None); b.append(None); by.append(v.bytes_value); j.append(None)  # noqa: E702
        elif kind in ("array_value", "kvlist_value"):
            t.append("array" if kind == "array_value" else "kvlist")
            s.append(None); i.append(None); d.append(None); b.append(None); by.append(None)  # noqa: E702
            j.append(json.dumps(_json_safe(v), ensure_ascii=False, separators=(",", ":")))
        else:
            t.append("empty"); s.append(None); i.append(None); d.append(None); b.append(None); by.append(None); j.append(None)  # noqa: E702

    def array(self) -> pa.StructArray:
        return pa.StructArray.from_arrays(
            [
                pa.array(self.type, pa.string()),
                pa.array(self.s, pa.string()),
                pa.array(self.i, pa.int64()),
                pa.array(self.d, pa.float64()),
                pa.array(self.b, pa.bool_()),
                pa.array(self.by, pa.binary()),
                pa.array(self.j, pa.string()),
            ],
            fields=list(ANY_VALUE),
        )


class _Attrs:
    """Builder for a list<attribute> column."""

    __slots__ = ("offsets", "keys", "values")

    def __init__(self) -> None:
        self.offsets = [0]
        self.keys: list = []
        self.values = _Values()

    def add(self, kvs) -> None:
        keys, add = self.keys, self.values.add
        for kv in kvs:
            keys.append(kv.key)
            add(kv.value)
        self.offsets.append(len(keys))

    def array(self) -> pa.ListArray:
        child = pa.StructArray.from_arrays([pa.array(self.keys, pa.string()), self.values.array()], fields=list(ATTRIBUTE))
        return pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), child)


def _ts(ns: int):
    return ns if ns else None


class SpanBuilder:
    def __init__(self) -> None:
        self.cols: dict[str, list] = {f.name: [] for f in spans_schema.SCHEMA if f.type != spans_schema.ATTRIBUTES}
        self.attrs = _Attrs()
        self.res_attrs = _Attrs()
        self.scope_attrs = _Attrs()
        # events and links: list<struct>, built with their own offsets
        self.ev_offsets = [0]
        self.ev = {"time": [], "name": [], "dropped_attributes_count": []}
        self.ev_attrs = _Attrs()
        self.ln_offsets = [0]
        self.ln = {"trace_id": [], "span_id": [], "trace_state": [], "flags": [], "dropped_attributes_count": []}
        self.ln_attrs = _Attrs()
        self.dates: list[int] = []  # start (or receive) time in ns, for partitioning

    def __len__(self) -> int:
        return len(self.dates)

    def add_request(self, req, received_ns: int) -> None:
        c = self.cols
        for rs in req.resource_spans:
            res = rs.resource
            service = None
            for kv in res.attributes:
                if kv.key == "service.name" and kv.value.WhichOneof("value") == "string_value":
                    service = kv.value.string_value
                    break
            for ss in rs.scope_spans:
                scope = ss.scope
                for s in ss.spans:
                    c["trace_id"].append(s.trace_id.hex())
                    c["span_id"].append(s.span_id.hex())
                    c["parent_span_id"].append(s.parent_span_id.hex() or None)
                    c["trace_state"].append(s.trace_state)
                    c["flags"].append(s.flags)
                    c["name"].append(s.name)
                    c["kind"].append(_KINDS[s.kind] if 0 <= s.kind < len(_KINDS) else str(s.kind))
                    c["start_time"].append(_ts(s.start_time_unix_nano))
                    c["end_time"].append(_ts(s.end_time_unix_nano))
                    code = s.status.code
                    c["status_code"].append(_STATUS[code] if 0 <= code < len(_STATUS) else str(code))
                    c["status_message"].append(s.status.message)
                    c["service_name"].append(service)
                    promoted: dict[str, tuple[int, str]] = {}
                    for kv in s.attributes:
                        hit = _PROMOTED_KEYS.get(kv.key)
                        if hit is not None and kv.value.WhichOneof("value") == "string_value":
                            col, rank = hit
                            if col not in promoted or promoted[col][0] > rank:
                                promoted[col] = (rank, kv.value.string_value)
                    for col in _PROMOTED_COLS:
                        p = promoted.get(col)
                        c[col].append(p[1] if p else None)
                    self.attrs.add(s.attributes)
                    c["dropped_attributes_count"].append(s.dropped_attributes_count)
                    for ev in s.events:
                        self.ev["time"].append(_ts(ev.time_unix_nano))
                        self.ev["name"].append(ev.name)
                        self.ev["dropped_attributes_count"].append(ev.dropped_attributes_count)
                        self.ev_attrs.add(ev.attributes)
                    self.ev_offsets.append(len(self.ev["name"]))
                    c["dropped_events_count"].append(s.dropped_events_count)
                    for ln in s.links:
                        self.ln["trace_id"].append(ln.trace_id.hex())
                        self.ln["span_id"].append(ln.span_id.hex())
                        self.ln["trace_state"].append(ln.trace_state)
                        self.ln["flags"].append(ln.flags)
                        self.ln["dropped_attributes_count"].append(ln.dropped_attributes_count)
                        self.ln_attrs.add(ln.attributes)
                    self.ln_offsets.append(len(self.ln["span_id"]))
                    c["dropped_links_count"].append(s.dropped_links_count)
                    self.res_attrs.add(res.attributes)
                    c["resource_dropped_attributes_count"].append(res.dropped_attributes_count)
                    c["resource_schema_url"].append(rs.schema_url)
                    c["scope_name"].append(scope.name)
                    c["scope_version"].append(scope.version)
                    self.scope_attrs.add(scope.attributes)
                    c["scope_dropped_attributes_count"].append(scope.dropped_attributes_count)
                    c["scope_schema_url"].append(ss.schema_url)
                    c["received_time"].append(received_ns)
                    self.dates.append(s.start_time_unix_nano or received_ns)

    def table(self) -> pa.Table:
        schema = spans_schema.SCHEMA
        arrays = []
        for f in schema:
            if f.name == "attributes":
                arrays.append(self.attrs.array())
            elif f.name == "resource_attributes":
                arrays.append(self.res_attrs.array())
            elif f.name == "scope_attributes":
                arrays.append(self.scope_attrs.array())
            elif f.name == "events":
                ev_type = f.type.value_type
                child = pa.StructArray.from_arrays(
                    [
                        pa.array(self.ev["time"], ev_type.field("time").type),
                        pa.array(self.ev["name"], pa.string()),
                        self.ev_attrs.array(),
                        pa.array(self.ev["dropped_attributes_count"], pa.uint32()),
                    ],
                    fields=list(ev_type),
                )
                arrays.append(pa.ListArray.from_arrays(pa.array(self.ev_offsets, pa.int32()), child))
            elif f.name == "links":
                ln_type = f.type.value_type
                child = pa.StructArray.from_arrays(
                    [
                        pa.array(self.ln["trace_id"], pa.string()),
                        pa.array(self.ln["span_id"], pa.string()),
                        pa.array(self.ln["trace_state"], pa.string()),
                        pa.array(self.ln["flags"], pa.uint32()),
                        self.ln_attrs.array(),
                        pa.array(self.ln["dropped_attributes_count"], pa.uint32()),
                    ],
                    fields=list(ln_type),
                )
                arrays.append(pa.ListArray.from_arrays(pa.array(self.ln_offsets, pa.int32()), child))
            else:
                arrays.append(pa.array(self.cols[f.name], f.type))
        return pa.Table.from_arrays(arrays, schema=schema)


class LogBuilder:
    def __init__(self) -> None:
        self.cols: dict[str, list] = {
            f.name: [] for f in logs_schema.SCHEMA if f.type != logs_schema.ATTRIBUTES and f.name != "body"
        }
        self.body = _Values()
        self.attrs = _Attrs()
        self.res_attrs = _Attrs()
        self.scope_attrs = _Attrs()
        self.dates: list[int] = []

    def __len__(self) -> int:
        return len(self.dates)

    def add_request(self, req, received_ns: int) -> None:
        c = self.cols
        for rl in req.resource_logs:
            res = rl.resource
            res_bytes = res.SerializeToString(deterministic=True)
            service = None
            for kv in res.attributes:
                if kv.key == "service.name" and kv.value.WhichOneof("value") == "string_value":
                    service = kv.value.string_value
                    break
            for sl in rl.scope_logs:
                scope = sl.scope
                scope_bytes = scope.SerializeToString(deterministic=True)
                for r in sl.log_records:
                    rec_bytes = r.SerializeToString(deterministic=True)
                    h = hashlib.blake2b(digest_size=16)
                    for part in (res_bytes, scope_bytes, rec_bytes):  # length-framed: no ambiguity
                        h.update(len(part).to_bytes(8, "little"))
                        h.update(part)
                    c["record_id"].append(h.hexdigest())
                    c["time"].append(_ts(r.time_unix_nano))
                    c["observed_time"].append(_ts(r.observed_time_unix_nano))
                    c["severity_number"].append(r.severity_number)
                    c["severity_text"].append(r.severity_text)
                    c["event_name"].append(r.event_name)
                    self.body.add(r.body)
                    self.attrs.add(r.attributes)
                    c["dropped_attributes_count"].append(r.dropped_attributes_count)
                    c["flags"].append(r.flags)
                    c["trace_id"].append(r.trace_id.hex() or None)
                    c["span_id"].append(r.span_id.hex() or None)
                    c["service_name"].append(service)
                    self.res_attrs.add(res.attributes)
                    c["resource_dropped_attributes_count"].append(res.dropped_attributes_count)
                    c["resource_schema_url"].append(rl.schema_url)
                    c["scope_name"].append(scope.name)
                    c["scope_version"].append(scope.version)
                    self.scope_attrs.add(scope.attributes)
                    c["scope_dropped_attributes_count"].append(scope.dropped_attributes_count)
                    c["scope_schema_url"].append(sl.schema_url)
                    c["received_time"].append(received_ns)
                    self.dates.append(r.time_unix_nano or r.observed_time_unix_nano or received_ns)

    def table(self) -> pa.Table:
        arrays = []
        for f in logs_schema.SCHEMA:
            if f.name == "attributes":
                arrays.append(self.attrs.array())
            elif f.name == "resource_attributes":
                arrays.append(self.res_attrs.array())
            elif f.name == "scope_attributes":
                arrays.append(self.scope_attrs.array())
            elif f.name == "body":
                arrays.append(self.body.array())
            else:
                arrays.append(pa.array(self.cols[f.name], f.type))
        return pa.Table.from_arrays(arrays, schema=logs_schema.SCHEMA)
