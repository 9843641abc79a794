"""OTLP trace payloads to the `spans` table, column by column.

The flusher's cost used to be Python walking every span and every attribute of
the protobuf objects. Here the serialized requests go straight into Arrow
(`ptars`, Rust: wire format to Arrow builders, no message objects), and every
step after is an Arrow/numpy operation over whole columns: flatten
request → resource → scope → span with parent indices, hex ids, kind and status
names, the attribute values retyped into the schema's `ANY_VALUE`. Python
touches only arrays and key-value lists inside attributes (their JSON text),
which are rare and counted in `Conversion.nested_values`.

The output is the same table, row for row and value for value, as the
per-span converter it replaces (tests/support/reference_convert.py, checked
against it on every fuzz case in tests/test_otlp_arrow.py).
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nightshift.schemas import spans as spans_schema
from nightshift.schemas.common import ANY_VALUE, ATTRIBUTE, TIMESTAMP

_TYPE_NAMES = pa.array(["empty", "string", "int", "double", "bool", "bytes", "array", "kvlist"], pa.string())
#: AnyValue's oneof members, in the order of _TYPE_NAMES after "empty".
_MEMBERS = ("string_value", "int_value", "double_value", "bool_value", "bytes_value", "array_value", "kvlist_value")
_KINDS = pa.array(list(spans_schema.KINDS), pa.string())
_STATUS = pa.array(list(spans_schema.STATUS_CODES), pa.string())
_HEX = np.array([f"{i:02x}".encode() for i in range(256)], dtype="S2")


@lru_cache(maxsize=None)
def _handler(message: str = "trace"):
    """ptars' converter for ExportTraceServiceRequest (`trace`) or AnyValue (`any`),
    from one pool built once per process."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    desc = {"trace": ExportTraceServiceRequest, "any": AnyValue}[message].DESCRIPTOR
    return _pool().get_for_message(desc)


@lru_cache(maxsize=None)
def _pool():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from ptars import HandlerPool

    return HandlerPool([ExportTraceServiceRequest.DESCRIPTOR.file])


@dataclass
class Conversion:
    table: pa.Table
    dates: np.ndarray  # int64 ns per row: the span's start, else its arrival (the partition key)
    nested_values: int = 0  # array / kvlist attribute values converted to JSON in Python


def _field(arr: pa.Array, name: str) -> pa.Array:
    """A struct column's child. `StructArray.field` is a view of it (about a
    microsecond); the `struct_field` kernel cost ~20 us a call, and a chunk makes
    93 calls whatever its size: 1.9 of the 4.5 ms a chunk cost before its first
    span (measured under load), a fifth of the conversion of 5 KB spans, whose
    4 MiB chunks hold ~800. The kernel also folds the struct's own nulls into the
    child, which the view does not: it is kept for a struct that has any."""
    if arr.null_count == 0 and isinstance(arr, pa.StructArray):
        return arr.field(name)
    return pc.struct_field(arr, name)


def _as(arr: pa.Array, typ: pa.DataType) -> pa.Array:
    """`arr` as `typ`, without a call into the cast kernel when it is already
    (48 such calls a chunk, most of them no-ops: ~6 us each, for nothing)."""
    return arr if arr.type == typ else arr.cast(typ)


def _filled(arr: pa.Array, value) -> pa.Array:
    """`arr` with its nulls replaced by `value`; itself when it has none (21 calls
    a chunk, most on columns without a null)."""
    return arr if arr.null_count == 0 else arr.fill_null(value)


def _flatten(lists: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """The items of a list column and, for each, the index of the row it came from."""
    return pc.list_flatten(lists), pc.list_parent_indices(lists).to_numpy()


def _offsets(lengths: pa.Array) -> pa.Array:
    n = np.asarray(_filled(lengths, 0).to_numpy(zero_copy_only=False), dtype=np.int32)
    out = np.zeros(len(n) + 1, dtype=np.int32)
    np.cumsum(n, out=out[1:])
    return pa.array(out, pa.int32())


def hex_ids(arr: pa.Array, empty_null: bool = False) -> pa.Array:
    """Binary ids as lowercase hex strings (empty as null when `empty_null`)."""
    arr = arr.cast(pa.binary()) if arr.type != pa.binary() else arr
    if len(arr) == 0:
        return pa.array([], pa.string())
    offs = np.frombuffer(arr.buffers()[1], dtype=np.int32, count=len(arr) + 1, offset=arr.offset * 4)
    start = int(offs[0])
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8, count=int(offs[-1]) - start, offset=start) \
        if arr.buffers()[2] is not None else np.zeros(0, np.uint8)
    hexed = _HEX[data].tobytes() if len(data) else b""
    new_offs = ((offs - start) * 2).astype(np.int32)
    lengths = np.diff(offs)
    valid = None
    if empty_null or arr.null_count:
        ok = np.ones(len(arr), dtype=bool)
        if arr.null_count:
            ok &= pc.is_valid(arr).to_numpy(zero_copy_only=False)
        if empty_null:
            ok &= lengths > 0
        valid = pa.py_buffer(np.packbits(ok, bitorder="little"))
    return pa.StringArray.from_buffers(len(arr), pa.py_buffer(new_offs), pa.py_buffer(hexed), valid)


def _timestamps(ns: pa.Array) -> pa.Array:
    """uint64 nanoseconds to the schema's timestamp, 0 (unset) as null."""
    ns = _as(_filled(ns, 0), pa.int64())
    return pc.if_else(pc.equal(ns, 0), pa.scalar(None, pa.int64()), ns).cast(TIMESTAMP)


def _names(codes: pa.Array, names: pa.Array) -> pa.Array:
    """An enum's name, or its number as text when it is outside the known range."""
    codes = _filled(codes, 0)
    n = np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int64)
    inside = (n >= 0) & (n < len(names))
    if inside.all():
        return names.take(pa.array(n, pa.int32()))
    idx = pa.array(np.where(inside, n, 0), pa.int32(), mask=~inside)
    return pc.coalesce(names.take(idx), codes.cast(pa.string()))


def json_safe(v) -> Any:
    """An AnyValue as JSON-able Python: bytes as base64, non-finite doubles as the
    strings proto3 JSON uses."""
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
        return [json_safe(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: json_safe(kv.value) for kv in v.kvlist_value.values}
    return None


def _nested_json(kind: str, value) -> str:
    """The JSON text of an array or kvlist value that ptars left as serialized bytes."""
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList

    items = value["values"] if isinstance(value, dict) else []
    if kind == "array":
        msg = AnyValue(array_value=ArrayValue(values=[AnyValue.FromString(b) for b in items]))
    else:
        kvs = []
        for it in items:
            if isinstance(it, (bytes, bytearray)):
                kvs.append(KeyValue.FromString(it))
            else:  # {key, value: bytes}
                kvs.append(KeyValue(key=it["key"], value=AnyValue.FromString(it["value"] or b"")))
        msg = AnyValue(kvlist_value=KeyValueList(values=kvs))
    return json.dumps(json_safe(msg), ensure_ascii=False, separators=(",", ":"))


def _json_strings(strings: pa.Array) -> pa.Array:
    """Strings as JSON string literals, escaped as `json.dumps(ensure_ascii=False)`
    does: a backslash and a quote in Arrow, the rare string holding a control
    character by `json.dumps` itself."""
    strings = _as(strings, pa.string())
    escaped = pc.replace_substring(pc.replace_substring(strings, "\\", "\\\\"), '"', '\\"')
    quoted = pc.binary_join_element_wise('"', escaped, '"', "")
    control = np.flatnonzero(pc.match_substring_regex(strings, "[\\x00-\\x1f]").fill_null(False)
                             .to_numpy(zero_copy_only=False))
    if len(control) == 0:
        return quoted
    texts = quoted.to_numpy(zero_copy_only=False).astype(object)
    for i, v in zip(control.tolist(), strings.take(pa.array(control)).to_pylist()):
        texts[i] = json.dumps(v, ensure_ascii=False)
    return pa.array(texts, pa.string())


def _simple_arrays_json(values: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """JSON text of array values (ptars: a list of serialized AnyValues each) whose
    items are all strings, ints or bools, the common case (finish reasons, tags,
    node lists), in Arrow; and a mask of those that need the general path."""
    lists = _field(values, "values")
    items = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists).to_numpy()
    n = len(values)
    if len(items) == 0:
        return pa.array(["[]"] * n, pa.string()), np.zeros(n, bool)
    dec = _handler("any").array_to_record_batch(items.cast(pa.binary()))
    s, i, b = dec.column("string_value"), dec.column("int_value"), dec.column("bool_value")
    sv, iv, bv = (pc.is_valid(x).to_numpy(zero_copy_only=False) for x in (s, i, b))
    simple = sv | iv | bv
    hard = np.zeros(n, bool)
    hard[parents[~simple]] = True
    strings = pc.if_else(pa.array(sv), _json_strings(s), pa.scalar(None, pa.string()))  # null encodes as "null"
    text = pc.coalesce(strings, _as(i, pa.string()),
                       pc.if_else(b, pa.scalar("true"), pa.scalar("false")))
    joined = pc.binary_join(pa.ListArray.from_arrays(_offsets(pc.list_value_length(lists)), text), ",")
    return pc.binary_join_element_wise("[", joined, "]", ""), hard


def any_values(value: pa.Array, counter: list[int]) -> pa.StructArray:
    """ptars' AnyValue struct (one nullable field per oneof member) as `ANY_VALUE`."""
    n = len(value)
    cols = {name: _field(value, name) for name in _MEMBERS}
    code = np.zeros(n, dtype=np.int8)
    for c, name in enumerate(_MEMBERS, start=1):  # the codes of _TYPE_NAMES
        col = cols[name]
        if col.null_count < n:
            code[pc.is_valid(col).to_numpy(zero_copy_only=False) & (code == 0)] = c
    json_col = pa.nulls(n, pa.string())
    arrays = np.flatnonzero(code == 6)
    slow = np.flatnonzero(code == 7)
    if len(arrays):
        texts, hard = _simple_arrays_json(cols["array_value"].take(pa.array(arrays)))
        where = np.full(n, -1, dtype=np.int64)
        where[arrays] = np.arange(len(arrays))
        json_col = texts.take(pa.array(where, mask=where < 0))
        slow = np.concatenate([slow, arrays[hard]])
    if len(slow):
        # key-value lists, and arrays holding doubles, bytes or nested values: Python, counted
        counter[0] += len(slow)
        texts = json_col.to_numpy(zero_copy_only=False).astype(object)
        av = cols["array_value"].take(pa.array(slow)).to_pylist()
        kv = cols["kvlist_value"].take(pa.array(slow)).to_pylist()
        for i, a, k in zip(slow.tolist(), av, kv):
            texts[i] = _nested_json("array" if code[i] == 6 else "kvlist", a if code[i] == 6 else k)
        json_col = pa.array(texts, pa.string())
    return pa.StructArray.from_arrays(
        [
            _TYPE_NAMES.take(pa.array(code.astype(np.int32))),
            _as(cols["string_value"], pa.string()),
            _as(cols["int_value"], pa.int64()),
            _as(cols["double_value"], pa.float64()),
            _as(cols["bool_value"], pa.bool_()),
            _as(cols["bytes_value"], pa.binary()),
            json_col,
        ],
        fields=list(ANY_VALUE),
    )


def attributes(lists: pa.Array, counter: list[int]) -> pa.ListArray:
    """A list<KeyValue> column (ptars' layout) as the schema's `ATTRIBUTES`."""
    kv = pc.list_flatten(lists)
    child = pa.StructArray.from_arrays(
        [_as(_field(kv, "key"), pa.string()), any_values(_field(kv, "value"), counter)], fields=list(ATTRIBUTE))
    return pa.ListArray.from_arrays(_offsets(pc.list_value_length(lists)), child)


def _first_strings(kv: pa.Array, parents: np.ndarray, n_rows: int,
                   columns: dict[str, tuple[str, ...]]) -> dict[str, pa.Array]:
    """Per column, per row, the first string value among its names (the first name
    listed wins, then a row's first occurrence), null where none is there.

    Every key is looked up once among all the columns' names (one hash pass), not
    compared with each name in turn: seven passes over every attribute key of the
    chunk were a tenth of the conversion."""
    wanted = list(dict.fromkeys(name for names in columns.values() for name in names))
    picks = np.full((len(columns), n_rows), -1, dtype=np.int64)
    strings = _field(_field(kv, "value"), "string_value") if len(kv) else None
    if strings is not None:
        which = pc.index_in(_field(kv, "key"), value_set=pa.array(wanted, pa.string()))
        which = np.asarray(_filled(which, -1).to_numpy(zero_copy_only=False), dtype=np.int64)
        which[~pc.is_valid(strings).to_numpy(zero_copy_only=False)] = -1
        at = np.flatnonzero(which >= 0)
        which, rows_at = which[at], parents[at]
        for pick, names in zip(picks, columns.values()):
            for name in reversed(names):
                match = which == wanted.index(name)
                hits, rows = at[match], rows_at[match]  # in row order: a row's first is where the row changes
                first = np.ones(len(rows), dtype=bool)
                first[1:] = rows[1:] != rows[:-1]
                pick[rows[first]] = hits[first]
    if strings is None or (picks < 0).all():
        return {col: pa.nulls(n_rows, pa.string()) for col in columns}
    flat = picks.ravel()
    taken = _as(strings, pa.string()).take(pa.array(flat, pa.int64(), mask=flat < 0))  # one gather for every column
    return {col: taken.slice(i * n_rows, n_rows) for i, col in enumerate(columns)}


def _events(lists: pa.Array, counter: list[int], typ: pa.StructType) -> pa.ListArray:
    ev = pc.list_flatten(lists)
    child = pa.StructArray.from_arrays(
        [
            _timestamps(_field(ev, "time_unix_nano")),
            _as(_field(ev, "name"), pa.string()),
            attributes(_field(ev, "attributes"), counter),
            _as(_field(ev, "dropped_attributes_count"), pa.uint32()),
        ],
        fields=list(typ),
    )
    return pa.ListArray.from_arrays(_offsets(pc.list_value_length(lists)), child)


def _links(lists: pa.Array, counter: list[int], typ: pa.StructType) -> pa.ListArray:
    ln = pc.list_flatten(lists)
    child = pa.StructArray.from_arrays(
        [
            hex_ids(_field(ln, "trace_id")),
            hex_ids(_field(ln, "span_id")),
            _as(_field(ln, "trace_state"), pa.string()),
            _as(_field(ln, "flags"), pa.uint32()),
            attributes(_field(ln, "attributes"), counter),
            _as(_field(ln, "dropped_attributes_count"), pa.uint32()),
        ],
        fields=list(typ),
    )
    return pa.ListArray.from_arrays(_offsets(pc.list_value_length(lists)), child)


def spans_table(payloads: list[bytes], received_ns: list[int] | np.ndarray) -> Conversion:
    """Serialized ExportTraceServiceRequests (as the receiver validated them) and
    their arrival times, to one `spans` table."""
    schema = spans_schema.SCHEMA
    received = np.asarray(received_ns, dtype=np.int64)
    if not payloads:
        return Conversion(schema.empty_table(), np.zeros(0, np.int64))
    batch = _handler().list_to_record_batch(list(payloads))
    rs, rs_req = _flatten(batch.column("resource_spans"))
    ss, ss_rs = _flatten(_field(rs, "scope_spans"))
    sp, sp_ss = _flatten(_field(ss, "spans"))
    n = len(sp)
    if n == 0:
        return Conversion(schema.empty_table(), np.zeros(0, np.int64))
    sp_rs = ss_rs[sp_ss]
    counter = [0]

    resource = _field(rs, "resource")
    res_kv, res_parent = _flatten(_field(resource, "attributes"))
    service = _first_strings(res_kv, res_parent, len(rs), {"service": ("service.name",)})["service"]
    res_attrs = attributes(_field(resource, "attributes"), counter)
    scope = _field(ss, "scope")
    scope_attrs = attributes(_field(scope, "attributes"), counter)
    rs_take = pa.array(sp_rs, pa.int64())
    ss_take = pa.array(sp_ss, pa.int64())

    attrs_lists = _field(sp, "attributes")
    span_kv, span_parent = _flatten(attrs_lists)
    status = _field(sp, "status")
    start = _field(sp, "start_time_unix_nano")
    cols: dict[str, pa.Array] = {
        "trace_id": hex_ids(_field(sp, "trace_id")),
        "span_id": hex_ids(_field(sp, "span_id")),
        "parent_span_id": hex_ids(_field(sp, "parent_span_id"), empty_null=True),
        "trace_state": _field(sp, "trace_state"),
        "flags": _field(sp, "flags"),
        "name": _field(sp, "name"),
        "kind": _names(_field(sp, "kind"), _KINDS),
        "start_time": _timestamps(start),
        "end_time": _timestamps(_field(sp, "end_time_unix_nano")),
        "status_code": _names(_field(status, "code"), _STATUS),
        "status_message": _filled(_field(status, "message"), ""),
        "service_name": service.take(rs_take),
        "attributes": attributes(attrs_lists, counter),
        "dropped_attributes_count": _field(sp, "dropped_attributes_count"),
        "events": _events(_field(sp, "events"), counter, schema.field("events").type.value_type),
        "dropped_events_count": _field(sp, "dropped_events_count"),
        "links": _links(_field(sp, "links"), counter, schema.field("links").type.value_type),
        "dropped_links_count": _field(sp, "dropped_links_count"),
        "resource_attributes": res_attrs.take(rs_take),
        "resource_dropped_attributes_count": _filled(_field(resource, "dropped_attributes_count"), 0).take(rs_take),
        "resource_schema_url": _field(rs, "schema_url").take(rs_take),
        "scope_name": _filled(_field(scope, "name"), "").take(ss_take),
        "scope_version": _filled(_field(scope, "version"), "").take(ss_take),
        "scope_attributes": scope_attrs.take(ss_take),
        "scope_dropped_attributes_count": _filled(_field(scope, "dropped_attributes_count"), 0).take(ss_take),
        "scope_schema_url": _field(ss, "schema_url").take(ss_take),
    }
    req_of_span = rs_req[sp_rs]
    cols["received_time"] = pa.array(received[req_of_span], pa.int64()).cast(TIMESTAMP)
    cols.update(_first_strings(span_kv, span_parent, n, spans_schema.PROMOTED))
    starts = np.asarray(start.cast(pa.int64()).to_numpy(zero_copy_only=False), dtype=np.int64)
    dates = np.where(starts != 0, starts, received[req_of_span])
    arrays = [cols[f.name].cast(f.type) if cols[f.name].type != f.type else cols[f.name] for f in schema]
    return Conversion(pa.Table.from_arrays(arrays, schema=schema), dates, counter[0])
