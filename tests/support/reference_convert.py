"""The per-span OTLP -> `spans` converter the flusher used before the columnar one
(collector/otlp_arrow.py): Python over the protobuf objects, one span and one
attribute at a time. Kept here as the oracle the columnar converter must match,
value for value (tests/test_otlp_arrow.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from nightshift.collector.convert import _KINDS, _STATUS, _Attrs, _SharedAttrs, _ts, service_name
from nightshift.schemas import spans as spans_schema


class ReferenceSpanBuilder:
    def __init__(self) -> None:
        self.cols: dict[str, list] = {
            f.name: [] for f in spans_schema.SCHEMA if f.type != spans_schema.ATTRIBUTES and f.name not in spans_schema.PROMOTED
        }
        self.attrs = _Attrs()
        self.res_attrs = _SharedAttrs()
        self.scope_attrs = _SharedAttrs()
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
            service = service_name(res)
            res_group = self.res_attrs.group(res.attributes)
            for ss in rs.scope_spans:
                scope = ss.scope
                scope_group = self.scope_attrs.group(scope.attributes)
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
                    self.res_attrs.rows.append(res_group)
                    c["resource_dropped_attributes_count"].append(res.dropped_attributes_count)
                    c["resource_schema_url"].append(rs.schema_url)
                    c["scope_name"].append(scope.name)
                    c["scope_version"].append(scope.version)
                    self.scope_attrs.rows.append(scope_group)
                    c["scope_dropped_attributes_count"].append(scope.dropped_attributes_count)
                    c["scope_schema_url"].append(ss.schema_url)
                    c["received_time"].append(received_ns)
                    self.dates.append(s.start_time_unix_nano or received_ns)

    def _promoted(self) -> dict[str, pa.Array]:
        """The GenAI columns, found in the attribute arrays with numpy rather than
        by a second Python loop over every attribute."""
        n = len(self.dates)
        keys = np.asarray(self.attrs.keys, dtype=object)
        codes = np.asarray(self.attrs.values.codes, dtype=np.int8)
        vals = self.attrs.values.vals
        offsets = np.asarray(self.attrs.offsets, dtype=np.int64)
        out = {}
        for col, names in spans_schema.PROMOTED.items():
            column = np.full(n, None, dtype=object)
            for name in reversed(names):  # the first name listed wins
                hits = np.flatnonzero((keys == name) & (codes == 1))[::-1]  # a row's first occurrence wins
                if len(hits):
                    rows = np.searchsorted(offsets, hits, side="right") - 1
                    column[rows] = [vals[i] for i in hits]
            out[col] = pa.array(column, pa.string())
        return out

    def table(self) -> pa.Table:
        schema = spans_schema.SCHEMA
        promoted = self._promoted()
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
            elif f.name in promoted:
                arrays.append(promoted[f.name])
            else:
                arrays.append(pa.array(self.cols[f.name], f.type))
        return pa.Table.from_arrays(arrays, schema=schema)
