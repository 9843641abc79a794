"""The columnar OTLP -> `spans` converter gives the same table, value for value,
as the per-span Python converter it replaced, on the fuzz campaign's requests:
every AnyValue type (empty ones, NaN and infinities, bytes, arrays and
key-value lists nested deep), odd kinds and status codes, events, links,
several resources and scopes per request, and the receiver's validation first."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue

from nightshift.collector import validate
from nightshift.collector.convert import SpanBuilder
from nightshift.collector.otlp_arrow import spans_table
from support.reference_convert import ReferenceSpanBuilder

from hardening import cases  # noqa: E402


def _both(payloads: list[bytes], received: list[int]):
    ref = ReferenceSpanBuilder()
    for p, r in zip(payloads, received):
        ref.add_request(ExportTraceServiceRequest.FromString(p), r)
    return ref.table(), np.asarray(ref.dates, dtype=np.int64), spans_table(payloads, received)


def _nan_free(v):
    """NaN as a marker (NaN != NaN would fail the comparison of equal tables)."""
    if isinstance(v, float) and math.isnan(v):
        return "<nan>"
    if isinstance(v, list):
        return [_nan_free(x) for x in v]
    if isinstance(v, dict):
        return {k: _nan_free(x) for k, x in v.items()}
    return v


def _same(ref: pa.Table, got: pa.Table) -> None:
    assert got.schema.equals(ref.schema, check_metadata=True)
    for name in ref.column_names:
        if not got[name].equals(ref[name]):
            r, g = _nan_free(ref[name].to_pylist()), _nan_free(got[name].to_pylist())
            bad = next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), None)
            assert r == g, (name, bad, r[bad] if bad is not None else None, g[bad] if bad is not None else None)


def _valid(req: ExportTraceServiceRequest) -> bytes:
    validate.filter_traces(req)  # what the receiver logs: the request with its bad spans removed
    return req.SerializeToString()


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_requests_convert_exactly_as_span_by_span(seed):
    rng = random.Random(seed)
    payloads = [_valid(cases.trace_request(rng)) for _ in range(rng.randrange(1, 6))]
    received = [1_700_000_000_000_000_000 + i for i in range(len(payloads))]
    ref, ref_dates, conv = _both(payloads, received)
    assert ref.num_rows > 0
    _same(ref, conv.table)
    assert (conv.dates == ref_dates).all()


def test_deeply_nested_arrays_and_kvlists_and_rare_items_take_the_counted_python_path():
    rng = random.Random(7)
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    for depth in (1, 10, 20):  # deeper: refused by the receiver's decoder (upb's depth limit)
        for kvlist in (False, True):
            raw = cases._base_span(rng).SerializeToString() + cases._ld(
                9, cases._ld(1, b"deep") + cases._ld(2, cases.nested_value(depth, kvlist)))
            span = ss.spans.add()
            span.MergeFromString(raw)
    simple = ss.spans.add()
    simple.MergeFrom(cases._base_span(rng))
    simple.attributes.append(KeyValue(key="reasons", value=AnyValue(array_value=ArrayValue(values=[
        AnyValue(string_value='st"op\n'), AnyValue(int_value=-3), AnyValue(bool_value=False), AnyValue(string_value="")]))))
    simple.attributes.append(KeyValue(key="doubles", value=AnyValue(array_value=ArrayValue(values=[
        AnyValue(double_value=float("nan")), AnyValue(double_value=1e16)]))))
    simple.attributes.append(KeyValue(key="empty", value=AnyValue(array_value=ArrayValue())))
    ref, _, conv = _both([req.SerializeToString()], [1])
    _same(ref, conv.table)
    # the three kvlists, the arrays of arrays (depth 10, 20) and the array of doubles: Python;
    # arrays of strings, ints and bools (the depth-1 one, `reasons`) and the empty array: Arrow
    assert conv.nested_values == 6
    attrs = {a["key"]: a["value"]["json_value"] for a in conv.table["attributes"][6].as_py()}
    assert attrs["reasons"] == '["st\\"op\\n",-3,false,""]' and attrs["empty"] == "[]"
    assert attrs["doubles"] == '["NaN",1e+16]'


def test_huge_requests_and_an_empty_one():
    rng = random.Random(3)
    req = ExportTraceServiceRequest()
    ss = req.resource_spans.add().scope_spans.add()
    s = cases._base_span(rng)
    s.attributes.extend(KeyValue(key=f"k{i}", value=AnyValue(int_value=i)) for i in range(20000))
    for i in range(2000):
        s.events.add(name="e", time_unix_nano=cases.T0 + i)
    ss.spans.append(s)
    for _ in range(3000):
        ss.spans.append(cases._base_span(rng))
    empty = ExportTraceServiceRequest()
    empty.resource_spans.add().scope_spans.add()
    payloads = [req.SerializeToString(), empty.SerializeToString(), b""]
    ref, ref_dates, conv = _both(payloads, [5, 6, 7])
    _same(ref, conv.table)
    assert conv.table.num_rows == 3001 and (conv.dates == ref_dates).all()


def test_the_builder_gathers_payloads_and_converts_once():
    rng = random.Random(11)
    sb = SpanBuilder()
    reqs = [cases.trace_request(rng) for _ in range(3)]
    for i, r in enumerate(reqs):
        sb.add_request(r, 100 + i)
    assert len(sb) == 3 and sb.nbytes == sum(r.ByteSize() for r in reqs)
    table = sb.table()
    assert table.num_rows == sum(len(ss.spans) for r in reqs for rs in r.resource_spans for ss in rs.scope_spans)
    assert len(sb.dates) == table.num_rows


def test_promoted_columns_pick_the_first_listed_name_then_a_rows_first_string():
    """The promoted columns (model, provider with its old name, ...) and service.name
    are found in one pass over the keys: same picks as span by span whatever the
    order, repeats and types of the keys."""
    rng = random.Random(3)
    req = ExportTraceServiceRequest()
    layouts = [
        [("gen_ai.system", "old"), ("gen_ai.provider.name", "new")],  # the first listed name wins, wherever it is
        [("gen_ai.provider.name", 7), ("gen_ai.system", "old"), ("gen_ai.provider.name", "late")],  # not a string
        [("gen_ai.request.model", "a"), ("gen_ai.request.model", "b")],  # a row's first occurrence
        [],
        [("gen_ai.conversation.id", "c1"), ("gen_ai.agent.name", "agent"), ("gen_ai.operation.name", "chat")],
    ]
    for service in ("svc", 5, None):
        rs = req.resource_spans.add()
        if service is not None:
            value = AnyValue(string_value=service) if isinstance(service, str) else AnyValue(int_value=service)
            rs.resource.attributes.append(KeyValue(key="service.name", value=value))
        ss = rs.scope_spans.add()
        for attrs in layouts:
            span = ss.spans.add()
            span.CopyFrom(cases._base_span(rng))
            for key, v in attrs:
                value = AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v)
                span.attributes.append(KeyValue(key=key, value=value))
    ref, _, conv = _both([_valid(req)], [1_700_000_000_000_000_000])
    _same(ref, conv.table)
    assert conv.table["gen_ai_provider_name"].to_pylist()[:2] == ["new", "late"]
    assert conv.table["service_name"].to_pylist()[::5] == ["svc", None, None]
