"""What the sidecar's flusher costs (issue 28 item 6): its allocator, the codec
it writes with. Sizes and speeds are measured by benchmarks/ingest.py; here only
that each choice takes effect."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hardening.proc import drained
from helpers import make_request, post

from nightshift.collector import flusher_process, wal
from nightshift.collector.datasets import DatasetStore
from nightshift.collector.flusher import flush_segment


def _backend(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_the_flusher_allocates_arrow_memory_with_jemalloc_unless_the_operator_chose():
    """pyarrow's default (mimalloc) kept 20-25 MiB more of a flush's freed memory."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    assert _backend(flusher_process.child_environment(env)) == "jemalloc"
    assert _backend(flusher_process.child_environment({**env, "ARROW_DEFAULT_MEMORY_POOL": "system"})) == "system"


def test_a_running_collectors_flusher_starts_with_that_allocator(collector):
    pid = collector.health()["flusher_pid"]
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert b"ARROW_DEFAULT_MEMORY_POOL=jemalloc" in environ
    assert collector.stop() == 0


# --- the codec (collector.compression) ------------------------------------------------


def _segment(directory: Path, n: int, *requests) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / f"{n:020d}{wal.SEALED}"
    p.write_bytes(wal.MAGIC + b"".join(wal.encode_record(wal.KIND_TRACES, time.time_ns(), r.SerializeToString())
                                       for r in requests))
    return p


def _codecs(data: Path) -> set[str]:
    files = list((data / "spans").rglob("*.parquet"))
    assert files
    return {pq.ParquetFile(f).metadata.row_group(0).column(i).compression
            for f in files for i in range(pq.ParquetFile(f).metadata.num_columns)}


@pytest.mark.parametrize("codec, written", [("", "ZSTD"), ("zstd", "ZSTD"), ("snappy", "SNAPPY"),
                                            ("lz4", "LZ4"), ("none", "UNCOMPRESSED")])
def test_the_codec_setting_is_the_codec_of_every_column_written(tmp_path, codec, written):
    req, _ = make_request(20)
    res = flush_segment(_segment(tmp_path / "wal", 1, req), DatasetStore(str(tmp_path / "data"), compression=codec))
    assert res.spans == 20
    assert _codecs(tmp_path / "data") == {written}


def test_an_unknown_codec_is_named_not_a_traceback_mid_flush(tmp_path):
    with pytest.raises(ValueError, match="'brotli' is not one of zstd, snappy, lz4, none"):
        DatasetStore(str(tmp_path / "data"), compression="brotli")


def test_nightshift_collect_writes_with_the_codec_it_was_given(collector_factory):
    c = collector_factory(extra_args=["--compression", "snappy"]).start()
    req, _ = make_request(5)
    assert post(c.http_port, "/v1/traces", req.SerializeToString())[0] == 200
    drained(c)
    assert _codecs(c.data) == {"SNAPPY"}
    assert c.stop() == 0


# --- the duplicate check's memory (collector.dedup_memory) -----------------------------


def test_keys_past_the_budget_are_forgotten_oldest_first_and_said_so(tmp_path, caplog):
    """16 bytes a key: 100 spans are 1600 bytes, so a 2500-byte budget holds one
    segment's keys. A resend of the newest is still a duplicate; a resend of one
    forgotten is stored again (twice in the lake, never lost)."""
    data = str(tmp_path / "data")
    store = DatasetStore(data, window_s=600.0, key_budget=2500)
    batches = [make_request(100)[0] for _ in range(3)]
    for i, req in enumerate(batches):
        assert flush_segment(_segment(tmp_path / "wal", i, req), store).spans == 100
    assert "holds the keys of the last" in caplog.text and "collector.dedup_memory" in caplog.text
    again_newest = flush_segment(_segment(tmp_path / "wal", 10, batches[2]), store)
    assert (again_newest.spans, again_newest.duplicates) == (0, 100)
    again_oldest = flush_segment(_segment(tmp_path / "wal", 11, batches[0]), store)
    assert (again_oldest.spans, again_oldest.duplicates) == (100, 0)


def test_without_a_budget_the_window_alone_decides(tmp_path):
    store = DatasetStore(str(tmp_path / "data"), window_s=600.0)
    batches = [make_request(100)[0] for _ in range(3)]
    for i, req in enumerate(batches):
        flush_segment(_segment(tmp_path / "wal", i, req), store)
    again_oldest = flush_segment(_segment(tmp_path / "wal", 11, batches[0]), store)
    assert (again_oldest.spans, again_oldest.duplicates) == (0, 100)


# --- what the flusher imports -----------------------------------------------------------


def test_a_flusher_writing_a_local_folder_imports_no_fsspec(tmp_path):
    """fsspec is 6 MiB of the flusher's RSS (asyncio, zstandard, every codec module)
    for what os does on a local disk; an object store still goes through it."""
    req, _ = make_request(3)
    seg, resent = _segment(tmp_path / "wal", 1, req), _segment(tmp_path / "wal", 2, req)
    code = (f"import sys\nfrom pathlib import Path\nfrom nightshift.collector.datasets import DatasetStore\n"
            f"from nightshift.collector.flusher import flush_segment\n"
            f"store = DatasetStore({str(tmp_path / 'data')!r})\n"
            f"assert flush_segment(Path({str(seg)!r}), store).spans == 3\n"
            f"assert flush_segment(Path({str(resent)!r}), DatasetStore({str(tmp_path / 'data')!r})).duplicates == 3\n"
            f"print('fsspec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_restart_reads_the_keys_of_the_newest_files_only_within_the_budget(tmp_path):
    """A collector restarted into a day of spans read every key of the day before
    its first flush (50M spans: 800 MB of hashes, more of strings); within a budget
    it reads the newest files until the budget is full."""
    data = str(tmp_path / "data")
    batches = [make_request(100)[0] for _ in range(3)]
    for i, req in enumerate(batches):
        flush_segment(_segment(tmp_path / "wal", i, req), DatasetStore(data))
        time.sleep(0.05)  # distinct modification times
    fresh = DatasetStore(data, window_s=600.0, key_budget=1500)  # under one file's 1600 bytes: the newest file only
    again_newest = flush_segment(_segment(tmp_path / "wal", 10, batches[2]), fresh)
    assert (again_newest.spans, again_newest.duplicates) == (0, 100)
    again_oldest = flush_segment(_segment(tmp_path / "wal", 11, batches[0]), fresh)
    assert (again_oldest.spans, again_oldest.duplicates) == (100, 0)


# --- the duplicate check's lookups --------------------------------------------------------


def test_a_long_running_flusher_searches_a_few_merged_frames_not_one_per_segment(tmp_path):
    """Every lookup searched one frame of keys per segment flushed within the window:
    a sidecar flushing every 0.5 s held up to 1,200, and lookups grew to more CPU than
    the rest of the flush. Merged as they come, 32 segments leave a handful, and a
    resend of the first segment's spans is still found."""
    store = DatasetStore(str(tmp_path / "data"), window_s=600.0, key_budget=16 << 20)
    batches = [make_request(20)[0] for _ in range(32)]
    for i, req in enumerate(batches):
        assert flush_segment(_segment(tmp_path / "wal", i, req), store).spans == 20
    (index,) = store._index.values()
    assert len(index.frames) <= 8
    again = flush_segment(_segment(tmp_path / "wal", 100, batches[0], batches[21]), store)
    assert (again.spans, again.duplicates) == (0, 40)


def test_merged_frames_stay_under_an_eighth_of_the_budget(tmp_path):
    """So that past the budget the oldest keys go an eighth at a time, not half at once."""
    store = DatasetStore(str(tmp_path / "data"), window_s=600.0, key_budget=128 * 40)  # frames of 40 keys at most
    for i in range(16):
        flush_segment(_segment(tmp_path / "wal", i, make_request(20)[0]), store)
    (index,) = store._index.values()
    assert max(len(f.h1) for f in index.frames) == 40


def test_a_segments_own_chunks_are_merged_as_it_is_written(tmp_path):
    """A 100k-span segment is 25 chunks: each searched all the chunks before it."""
    store = DatasetStore(str(tmp_path / "data"))
    reqs = [make_request(10)[0] for _ in range(32)]
    writer = store.writer("spans", "b1")
    from nightshift.collector.convert import SpanBuilder

    for req in reqs:
        sb = SpanBuilder()
        sb.add_request(req, time.time_ns())
        writer.add(sb.table(), sb.dates)
    (pending,) = writer._pending.values()
    assert len(pending.frames) <= 6
    sb = SpanBuilder()
    sb.add_request(reqs[3], time.time_ns())  # a resend inside the same segment
    writer.add(sb.table(), sb.dates)
    assert (writer.commit().rows, writer.stats.duplicates) == (320, 10)


# --- the benchmark's figure of the flusher's memory ---------------------------------------


def test_the_benchmarks_flusher_peak_is_the_flushers_not_its_parents(tmp_path):
    """Linux carries ru_maxrss across fork and exec: the flusher measured alone
    reported the benchmark process's RSS as its own peak (681 MiB once, for 130)."""
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "benchmarks")]
    try:
        import ingest
        import otlp_load
    finally:
        del sys.path[0]
    templates = otlp_load.build_templates(1, 16, span_bytes=otlp_load.span_range(1))
    ballast = bytearray(400 << 20)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, not only reserved
    res = ingest.flusher_alone(tmp_path, templates, spans=16)
    del ballast
    assert res["spans"] == 16 and 0 < res["peak_mib"] < 300


# --- a chunk's fixed cost -----------------------------------------------------------------


def test_a_chunks_struct_columns_are_read_as_views_not_through_the_kernel(monkeypatch):
    """Every flush chunk paid 93 `struct_field` kernel calls (~20 us each) before
    its first span: a fifth of the conversion of 5 KB spans, whose 4 MiB chunks
    hold ~800. A struct without nulls is read as a view now; the kernel is kept
    where a struct has nulls (a span without a status), whose children it masks."""
    import pyarrow.compute as pc
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from nightshift.collector import otlp_arrow

    req, _ = make_request(40)
    spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    for s in spans[:20]:
        s.ClearField("status")  # a null status struct: the kernel, for its two children
    for s in spans[20:]:
        s.status.code, s.status.message = 2, "failed"
    payload = req.SerializeToString()
    kernel = pc.struct_field
    calls: list[str] = []
    monkeypatch.setattr(pc, "struct_field", lambda arr, name: calls.append(name) or kernel(arr, name))
    table = otlp_arrow.spans_table([payload, payload], [1, 2]).table
    assert len(calls) <= 4, calls  # 93 before
    codes = table.column("status_code").to_pylist()
    messages = table.column("status_message").to_pylist()
    assert codes[:20] == ["unset"] * 20 and codes[20:40] == ["error"] * 20
    assert messages[:20] == [""] * 20 and messages[20:40] == ["failed"] * 20
    assert table.num_rows == 80 and ExportTraceServiceRequest.FromString(payload) == req
