"""Build span datasets for transform tests through the collector's own path
(OTLP protobuf -> SpanBuilder -> DatasetStore), from compact Python descriptions.

    t = Trace()                       # one trace id
    root = t.span("agent run", attrs={...})
    t.span("chat gpt", parent=root, attrs={...}, start=1.0, end=2.0)
    write_spans(data_dir, [t])
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from nightshift.collector.convert import LogBuilder, SpanBuilder
from nightshift.collector.datasets import DatasetStore

T0 = 1_763_800_000_000_000_000  # 2025-11-22T08:26:40Z


def any_value(v: Any) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, str):
        return AnyValue(string_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[any_value(x) for x in v]))
    if isinstance(v, dict):
        return AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key=k, value=any_value(x)) for k, x in v.items()]))
    raise TypeError(type(v))


@dataclass
class SpanSpec:
    span_id: bytes
    name: str
    parent: bytes | None
    attrs: dict
    start: float
    end: float | None
    dropped: int = 0
    links: list = field(default_factory=list)  # (trace id, span id) bytes of the spans it links to


@dataclass
class Trace:
    seed: str = ""
    spans: list[SpanSpec] = field(default_factory=list)
    service: str = "agent"
    trace_id: bytes = b""
    scope: str = ""  # the instrumentation library's name

    def __post_init__(self) -> None:
        self.trace_id = hashlib.sha256(("trace" + self.seed).encode()).digest()[:16] if self.seed else os.urandom(16)

    def span(self, name: str, attrs: dict | None = None, *, parent: bytes | None = None, start: float = 0.0,
             end: float | None = 1.0, dropped: int = 0, links: list | None = None) -> bytes:
        sid = hashlib.sha256(self.trace_id + str(len(self.spans)).encode()).digest()[:8]
        self.spans.append(SpanSpec(sid, name, parent, dict(attrs or {}), start, end, dropped, list(links or [])))
        return sid

    @property
    def hex(self) -> str:
        return self.trace_id.hex()


def request(traces: list[Trace], base_ns: int = T0) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    for t in traces:
        rs = req.resource_spans.add()
        rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=t.service)))
        ss = rs.scope_spans.add()
        ss.scope.name = t.scope
        for s in t.spans:
            sp = Span(trace_id=t.trace_id, span_id=s.span_id, name=s.name, kind=3,
                      start_time_unix_nano=base_ns + int(s.start * 1e9),
                      end_time_unix_nano=0 if s.end is None else base_ns + int(s.end * 1e9),
                      dropped_attributes_count=s.dropped)
            if s.parent:
                sp.parent_span_id = s.parent
            for k, v in s.attrs.items():
                sp.attributes.append(KeyValue(key=k, value=any_value(v)))
            for tid, sid in s.links:
                link = sp.links.add()
                link.trace_id, link.span_id = tid, sid
            ss.spans.append(sp)
    return req


def write_spans(data: str, traces: list[Trace], *, batch: str = "b1", base_ns: int = T0, received_ns: int | None = None) -> None:
    sb = SpanBuilder()
    sb.add_request(request(traces, base_ns), received_ns if received_ns is not None else base_ns + 10**10)
    w = DatasetStore(str(data)).writer("spans", batch)
    w.add(sb.table(), sb.dates)
    w.commit()


def write_logs(data: str, events: list[dict], *, batch: str = "l1", base_ns: int = T0) -> None:
    """`events`: `{"trace": Trace, "span": bytes, "name": str, "body": value, "attrs": {}}`."""
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value="agent")))
    sl = rl.scope_logs.add()
    for i, e in enumerate(events):
        r = sl.log_records.add()
        r.time_unix_nano = base_ns + i
        r.event_name = e["name"]
        r.trace_id = e["trace"].trace_id
        r.span_id = e["span"]
        if e.get("body") is not None:
            r.body.CopyFrom(any_value(e["body"]))
        for k, v in (e.get("attrs") or {}).items():
            r.attributes.append(KeyValue(key=k, value=any_value(v)))
    lb = LogBuilder()
    lb.add_request(req, base_ns + 10**10)
    w = DatasetStore(str(data)).writer("logs", batch)
    w.add(lb.table(), lb.dates)
    w.commit()


def genai_call(user: str, answer: str | None = None, *, tool_call: tuple[str, str, dict] | None = None,
               history: list[dict] | None = None, model: str = "m1", tools: list[dict] | None = None) -> dict:
    """Attributes of a GenAI-semconv chat span (JSON messages on the span)."""
    msgs = list(history or []) + [{"role": "user", "parts": [{"type": "text", "content": user}]}]
    parts = []
    if answer is not None:
        parts.append({"type": "text", "content": answer})
    if tool_call:
        cid, name, args = tool_call
        parts.append({"type": "tool_call", "id": cid, "name": name, "arguments": args})
    out = [{"role": "assistant", "parts": parts, "finish_reason": "tool_call" if tool_call else "stop"}]
    a = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": model,
         "gen_ai.response.model": model, "gen_ai.input.messages": json.dumps(msgs),
         "gen_ai.output.messages": json.dumps(out), "gen_ai.usage.input_tokens": 10, "gen_ai.usage.output_tokens": 3}
    if tools:
        a["gen_ai.tool.definitions"] = json.dumps(tools)
    return a


def agent_run(trace_id: str, i: int, *, calls: int, task: str, reward: float, answer: str = "answer {k}") -> Trace:
    """One agent run as the build tests write it: an `invoke_agent a` root at second
    `i`, `calls` chat calls under it (`answer` formatted with the call's index `k`) and
    Agent Lightning's reward annotation at the end."""
    t = Trace(trace_id)
    root = t.span("invoke_agent a", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"},
                  start=i, end=i + 30)
    for k in range(calls):
        t.span("chat m", genai_call(task, answer.format(k=k)), parent=root, start=i + 1 + k, end=i + 2 + k)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "r", "agentlightning.reward.0.value": reward},
           parent=root, start=i + 25, end=i + 26)
    return t
