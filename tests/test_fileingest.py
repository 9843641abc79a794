"""`nightshift ingest`: files written by an OpenTelemetry Collector's fileexporter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard
from conftest import read_logs, read_spans
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogsData
from opentelemetry.proto.metrics.v1.metrics_pb2 import MetricsData
from opentelemetry.proto.trace.v1.trace_pb2 import Span, TracesData

from nightshift.collector import fileingest, otlp_json
from nightshift.collector.datasets import DatasetStore
from nightshift.collector.redact import Redactor

T0 = 1_795_000_000_000_000_000  # 2026-11-18


def traces(first: int, n: int = 3, *, trace: int = 1, attrs: dict | None = None) -> TracesData:
    """n spans with span ids first..first+n-1 in one trace."""
    td = TracesData()
    rs = td.resource_spans.add()
    rs.resource.attributes.add(key="service.name").value.string_value = "filesvc"
    ss = rs.scope_spans.add()
    ss.scope.name = "lib"
    for i in range(first, first + n):
        s = ss.spans.add()
        s.trace_id = trace.to_bytes(16, "big")
        s.span_id = i.to_bytes(8, "big")
        s.name = f"span-{i}"
        s.kind = Span.SPAN_KIND_CLIENT
        s.start_time_unix_nano = T0 + i
        s.end_time_unix_nano = T0 + i + 10
        for k, v in (attrs or {}).items():
            s.attributes.add(key=k).value.MergeFrom(_any(v))
    return td


def _any(v) -> AnyValue:
    return AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v)


def logs(*bodies: str, trace: int = 1, span: int = 1) -> LogsData:
    ld = LogsData()
    rl = ld.resource_logs.add()
    rl.resource.attributes.add(key="service.name").value.string_value = "filesvc"
    sl = rl.scope_logs.add()
    for i, body in enumerate(bodies):
        r = sl.log_records.add()
        r.time_unix_nano = T0 + i
        r.body.string_value = body
        r.trace_id = trace.to_bytes(16, "big")
        r.span_id = span.to_bytes(8, "big")
    return ld


def json_lines(*messages) -> bytes:
    return b"".join(otlp_json.encode(m) + b"\n" for m in messages)


def frames(*messages, compress: bool = False) -> bytes:
    out = b""
    c = zstandard.ZstdCompressor()
    for m in messages:
        b = m.SerializeToString() if not isinstance(m, bytes) else m
        if compress:
            b = c.compress(b)
        out += len(b).to_bytes(4, "big") + b
    return out


@pytest.fixture
def data(tmp_path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def run_ingest(data):
    def run(*paths, redactor: Redactor | None = None, store: DatasetStore | None = None) -> fileingest.IngestStats:
        return fileingest.ingest([str(p) for p in paths], store or DatasetStore(str(data)),
                                 redactor or Redactor.from_config(["api_key"], [], []), progress=False)

    return run


def span_ids(data: Path) -> list[int]:
    df = read_spans(data)
    return sorted(int(x, 16) for x in df["span_id"].to_list()) if df.height else []


def test_json_lines_traces(tmp_path, data, run_ingest):
    f = tmp_path / "traces.json"
    f.write_bytes(json_lines(traces(1), traces(4), traces(7, 2)))
    st = run_ingest(f)
    assert (st.files, st.spans, st.logs, st.duplicates, st.rejected, st.bad_records) == (1, 8, 0, 0, 0, 0)
    assert st.notes == []
    df = read_spans(data)
    assert span_ids(data) == list(range(1, 9))
    assert set(df["trace_id"]) == {(1).to_bytes(16, "big").hex()}
    assert set(df["kind"]) == {"client"} and set(df["service_name"]) == {"filesvc"}
    # batch files are named after the file's content hash
    (part,) = (data / "spans").rglob("*.parquet")
    assert part.name.startswith("part-ingest-")


def test_json_lines_logs(tmp_path, data, run_ingest):
    f = tmp_path / "logs.json"
    f.write_bytes(json_lines(logs("a", "b"), logs("c", span=2)))
    st = run_ingest(f)
    assert (st.spans, st.logs, st.bad_records) == (0, 3, 0)
    df = read_logs(data)
    assert sorted(r["string_value"] for r in df["body"].to_list()) == ["a", "b", "c"]
    assert set(df["trace_id"]) == {(1).to_bytes(16, "big").hex()}
    assert set(df["span_id"]) == {(1).to_bytes(8, "big").hex(), (2).to_bytes(8, "big").hex()}
    assert not (data / "spans").exists() or read_spans(data).height == 0


def test_mixed_file_with_metrics_line(tmp_path, data, run_ingest):
    md = MetricsData()
    md.resource_metrics.add().scope_metrics.add().metrics.add(name="m").gauge.data_points.add().as_int = 1
    f = tmp_path / "all.json"
    f.write_bytes(json_lines(traces(1, 2), md, logs("x")))
    st = run_ingest(f)
    assert (st.spans, st.logs, st.skipped_metrics, st.bad_records) == (2, 1, 1, 0)


def test_length_prefixed_protobuf_traces(tmp_path, data, run_ingest):
    f = tmp_path / "traces.pb"
    f.write_bytes(frames(traces(1), traces(4, 2)))
    st = run_ingest(f)
    assert (st.spans, st.bad_records, st.notes) == (5, 0, [])
    assert span_ids(data) == [1, 2, 3, 4, 5]


def test_length_prefixed_protobuf_logs_without_ids(tmp_path, data, run_ingest):
    ld = LogsData()
    r = ld.resource_logs.add().scope_logs.add().log_records.add()
    r.time_unix_nano = T0
    r.body.string_value = "short body"
    f = tmp_path / "logs.pb"
    f.write_bytes(frames(ld))
    st = run_ingest(f)
    assert (st.logs, st.bad_records) == (1, 0)


def test_length_prefixed_protobuf_logs_with_trace_ids(tmp_path, data, run_ingest):
    f = tmp_path / "logs.pb"
    f.write_bytes(frames(logs("correlated", "also correlated"), logs("x" * 200)))
    st = run_ingest(f)
    assert (st.logs, st.bad_records) == (3, 0)


def test_zstd_length_prefixed_frames(tmp_path, data, run_ingest):
    f = tmp_path / "traces.pb.zst"
    f.write_bytes(frames(traces(1), traces(4), compress=True))
    st = run_ingest(f)
    assert (st.spans, st.bad_records) == (6, 0)
    assert span_ids(data) == list(range(1, 7))


def test_zstd_compressed_json_frames(tmp_path, data, run_ingest):
    f = tmp_path / "traces.json.zst"
    f.write_bytes(frames(otlp_json.encode(traces(1)), otlp_json.encode(logs("j")), compress=True))
    st = run_ingest(f)
    assert (st.spans, st.logs, st.bad_records) == (3, 1, 0)


def test_rotated_backups_are_read_first(tmp_path, data, run_ingest):
    (tmp_path / "traces-2026-11-20T09-00-00.000.json").write_bytes(json_lines(traces(1, 2)))
    (tmp_path / "traces-2026-11-20T10-00-00.000.json").write_bytes(json_lines(traces(3, 2)))
    (tmp_path / "traces.json").write_bytes(json_lines(traces(5, 2)))
    (tmp_path / "other.json").write_bytes(json_lines(traces(100, 1)))  # not a backup of traces.json
    assert fileingest.expand([str(tmp_path / "traces.json")]) == [
        str(tmp_path / "traces-2026-11-20T09-00-00.000.json"),
        str(tmp_path / "traces-2026-11-20T10-00-00.000.json"),
        str(tmp_path / "traces.json"),
    ]
    st = run_ingest(tmp_path / "traces.json")
    assert (st.files, st.spans) == (3, 6)
    assert span_ids(data) == [1, 2, 3, 4, 5, 6]


def test_folder_and_glob_arguments(tmp_path, data, run_ingest):
    d = tmp_path / "export"
    d.mkdir()
    (d / "a.json").write_bytes(json_lines(traces(1, 1)))
    (d / "b.json").write_bytes(json_lines(traces(2, 1)))
    assert fileingest.expand([str(d), str(d / "*.json")]) == [str(d / "a.json"), str(d / "b.json")]
    st = run_ingest(d)
    assert (st.files, st.spans) == (2, 2)


def test_half_written_last_line_is_tolerated(tmp_path, data, run_ingest):
    whole = json_lines(traces(1), traces(4))
    partial = otlp_json.encode(traces(7))
    f = tmp_path / "traces.json"
    f.write_bytes(whole + partial[: len(partial) // 2])
    st = run_ingest(f)
    assert (st.spans, st.bad_records) == (6, 0)
    assert len(st.notes) == 1 and "incomplete" in st.notes[0]
    assert span_ids(data) == list(range(1, 7))


def test_half_written_last_frame_is_tolerated(tmp_path, data, run_ingest):
    whole = frames(traces(1))
    f = tmp_path / "traces.pb"
    f.write_bytes(whole + frames(traces(4))[:-7])
    st = run_ingest(f)
    assert (st.spans, st.bad_records) == (3, 0)
    assert any("incomplete" in n for n in st.notes)
    f.write_bytes(whole + b"\x00\x00")  # a cut length prefix
    st = run_ingest(f)
    assert st.bad_records == 0 and any("trailing 2 bytes" in n for n in st.notes)


def test_bad_line_in_the_middle(tmp_path, data, run_ingest):
    f = tmp_path / "traces.json"
    f.write_bytes(json_lines(traces(1)) + b"{this is not json\n" + b"[1,2]\n" + json_lines(traces(4)))
    st = run_ingest(f)
    assert st.bad_records == 2
    assert st.spans == 6
    assert any("line 2" in n for n in st.notes) and any("line 3" in n for n in st.notes)


def test_bad_frame_in_the_middle(tmp_path, data, run_ingest):
    f = tmp_path / "traces.pb.zst"
    garbage = b"\x28\xb5\x2f\xfd" + b"not really zstd"
    f.write_bytes(frames(traces(1), compress=True) + len(garbage).to_bytes(4, "big") + garbage
                  + frames(traces(4), compress=True))
    st = run_ingest(f)
    assert (st.spans, st.bad_records) == (6, 1)


def test_invalid_records_are_rejected_and_counted(tmp_path, data, run_ingest):
    good = otlp_json.encode(traces(1, 2)).decode()
    span1_id = '"spanId":"%s"' % (1).to_bytes(8, "big").hex()
    span2_start = '"startTimeUnixNano":"%d"' % (T0 + 2)
    assert good.count(span1_id) == 1 and good.count(span2_start) == 1
    bad_id = good.replace(span1_id, '"spanId":"zzzzzzzzzzzzzzzz"')  # rejected by validation
    bad_type = good.replace(span2_start, '"startTimeUnixNano":"abc"')  # rejected by the decoder
    f = tmp_path / "traces.json"
    f.write_text(bad_id + "\n" + bad_type + "\n")
    st = run_ingest(f)
    assert (st.rejected, st.bad_records, st.duplicates) == (2, 0, 0)
    assert st.spans == 2  # span 2 from line 1, span 1 from line 2
    assert span_ids(data) == [1, 2]


def test_ingesting_the_same_file_twice_adds_nothing(tmp_path, data, run_ingest):
    f = tmp_path / "traces.json"
    f.write_bytes(json_lines(traces(1, 5)) + json_lines(logs("a", "b")))
    first = run_ingest(f)
    assert (first.spans, first.logs) == (5, 2)
    files = sorted(p.relative_to(data) for p in data.rglob("*.parquet"))
    again = run_ingest(f)  # a new process: a fresh store
    assert read_spans(data).height == 5 and read_logs(data).height == 2
    assert sorted(p.relative_to(data) for p in data.rglob("*.parquet")) == files
    store = DatasetStore(str(data))
    run_ingest(f, store=store)
    third = run_ingest(f, store=store)  # the same process, index warm
    assert (third.spans, third.logs, third.duplicates) == (0, 0, 7)
    assert read_spans(data).height == 5 and read_logs(data).height == 2
    assert (again.spans, again.logs, again.duplicates) == (0, 0, 7)  # said so, as with the index warm


def test_same_spans_in_two_files_are_stored_once(tmp_path, data, run_ingest):
    a = tmp_path / "a.json"
    b = tmp_path / "b.pb"
    a.write_bytes(json_lines(traces(1, 4), logs("dup")))
    b.write_bytes(frames(traces(3, 4)))
    st_a = run_ingest(a)
    st_b = run_ingest(b)
    assert (st_a.spans, st_b.spans, st_b.duplicates) == (4, 2, 2)
    assert span_ids(data) == [1, 2, 3, 4, 5, 6]
    c = tmp_path / "c.json"
    c.write_bytes(json_lines(logs("dup"), traces(6, 1)))
    st_c = run_ingest(c)
    assert (st_c.spans, st_c.logs, st_c.duplicates) == (0, 0, 2)
    assert read_logs(data).height == 1


def test_ingest_redacts(tmp_path, data, run_ingest):
    key = "sk-proj-" + "Q" * 24
    f = tmp_path / "traces.json"
    f.write_bytes(json_lines(traces(1, 1, attrs={"prompt": f"use {key}", "password": "pw"})))
    st = run_ingest(f, redactor=Redactor.from_config(["api_key"], [], ["password"]))
    assert st.spans == 1
    df = read_spans(data)
    (attrs,) = df["attributes"].to_list()
    assert [a["key"] for a in attrs] == ["prompt"]
    assert attrs[0]["value"]["string_value"] == "use [REDACTED:api_key]"
    assert key.encode() not in b"".join(p.read_bytes() for p in data.rglob("*.parquet"))


def test_missing_file_raises(tmp_path, run_ingest):
    with pytest.raises(FileNotFoundError, match="absent.json"):
        run_ingest(tmp_path / "absent.json")


# --- the command line ----------------------------------------------------------------------------


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    return subprocess.run([sys.executable, "-m", "nightshift.cli", "ingest", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_cli_ingest_end_to_end(tmp_path):
    f = tmp_path / "traces.json"
    f.write_bytes(json_lines(traces(1, 3), logs("hello")))
    d = tmp_path / "data"
    r = _cli("--data", str(d), "--quiet", str(f), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ingested 1 file(s)" in r.stdout
    assert "3 spans, 1 log records written" in r.stdout
    assert span_ids(d) == [1, 2, 3]
    again = _cli("--data", str(d), "--quiet", str(f), cwd=tmp_path)
    assert again.returncode == 0
    assert read_spans(d).height == 3


def test_cli_ingest_missing_file_exits_2(tmp_path):
    r = _cli("--data", str(tmp_path / "data"), "--quiet", str(tmp_path / "nope.json"), cwd=tmp_path)
    assert r.returncode == 2
    assert "no such file" in r.stderr and "nope.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_ingest_unreadable_file_exits_1(tmp_path):
    f = tmp_path / "junk.json"
    f.write_bytes(b"{not json\n")
    r = _cli("--data", str(tmp_path / "data"), "--quiet", str(f), cwd=tmp_path)
    assert r.returncode == 1
    assert "1 unreadable" in r.stdout
    assert "note:" in r.stderr
