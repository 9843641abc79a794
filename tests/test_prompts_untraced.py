"""The proposer's own calls never enter the lake as agent traffic, even when a user
runs Nightshift under `opentelemetry-instrument`.

The contrib HTTP client instrumentations are not installed here, so the test puts
in their place what each of them does to `http.client` (the layer every Python HTTP
client ends in): start a CLIENT span with the HTTP attributes and inject
`traceparent` into the request, unless the suppression flags of the current context
are set. First a control (the harness does trace an ordinary call), then the
proposer under it (no span, no header), then the worst case, an instrumentation
that ignores the flags: its spans reach the lake beside a real agent's, and the
build makes rows of the agent's call only."""

from __future__ import annotations

import http.client
import json

import polars as pl
import pytest
from opentelemetry import context, propagate
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from nightshift.collector.convert import SpanBuilder
from nightshift.collector.datasets import DatasetStore
from nightshift.prompts.propose import propose
from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig
from support.proposer_standin import Standin
from test_prompts_propose import config, make_lake
from traces import Trace, genai_call, write_spans


@pytest.fixture
def instrumented(monkeypatch):
    """(tracer, exporter, set_honour): http.client instrumented the way the contrib packages do it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "nightshift"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("opentelemetry.instrumentation.http_client_standin")
    honour = {"flags": True}
    original = http.client.HTTPConnection.request

    def request(self, method, url, body=None, headers=None, **kw):
        suppressed = (context.get_value(context._SUPPRESS_INSTRUMENTATION_KEY)
                      or context.get_value(context._SUPPRESS_HTTP_INSTRUMENTATION_KEY))
        if suppressed and honour["flags"]:
            return original(self, method, url, body, headers or {}, **kw)
        headers = dict(headers or {})
        attrs = {"http.request.method": method, "http.method": method, "server.address": self.host,
                 "server.port": self.port, "url.full": f"http://{self.host}:{self.port}{url}",
                 "http.url": f"http://{self.host}:{self.port}{url}"}
        with tracer.start_as_current_span(method, kind=SpanKind.CLIENT, attributes=attrs):
            propagate.inject(headers)
            return original(self, method, url, body, headers, **kw)

    monkeypatch.setattr(http.client.HTTPConnection, "request", request)
    yield tracer, exporter, honour
    provider.shutdown()


def _post(url: str, body: dict) -> None:
    host, port = url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    conn.getresponse().read()
    conn.close()


def test_the_harness_traces_an_ordinary_call(instrumented):
    tracer, exporter, _ = instrumented
    with Standin() as s, tracer.start_as_current_span("a user's own code"):
        _post(s.url, {"messages": []})
    assert "traceparent" in s.requests[0]["headers"]
    assert [sp.name for sp in exporter.get_finished_spans()] == ["POST", "a user's own code"]


def test_the_proposer_sends_no_trace_context_and_makes_no_span(instrumented, tmp_path):
    tracer, exporter, _ = instrumented
    make_lake(tmp_path / "data")
    with Standin() as s, tracer.start_as_current_span("nightshift prompts propose"):
        rnd = propose(config(tmp_path / "data", s), "solver", salt="n")
    assert rnd.stored and len(s.requests) == 3
    assert not any("traceparent" in r["headers"] for r in s.requests)
    assert [sp.name for sp in exporter.get_finished_spans()] == ["nightshift prompts propose"]


def test_a_lake_holding_nightshifts_own_spans_builds_no_proposer_rows(instrumented, tmp_path):
    """Worst case: an instrumentation that ignores the flags traces every proposer call."""
    tracer, exporter, honour = instrumented
    honour["flags"] = False
    make_lake(tmp_path / "lake")
    with Standin() as s, tracer.start_as_current_span("nightshift prompts propose"):
        propose(config(tmp_path / "lake", s), "solver", salt="n")
    spans = exporter.get_finished_spans()
    assert len(spans) == 4 and all("traceparent" in r["headers"] for r in s.requests)
    data = tmp_path / "data"
    agent = Trace(seed="agent")
    root = agent.span("invoke_agent helper", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "helper"})
    agent.span("chat m1", genai_call("hi", "hello"), parent=root)
    write_spans(str(data), [agent])
    sb = SpanBuilder()
    req = encode_spans(spans)
    sb.add_request(req, spans[0].end_time + 10**9)
    w = DatasetStore(str(data)).writer("spans", "nightshift-own")
    w.add(sb.table(), sb.dates)
    w.commit()
    assert pl.read_parquet(str(data / "spans" / "**" / "*.parquet")).height == 2 + 4
    build(TransformConfig(data=str(data), settle=0))
    rows = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"))
    assert rows["agent_name"].to_list() == ["helper"]  # the agent's call, and nothing of the proposer's
