"""OTLP protobuf messages to Arrow tables of the `spans` and `logs` schemas.

Spans, the volume, are converted column by column from their serialized
requests (`otlp_arrow`). Log records are still walked in Python: their columns
are built as flat lists and assembled with offsets (no dict per row).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa

from nightshift.schemas import logs as logs_schema
from nightshift.schemas import spans as spans_schema
from nightshift.schemas.common import ANY_VALUE, ATTRIBUTE

from .otlp_arrow import json_safe as _json_safe, spans_table

_KINDS = spans_schema.KINDS
_STATUS = spans_schema.STATUS_CODES


_TYPE_NAMES = ("empty", "string", "int", "double", "bool", "bytes", "array", "kvlist")
_CODE = {"string_value": 1, "int_value": 2, "double_value": 3, "bool_value": 4, "bytes_value": 5,
         "array_value": 6, "kvlist_value": 7}


class _Values:
    """Column builders for a run of AnyValue structs.

    The loop stores one type code and one Python value per item; the typed
    columns are split out afterwards by numpy in C, not by appends in Python."""

    __slots__ = ("codes", "vals")

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.vals: list = []

    def add(self, v) -> None:
        kind = v.WhichOneof("value")
        if kind is None:
            self.codes.append(0)
            self.vals.append(None)
            return
        code = _CODE[kind]
        self.codes.append(code)
        if code >= 6:
            self.vals.append(json.dumps(_json_safe(v), ensure_ascii=False, separators=(",", ":")))
        else:
            self.vals.append(getattr(v, kind))

    def array(self) -> pa.StructArray:
        codes = np.asarray(self.codes, dtype=np.int8)
        vals = np.empty(len(self.vals), dtype=object)
        vals[:] = self.vals

        def column(mask: np.ndarray, typ: pa.DataType) -> pa.Array:
            if not mask.any():
                return pa.nulls(len(codes), typ)
            return pa.array(np.where(mask, vals, None), typ)

        names = np.asarray(_TYPE_NAMES, dtype=object)[codes] if len(codes) else np.empty(0, dtype=object)
        return pa.StructArray.from_arrays(
            [
                pa.array(names, pa.string()),
                column(codes == 1, pa.string()),
                column(codes == 2, pa.int64()),
                column(codes == 3, pa.float64()),
                column(codes == 4, pa.bool_()),
                column(codes == 5, pa.binary()),
                column(codes >= 6, pa.string()),
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
        # _Values.add inlined: this loop runs once per attribute of every span.
        keys, codes, vals, code_of = self.keys, self.values.codes, self.values.vals, _CODE
        for kv in kvs:
            keys.append(kv.key)
            v = kv.value
            kind = v.WhichOneof("value")
            if kind is None:
                codes.append(0)
                vals.append(None)
                continue
            code = code_of[kind]
            codes.append(code)
            vals.append(getattr(v, kind) if code < 6 else json.dumps(_json_safe(v), ensure_ascii=False, separators=(",", ":")))
        self.offsets.append(len(keys))

    def array(self) -> pa.ListArray:
        child = pa.StructArray.from_arrays([pa.array(self.keys, pa.string()), self.values.array()], fields=list(ATTRIBUTE))
        return pa.ListArray.from_arrays(pa.array(self.offsets, pa.int32()), child)


class _SharedAttrs:
    """Resource and scope attributes: converted once per resource or scope, then
    repeated for each of its rows by index (they are the same for every span)."""

    __slots__ = ("groups", "rows")

    def __init__(self) -> None:
        self.groups = _Attrs()
        self.rows: list[int] = []

    def group(self, kvs) -> int:
        self.groups.add(kvs)
        return len(self.groups.offsets) - 2

    def array(self) -> pa.ListArray:
        return self.groups.array().take(pa.array(self.rows, pa.int32()))


def service_name(resource) -> str | None:
    """The resource's `service.name`, when it is a string."""
    for kv in resource.attributes:
        if kv.key == "service.name" and kv.value.WhichOneof("value") == "string_value":
            return kv.value.string_value
    return None


def _ts(ns: int):
    return ns if ns else None


class SpanBuilder:
    """Serialized trace requests gathered, then converted column by column
    (`otlp_arrow.spans_table`) when the table is asked for."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.received: list[int] = []
        self.nbytes = 0
        self.dates = np.zeros(0, np.int64)  # set by table(): the partition time of each row
        self.nested_values = 0  # attribute arrays / kvlists that took the Python path

    def __len__(self) -> int:
        return len(self.payloads)

    def add_payload(self, payload: bytes, received_ns: int) -> None:
        """One ExportTraceServiceRequest as the receiver validated and logged it."""
        self.payloads.append(payload)
        self.received.append(received_ns)
        self.nbytes += len(payload)

    def add_request(self, req, received_ns: int) -> None:
        self.add_payload(req.SerializeToString(), received_ns)

    def table(self) -> pa.Table:
        conv = spans_table(self.payloads, self.received)
        self.dates, self.nested_values = conv.dates, conv.nested_values
        return conv.table


class LogBuilder:
    def __init__(self) -> None:
        self.cols: dict[str, list] = {
            f.name: [] for f in logs_schema.SCHEMA if f.type != logs_schema.ATTRIBUTES and f.name != "body"
        }
        self.body = _Values()
        self.attrs = _Attrs()
        self.res_attrs = _SharedAttrs()
        self.scope_attrs = _SharedAttrs()
        self.dates: list[int] = []

    def __len__(self) -> int:
        return len(self.dates)

    def add_request(self, req, received_ns: int) -> None:
        c = self.cols
        for rl in req.resource_logs:
            res = rl.resource
            res_bytes = res.SerializeToString(deterministic=True)
            service = service_name(res)
            res_group = self.res_attrs.group(res.attributes)
            for sl in rl.scope_logs:
                scope = sl.scope
                scope_group = self.scope_attrs.group(scope.attributes)
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
                    self.res_attrs.rows.append(res_group)
                    c["resource_dropped_attributes_count"].append(res.dropped_attributes_count)
                    c["resource_schema_url"].append(rl.schema_url)
                    c["scope_name"].append(scope.name)
                    c["scope_version"].append(scope.version)
                    self.scope_attrs.rows.append(scope_group)
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
