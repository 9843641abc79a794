"""WAL segments to Parquet: every field kept, keys stored once, crash-safe redo."""

from __future__ import annotations

import base64
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

import fsspec
import polars as pl
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from conftest import read_dataset, read_logs, read_spans
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from nightshift import schemas
from nightshift.collector import datasets, wal
from nightshift.collector.datasets import DatasetStore
from nightshift.collector.flusher import flush_segment

TRACE = bytes.fromhex("5b8efff798038103d269b633813fc60c")
ROOT = bytes.fromhex("eee19b7ec3c1b173")
CHILD = bytes.fromhex("EEE19B7EC3C1B174")
LINK_TRACE = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
LINK_SPAN = bytes.fromhex("b7ad6b7169203331")

# 2026-11-20T10:00:00.123456789Z and later
T0 = int(datetime(2026, 11, 20, 10, 0, tzinfo=timezone.utc).timestamp()) * 10**9 + 123_456_789
DAY = 86_400 * 10**9
RECEIVED = T0 + 5 * 10**9


def _kv(key: str, **value) -> KeyValue:
    kv = KeyValue(key=key)
    for k, v in value.items():
        setattr(kv.value, k, v)
    return kv


def full_request() -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.schema_url = "https://opentelemetry.io/schemas/1.26.0"
    rs.resource.attributes.append(_kv("service.name", string_value="agent-svc"))
    rs.resource.attributes.append(_kv("host.cores", int_value=8))
    rs.resource.dropped_attributes_count = 2
    ss = rs.scope_spans.add()
    ss.schema_url = "https://scope/schema"
    ss.scope.name = "openai-instrumentation"
    ss.scope.version = "0.9"
    ss.scope.attributes.append(_kv("scope.attr", bool_value=True))
    ss.scope.dropped_attributes_count = 1

    root = ss.spans.add()
    root.trace_id, root.span_id = TRACE, ROOT
    root.name = "invoke_agent"
    root.kind = Span.SPAN_KIND_SERVER
    root.start_time_unix_nano = T0
    root.end_time_unix_nano = T0 + 2_000_000_000
    root.status.code = Status.STATUS_CODE_OK
    root.attributes.append(_kv("gen_ai.system", string_value="openai"))  # old name only: the fallback
    root.attributes.append(_kv("gen_ai.agent.name", string_value="planner"))

    s = ss.spans.add()
    s.trace_id, s.span_id, s.parent_span_id = TRACE, CHILD, ROOT
    s.trace_state = "vendor=x"
    s.flags = 0x101
    s.name = "chat gpt-4o"
    s.kind = Span.SPAN_KIND_CLIENT
    s.start_time_unix_nano = T0 + 1000
    s.end_time_unix_nano = T0 + 1_000_000_000
    s.status.code = Status.STATUS_CODE_ERROR
    s.status.message = "rate limited"
    a = s.attributes
    a.append(_kv("gen_ai.system", string_value="legacy-name"))  # loses to provider.name
    a.append(_kv("gen_ai.provider.name", string_value="openai"))
    a.append(_kv("gen_ai.operation.name", string_value="chat"))
    a.append(_kv("gen_ai.request.model", string_value="gpt-4o"))
    a.append(_kv("gen_ai.response.model", string_value="gpt-4o-2024-08-06"))
    a.append(_kv("gen_ai.conversation.id", string_value="conv-1"))
    a.append(_kv("gen_ai.usage.input_tokens", int_value=1234))
    a.append(_kv("temperature", double_value=0.25))
    a.append(_kv("stream", bool_value=False))
    a.append(_kv("blob", bytes_value=b"\x00\x01\xff"))
    arr = a.add(key="gen_ai.response.finish_reasons").value.array_value.values
    arr.add().string_value = "stop"
    arr.add().int_value = 3
    arr.add().bytes_value = b"\xff"
    kvl = a.add(key="meta").value.kvlist_value.values
    kvl.append(_kv("nested", string_value="yes"))
    kvl.append(_kv("ratio", double_value=float("inf")))
    a.add(key="empty_value")
    s.dropped_attributes_count = 4
    ev = s.events.add()
    ev.time_unix_nano = T0 + 500
    ev.name = "gen_ai.choice"
    ev.attributes.append(_kv("index", int_value=0))
    ev.dropped_attributes_count = 6
    s.events.add().name = "no-time"
    s.dropped_events_count = 7
    ln = s.links.add()
    ln.trace_id, ln.span_id = LINK_TRACE, LINK_SPAN
    ln.trace_state = "t=s"
    ln.flags = 1
    ln.attributes.append(_kv("link.kind", string_value="follows"))
    ln.dropped_attributes_count = 9
    s.dropped_links_count = 10
    return req


def span_request(*specs, service: str = "svc") -> ExportTraceServiceRequest:
    """specs: (trace_id bytes, span_id bytes, start ns, name)."""
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("service.name", string_value=service))
    ss = rs.scope_spans.add()
    for trace_id, span_id, start, name in specs:
        sp = ss.spans.add()
        sp.trace_id, sp.span_id, sp.name = trace_id, span_id, name
        sp.start_time_unix_nano = start
        sp.end_time_unix_nano = start + 1 if start else 0
    return req


def log_request(*bodies, trace_id: bytes = b"", span_id: bytes = b"", time_ns: int = T0) -> ExportLogsServiceRequest:
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.append(_kv("service.name", string_value="logsvc"))
    sl = rl.scope_logs.add()
    sl.scope.name = "logger"
    for i, body in enumerate(bodies):
        r = sl.log_records.add()
        r.time_unix_nano = time_ns + i
        r.observed_time_unix_nano = time_ns + i + 1
        r.severity_number = 9
        r.severity_text = "INFO"
        r.trace_id, r.span_id = trace_id, span_id
        if body is not None:
            r.body.CopyFrom(body)
    return req


class Segments:
    """Writes WAL segment files the way the WAL does."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.next_id = 1_000

    def write(self, *messages, received: int = RECEIVED) -> Path:
        self.next_id += 1
        p = self.dir / f"{self.next_id:020d}{wal.SEALED}"
        body = wal.MAGIC
        for m in messages:
            kind = wal.KIND_TRACES if isinstance(m, ExportTraceServiceRequest) else wal.KIND_LOGS
            body += wal.encode_record(kind, received, m.SerializeToString())
        p.write_bytes(body)
        return p


@pytest.fixture
def segs(tmp_path) -> Segments:
    return Segments(tmp_path / "wal")


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"


def _attrs(cell) -> dict:
    return {a["key"]: a["value"] for a in cell}


def test_every_span_field_survives(segs, data):
    seg = segs.write(full_request())
    res = flush_segment(seg, DatasetStore(str(data)))
    assert (res.spans, res.logs, res.duplicates, res.files) == (2, 0, 0, 1)
    expected_file = data / "spans" / "date=2026-11-20" / f"part-{seg.name.split('.')[0]}.parquet"
    assert expected_file.exists()
    assert not list(data.rglob("*.tmp-*"))

    meta = pq.read_schema(expected_file).metadata
    assert meta[b"nightshift.schema_version"] == schemas.SCHEMA_VERSION.encode()
    assert meta[b"nightshift.schema"] == b"spans"
    assert pq.read_schema(expected_file).remove_metadata() == schemas.spans.SCHEMA.remove_metadata()

    df = read_spans(data)
    assert df.height == 2
    rows = {r["name"]: r for r in df.to_dicts()}
    root, chat = rows["invoke_agent"], rows["chat gpt-4o"]

    assert root["trace_id"] == TRACE.hex() and chat["trace_id"] == TRACE.hex()
    assert chat["span_id"] == "eee19b7ec3c1b174"  # lowercase
    assert root["parent_span_id"] is None
    assert chat["parent_span_id"] == ROOT.hex()
    assert (root["kind"], root["status_code"]) == ("server", "ok")
    assert (chat["kind"], chat["status_code"], chat["status_message"]) == ("client", "error", "rate limited")
    assert chat["trace_state"] == "vendor=x" and chat["flags"] == 0x101
    assert str(df.schema["start_time"]) == str(pl.Datetime("ns", "UTC"))
    ns = df.select(pl.col("name"), pl.col("start_time").dt.epoch("ns"), pl.col("end_time").dt.epoch("ns"),
                   pl.col("received_time").dt.epoch("ns"))
    ns = {r["name"]: r for r in ns.to_dicts()}
    assert ns["chat gpt-4o"]["start_time"] == T0 + 1000  # nanoseconds kept
    assert ns["chat gpt-4o"]["end_time"] == T0 + 1_000_000_000
    assert ns["invoke_agent"]["received_time"] == RECEIVED
    assert chat["service_name"] == "agent-svc"
    assert str(chat["date"]) == "2026-11-20"

    # promoted GenAI columns
    assert chat["gen_ai_provider_name"] == "openai"
    assert root["gen_ai_provider_name"] == "openai"  # from gen_ai.system
    assert chat["gen_ai_operation_name"] == "chat"
    assert chat["gen_ai_request_model"] == "gpt-4o"
    assert chat["gen_ai_response_model"] == "gpt-4o-2024-08-06"
    assert chat["gen_ai_conversation_id"] == "conv-1"
    assert root["gen_ai_agent_name"] == "planner" and chat["gen_ai_agent_name"] is None
    assert root["gen_ai_request_model"] is None

    # attributes keep their order and types
    assert [a["key"] for a in chat["attributes"]][:3] == ["gen_ai.system", "gen_ai.provider.name", "gen_ai.operation.name"]
    at = _attrs(chat["attributes"])
    assert at["gen_ai.usage.input_tokens"]["type"] == "int" and at["gen_ai.usage.input_tokens"]["int_value"] == 1234
    assert at["gen_ai.usage.input_tokens"]["string_value"] is None
    assert at["temperature"]["type"] == "double" and at["temperature"]["double_value"] == 0.25
    assert at["stream"]["type"] == "bool" and at["stream"]["bool_value"] is False
    assert at["blob"]["type"] == "bytes" and at["blob"]["bytes_value"] == b"\x00\x01\xff"
    assert at["gen_ai.request.model"]["type"] == "string" and at["gen_ai.request.model"]["string_value"] == "gpt-4o"
    fr = at["gen_ai.response.finish_reasons"]
    assert fr["type"] == "array"
    assert json.loads(fr["json_value"]) == ["stop", 3, base64.b64encode(b"\xff").decode()]
    meta_attr = at["meta"]
    assert meta_attr["type"] == "kvlist"
    assert json.loads(meta_attr["json_value"]) == {"nested": "yes", "ratio": "Infinity"}
    assert at["empty_value"]["type"] == "empty"
    assert chat["dropped_attributes_count"] == 4

    # events and links
    assert [e["name"] for e in chat["events"]] == ["gen_ai.choice", "no-time"]
    ev = chat["events"][0]
    assert _attrs(ev["attributes"])["index"]["int_value"] == 0
    assert ev["dropped_attributes_count"] == 6
    assert chat["events"][1]["time"] is None
    ev_ns = df.filter(pl.col("name") == "chat gpt-4o").select(
        pl.col("events").list.first().struct.field("time").dt.epoch("ns")).item()
    assert ev_ns == T0 + 500
    assert chat["dropped_events_count"] == 7
    (link,) = chat["links"]
    assert (link["trace_id"], link["span_id"]) == (LINK_TRACE.hex(), LINK_SPAN.hex())
    assert (link["trace_state"], link["flags"], link["dropped_attributes_count"]) == ("t=s", 1, 9)
    assert _attrs(link["attributes"])["link.kind"]["string_value"] == "follows"
    assert chat["dropped_links_count"] == 10
    assert root["events"] == [] and root["links"] == []

    # resource and scope
    res = _attrs(chat["resource_attributes"])
    assert res["service.name"]["string_value"] == "agent-svc" and res["host.cores"]["int_value"] == 8
    assert chat["resource_dropped_attributes_count"] == 2
    assert chat["resource_schema_url"] == "https://opentelemetry.io/schemas/1.26.0"
    assert (chat["scope_name"], chat["scope_version"]) == ("openai-instrumentation", "0.9")
    assert _attrs(chat["scope_attributes"])["scope.attr"]["bool_value"] is True
    assert chat["scope_dropped_attributes_count"] == 1
    assert chat["scope_schema_url"] == "https://scope/schema"


def test_attr_expression_reads_typed_attributes(segs, data):
    flush_segment(segs.write(full_request()), DatasetStore(str(data)))
    lf = pl.scan_parquet(str(data / "spans" / "**" / "*.parquet"), hive_partitioning=True)
    out = (
        lf.select(
            "name",
            schemas.attr("gen_ai.usage.input_tokens", "int"),
            schemas.attr("temperature", "double"),
            schemas.attr("stream", "bool"),
            schemas.attr("blob", "bytes"),
            schemas.attr("gen_ai.request.model"),
            schemas.attr("meta", "kvlist"),
            schemas.attr("gen_ai.response.finish_reasons", "array"),
            schemas.attr("service.name", column="resource_attributes").alias("svc"),
            schemas.attr("scope.attr", "bool", column="scope_attributes").alias("scope_attr"),
        )
        .sort("name")
        .collect()
    )
    chat, root = out.row(0, named=True), out.row(1, named=True)
    assert chat["name"] == "chat gpt-4o"
    assert chat["gen_ai.usage.input_tokens"] == 1234
    assert chat["temperature"] == 0.25
    assert chat["stream"] is False
    assert chat["blob"] == b"\x00\x01\xff"
    assert chat["gen_ai.request.model"] == "gpt-4o"
    assert json.loads(chat["meta"])["nested"] == "yes"
    assert json.loads(chat["gen_ai.response.finish_reasons"])[0] == "stop"
    assert chat["svc"] == "agent-svc" and chat["scope_attr"] is True
    assert root["gen_ai.usage.input_tokens"] is None and root["gen_ai.request.model"] is None
    assert out.schema["gen_ai.usage.input_tokens"] == pl.Int64


def test_same_span_in_two_segments_is_stored_once(segs, data):
    store = DatasetStore(str(data))
    a = segs.write(span_request((TRACE, ROOT, T0, "root"), (TRACE, CHILD, T0 + 1, "child")))
    b = segs.write(span_request((TRACE, CHILD, T0 + 1, "child-resent"), (TRACE, LINK_SPAN, T0 + 2, "new")))
    r1 = flush_segment(a, store)
    r2 = flush_segment(b, store)
    assert (r1.spans, r1.duplicates) == (2, 0)
    assert (r2.spans, r2.duplicates) == (1, 1)
    df = read_spans(data)
    assert df.height == 3
    assert sorted(df["name"].to_list()) == ["child", "new", "root"]  # the first copy wins
    # a fresh store (a restarted flusher) sees what is on disk
    c = segs.write(span_request((TRACE, ROOT, T0, "root-again")))
    r3 = flush_segment(c, DatasetStore(str(data)))
    assert (r3.spans, r3.duplicates, r3.files) == (0, 1, 0)
    assert read_spans(data).height == 3


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 1])
def test_same_span_twice_in_one_segment_is_stored_once(segs, data, chunk_bytes):
    req = span_request((TRACE, ROOT, T0, "root"))
    twice_in_one_request = span_request((TRACE, CHILD, T0, "x"), (TRACE, CHILD, T0, "x"))
    seg = segs.write(req, req, twice_in_one_request)
    res = flush_segment(seg, DatasetStore(str(data)), chunk_bytes=chunk_bytes)
    assert res.spans == 2
    df = read_spans(data)
    assert df.height == 2
    assert df.select(pl.struct("trace_id", "span_id").n_unique()).item() == 2


@pytest.mark.parametrize("chunk_bytes", [16 << 20, 1])
def test_duplicates_within_a_segment_are_counted(segs, data, chunk_bytes):
    req = span_request((TRACE, ROOT, T0, "root"))
    twice_in_one_request = span_request((TRACE, CHILD, T0, "x"), (TRACE, CHILD, T0, "x"))
    seg = segs.write(req, req, twice_in_one_request)
    res = flush_segment(seg, DatasetStore(str(data)), chunk_bytes=chunk_bytes)
    assert (res.spans, res.duplicates) == (2, 2)  # 4 spans in, 2 stored, 2 dropped


def test_same_span_id_in_another_trace_is_not_a_duplicate(segs, data):
    seg = segs.write(span_request((TRACE, ROOT, T0, "a"), (LINK_TRACE, ROOT, T0, "b")))
    res = flush_segment(seg, DatasetStore(str(data)))
    assert (res.spans, res.duplicates) == (2, 0)


def test_redo_after_crash_mid_flush_adds_no_duplicates(segs, data):
    a = segs.write(span_request(*[(TRACE, i.to_bytes(8, "big"), T0 + i, f"s{i}") for i in range(1, 51)]))
    b = segs.write(span_request(*[(TRACE, i.to_bytes(8, "big"), T0 + i, f"s{i}") for i in range(40, 61)]))
    first = flush_segment(a, DatasetStore(str(data)))
    assert first.spans == 50
    files_before = sorted(data.rglob("*.parquet"))
    # crash: the files of `a` are written, but `a` is still in the WAL with `b`
    pending = {a.name.split(".")[0], b.name.split(".")[0]}
    store = DatasetStore(str(data), exclude_batches=lambda: pending)
    again = flush_segment(a, store)
    assert (again.spans, again.duplicates) == (50, 0)
    assert sorted(data.rglob("*.parquet")) == files_before  # same file rewritten, not a new one
    assert read_spans(data).height == 50
    a.unlink()
    pending.discard(a.name.split(".")[0])
    rb = flush_segment(b, store)
    assert (rb.spans, rb.duplicates) == (10, 11)
    df = read_spans(data)
    assert df.height == 60
    assert df["span_id"].n_unique() == 60


def test_redo_without_exclusion_still_excludes_its_own_files(segs, data):
    a = segs.write(span_request((TRACE, ROOT, T0, "r"), (TRACE, CHILD, T0, "c")))
    flush_segment(a, DatasetStore(str(data)))
    again = flush_segment(a, DatasetStore(str(data)))
    assert (again.spans, again.duplicates) == (2, 0)
    assert read_spans(data).height == 2


def test_failed_commit_leaves_no_temporary_files_and_redo_is_exact(segs, data, monkeypatch):
    seg = segs.write(span_request((TRACE, ROOT, T0, "day1"), (TRACE, CHILD, T0 + DAY, "day2")))
    real_replace = os.replace
    calls = {"n": 0}

    def replace(src, dst, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "simulated I/O error")
        return real_replace(src, dst, *a, **k)

    monkeypatch.setattr(datasets.os, "replace", replace)
    store = DatasetStore(str(data))
    with pytest.raises(OSError):
        flush_segment(seg, store)
    monkeypatch.undo()
    assert not list(data.rglob("*.tmp-*"))
    res = flush_segment(seg, store)  # the same process retries
    assert res.spans == 2
    df = read_spans(data)
    assert sorted(df["name"].to_list()) == ["day1", "day2"]


def test_spans_on_two_dates_go_to_two_partitions(segs, data):
    midnight = int(datetime(2026, 11, 21, tzinfo=timezone.utc).timestamp()) * 10**9
    seg = segs.write(
        span_request(
            (TRACE, ROOT, midnight - 1, "before-midnight"),
            (TRACE, CHILD, midnight, "at-midnight"),
            (TRACE, LINK_SPAN, 0, "no-start"),  # partitioned by its receive time
        ),
        received=midnight + 3 * DAY,
    )
    res = flush_segment(seg, DatasetStore(str(data)))
    assert res.files == 3
    parts = sorted(p.parent.name for p in (data / "spans").rglob("*.parquet"))
    assert parts == ["date=2026-11-20", "date=2026-11-21", "date=2026-11-24"]
    df = read_spans(data)
    by = {r["name"]: r for r in df.to_dicts()}
    assert str(by["before-midnight"]["date"]) == "2026-11-20"
    assert str(by["at-midnight"]["date"]) == "2026-11-21"
    assert by["no-start"]["start_time"] is None and by["no-start"]["end_time"] is None
    assert str(by["no-start"]["date"]) == "2026-11-24"


def test_logs_dataset(segs, data):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    s = AnyValue(string_value="hello")
    kv = AnyValue()
    kv.kvlist_value.values.add(key="role").value.string_value = "user"
    kv.kvlist_value.values.add(key="n").value.int_value = 2
    i = AnyValue(int_value=42)
    b = AnyValue(bytes_value=b"\x00\x9f")
    req = log_request(s, kv, i, b, None, trace_id=TRACE, span_id=CHILD)
    uncorrelated = log_request(AnyValue(string_value="alone"), time_ns=T0 + 10**6)
    seg1 = segs.write(req, uncorrelated)
    store = DatasetStore(str(data))
    r1 = flush_segment(seg1, store)
    assert (r1.spans, r1.logs, r1.duplicates) == (0, 6, 0)
    f = next((data / "logs").rglob("*.parquet"))
    assert pq.read_schema(f).metadata[b"nightshift.schema_version"] == schemas.SCHEMA_VERSION.encode()
    df = read_logs(data)
    assert df.height == 6
    rows = sorted(df.to_dicts(), key=lambda r: (r["time"], r["service_name"]))
    bodies = [r["body"] for r in rows]
    assert [x["type"] for x in bodies] == ["string", "kvlist", "int", "bytes", "empty", "string"]
    assert bodies[0]["string_value"] == "hello"
    assert json.loads(bodies[1]["json_value"]) == {"role": "user", "n": 2}
    assert bodies[2]["int_value"] == 42
    assert bodies[3]["bytes_value"] == b"\x00\x9f"
    assert bodies[5]["string_value"] == "alone"
    for r in rows[:5]:
        assert r["trace_id"] == TRACE.hex() and r["span_id"] == CHILD.hex()
        assert r["severity_number"] == 9 and r["severity_text"] == "INFO"
        assert r["service_name"] == "logsvc" and r["scope_name"] == "logger"
    assert rows[5]["trace_id"] is None and rows[5]["span_id"] is None
    ids = df["record_id"].to_list()
    assert len(set(ids)) == 6 and all(len(x) == 32 and int(x, 16) >= 0 for x in ids)

    # the identical records resent later (other receive time): same ids, stored once
    seg2 = segs.write(req, received=RECEIVED + 10**9)
    r2 = flush_segment(seg2, DatasetStore(str(data)))
    assert (r2.logs, r2.duplicates) == (0, 5)
    assert read_logs(data)["record_id"].sort().to_list() == sorted(ids)

    # a record that differs in any field is a new record
    changed = log_request(s, kv, i, b, None, trace_id=TRACE, span_id=CHILD)
    changed.resource_logs[0].scope_logs[0].log_records[0].severity_number = 10
    r3 = flush_segment(segs.write(changed), store)
    assert (r3.logs, r3.duplicates) == (1, 4)


def test_log_record_id_distinguishes_resource_from_scope(segs, data):
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    moved = KeyValue(key="k")
    moved.value.string_value = "v"
    a = log_request(AnyValue(string_value="same"))
    a.resource_logs[0].scope_logs[0].scope.name = moved.SerializeToString().decode()
    b = log_request(AnyValue(string_value="same"))
    b.resource_logs[0].resource.attributes.append(moved)
    b.resource_logs[0].scope_logs[0].scope.name = ""
    assert a != b
    res = flush_segment(segs.write(a, b), DatasetStore(str(data)))
    assert res.logs == 2


def test_memory_filesystem_as_data_root(segs):
    root = f"memory://nightshift-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        seg = segs.write(full_request(), log_request(None))
        store = DatasetStore(root)
        assert not store.local
        res = flush_segment(seg, store)
        assert (res.spans, res.logs, res.files) == (2, 1, 2)
        path = root.removeprefix("memory://")
        files = fs.glob(f"/{path}/spans/date=*/*.parquet")
        assert [f.rsplit("/", 2)[1] for f in files] == ["date=2026-11-20"]
        assert not fs.glob(f"/{path}/**/*.tmp-*")
        table = pads.dataset(f"/{path}/spans", filesystem=fs, format="parquet", partitioning="hive").to_table()
        assert table.num_rows == 2
        assert sorted(table.column("span_id").to_pylist()) == sorted([ROOT.hex(), CHILD.hex()])
        with fs.open(files[0], "rb") as fh:
            assert pq.read_schema(fh).metadata[b"nightshift.schema_version"] == schemas.SCHEMA_VERSION.encode()
        # a restarted flusher rebuilds its index from the object store: no duplicates
        again = flush_segment(segs.write(full_request()), DatasetStore(root))
        assert (again.spans, again.duplicates) == (0, 2)
        assert pads.dataset(f"/{path}/spans", filesystem=fs, format="parquet").count_rows() == 2
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_two_collectors_writing_into_one_data_folder_keep_every_span(tmp_path, data):
    """Segment numbers restart in every WAL; the WAL's instance id in the file name
    keeps a second collector's segment 1001 from replacing the first one's."""
    from nightshift.collector.wal import instance_id

    a, b = Segments(tmp_path / "wal-a"), Segments(tmp_path / "wal-b")
    ida, idb = instance_id(a.dir), instance_id(b.dir)
    assert ida != idb and instance_id(a.dir) == ida  # stable across restarts
    seg_a = a.write(span_request((b"\x01" * 16, b"\x01" * 8, T0, "a")))
    seg_b = b.write(span_request((b"\x02" * 16, b"\x02" * 8, T0, "b")))
    assert seg_a.name == seg_b.name
    flush_segment(seg_a, DatasetStore(str(data)), instance=ida)
    flush_segment(seg_b, DatasetStore(str(data)), instance=idb)
    assert sorted(read_dataset(data, "spans")["name"].to_list()) == ["a", "b"]
    again = flush_segment(seg_a, DatasetStore(str(data)), instance=ida)  # a redo rewrites its own file
    assert again.duplicates == 0 and len(list((data / "spans").rglob("*.parquet"))) == 2


def test_a_torn_or_foreign_file_in_a_partition_is_named_and_skipped_not_a_stopped_date(segs, data, caplog):
    """A user's partial copy (`cp` cut short) or another tool's Parquet inside a
    spans partition used to make the dedup index of that date raise on every
    flush, so nothing more reached that date and the WAL filled (503s)."""
    import logging

    import pyarrow as pa

    a = segs.write(span_request((TRACE, ROOT, T0, "root")))
    assert flush_segment(a, DatasetStore(str(data))).spans == 1
    (stored,) = (data / "spans").rglob("*.parquet")
    torn = stored.with_name("copy of part.parquet")
    torn.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])
    foreign = stored.with_name("notes.parquet")
    pq.write_table(pa.table({"note": ["not spans"]}), foreign)
    b = segs.write(span_request((TRACE, ROOT, T0, "root-resent"), (TRACE, CHILD, T0 + 1, "child")))
    with caplog.at_level(logging.WARNING, logger="nightshift.collector.datasets"):
        res = flush_segment(b, DatasetStore(str(data)))  # a fresh store: reads the partition's files
    assert (res.spans, res.duplicates) == (1, 1)  # the readable file still dedups
    said = caplog.text
    assert str(torn) in said and str(foreign) in said and "left out of the duplicate check" in said
    spans = pl.read_parquet([stored, *[p for p in (data / "spans").rglob("part-*.parquet") if p != stored]])
    assert sorted(spans["name"].to_list()) == ["child", "root"]
