"""`collector.flusher: thread`: the flusher inside the receiver's process keeps the
process form's promises (the same rows in Parquet, nothing acknowledged lost when
the one process is killed between Parquet and the WAL's trim)."""

from __future__ import annotations

import time

import pytest

from conftest import read_spans
from helpers import make_request, post

THREAD = {"NIGHTSHIFT_COLLECTOR_FLUSHER": "thread"}
#: The column the collector fills from the moment a request came in: every other
#: column must be equal row for row between the forms.
LOCAL = ("received_time",)


def _comparable(df):
    keep = [c for c in df.columns if not any(w in c for w in LOCAL)]
    return df.select(keep).sort(["trace_id", "span_id"])


def _send(c, bodies: list[bytes]) -> None:
    for body in bodies:
        assert post(c.http_port, "/v1/traces", body)[0] == 200


def _wait_flushed(c, spans: int) -> None:
    deadline = time.time() + 30
    while c.metrics().get('nightshift_flushed{signal="traces"}', 0) < spans:
        assert time.time() < deadline, "the flusher thread wrote nothing in 30 s"
        time.sleep(0.1)


def test_thread_form_is_one_process_and_writes_the_process_forms_rows(tmp_path):
    from hardening.proc import Collector

    reqs = [make_request(30, content="x" * 300) for _ in range(4)]
    bodies = [r.SerializeToString() for r, _ in reqs]
    out = {}
    for form in ("process", "thread"):
        c = Collector(tmp_path / form / "data", tmp_path / form / "wal", tmp_path / f"{form}.log",
                      env={"NIGHTSHIFT_COLLECTOR_FLUSHER": form}).start()
        try:
            h = c.health()
            assert h["flusher"] == form and h["flusher_alive"]
            if form == "thread":
                assert h["flusher_pid"] == c.proc.pid and h["flusher_tid"]
                assert c.children() == [], "the thread form started a process"
            else:
                assert c.children() == [h["flusher_pid"]]
            _send(c, bodies)
            if form == "thread":  # what the process form keeps out of its child stays out of the one process
                _wait_flushed(c, 120)
                import psutil

                mapped = " ".join(m.path for m in psutil.Process(c.proc.pid).memory_maps())
                assert "pyarrow" in mapped and "/pandas/" not in mapped and "libarrow_s3" not in mapped
            assert c.stop() == 0
        finally:
            if c.proc.poll() is None:
                c.kill9()
        out[form] = read_spans(c.data)
    ids = sorted(i for _, ids in reqs for i in ids)
    assert sorted(zip(out["thread"]["trace_id"], out["thread"]["span_id"])) == ids
    assert _comparable(out["thread"]).equals(_comparable(out["process"]))


@pytest.mark.parametrize("point", ["flusher.before_commit", "flusher.after_commit"])
def test_thread_form_killed_mid_flush_loses_nothing_and_stores_nothing_twice(collector_factory, tmp_path, point):
    """The failpoint kills the whole collector (the flusher is a thread of it),
    before or after the flush's Parquet is durable; the restart replays the WAL."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**THREAD, "NIGHTSHIFT_FAILPOINTS": point, "NIGHTSHIFT_FAILPOINT_DIR": str(marks)}
    c = collector_factory(env=env).start()
    reqs = [make_request(25) for _ in range(3)]
    _send(c, [r.SerializeToString() for r, _ in reqs])  # acknowledged: in the WAL
    c.proc.wait(30)  # the first flush fires the failpoint: kill -9 of receiver and flusher alike
    assert (marks / point).exists(), "the failpoint never fired"
    c._log.close()
    c = collector_factory(env=env, grpc_port=c.grpc_port, http_port=c.http_port).start()
    more, more_ids = make_request(10)
    _send(c, [more.SerializeToString()])
    deadline = time.time() + 30
    while list(c.wal.glob("*.sealed")) and time.time() < deadline:
        time.sleep(0.1)
    assert c.stop() == 0
    spans = read_spans(c.data)
    stored = list(zip(spans["trace_id"], spans["span_id"]))
    assert len(stored) == len(set(stored)), "a span is stored twice"
    assert sorted(stored) == sorted([i for _, ids in reqs for i in ids] + more_ids)
    assert not list(c.wal.glob("*.sealed"))


def test_the_receiver_imports_no_yaml_or_difflib():
    """The settings' YAML reader and typo suggestions are loaded when used, not by
    every process that imports a config (the one-process sidecar's 1.2 MiB)."""
    import subprocess
    import sys

    code = ("import sys, nightshift.collector.server, nightshift.collector.flusher; "
            "print(sorted(m for m in ('yaml', 'difflib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("form", ["process", "thread"])
def test_flush_chunk_bytes_reaches_the_flusher(collector_factory, form):
    """`collector.flush_chunk_bytes` is the flusher's chunk in either form: eight
    40 KB requests at 64 KiB chunks are several row groups (4 MiB: one a file)."""
    import pyarrow.parquet as pq

    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_FLUSHER": form,
                               "NIGHTSHIFT_COLLECTOR_FLUSH_CHUNK_BYTES": "64KiB"}).start()
    reqs = [make_request(40, content="c" * 900) for _ in range(8)]
    _send(c, [r.SerializeToString() for r, _ in reqs])
    assert c.stop() == 0
    files = list((c.data / "spans").rglob("*.parquet"))
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in files) == 8 * 40
    assert max(pq.ParquetFile(p).metadata.num_row_groups for p in files) >= 2


# --- the defaults since the 150 MB sidecar (issue 28, sidecar8) ------------------------


def test_a_collector_with_no_flusher_setting_on_a_folder_is_one_process(collector_factory):
    """`collector.flusher: auto`, the default: on a folder the flusher is a thread
    of the receiver (20-30 MB less at 50k spans/s), and its 2 MiB chunks
    (`flush_chunk_bytes`) make ~3 MiB of spans two row groups or more, not one."""
    import pyarrow.parquet as pq

    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_FLUSHER": None,  # unset: the default, not the harness's pin
                               "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "30"}).start()  # one segment, sealed by stop
    h = c.health()
    assert h["flusher"] == "thread" and h["flusher_pid"] == c.proc.pid and c.children() == []
    reqs = [make_request(250, content="m" * 1000) for _ in range(12)]  # ~3.3 MB of payload
    _send(c, [r.SerializeToString() for r, _ in reqs])
    assert c.stop() == 0
    files = list((c.data / "spans").rglob("*.parquet"))
    assert sum(pq.ParquetFile(p).metadata.num_rows for p in files) == 12 * 250
    assert len(files) == 1 and pq.ParquetFile(files[0]).metadata.num_row_groups >= 2


def test_auto_keeps_a_killable_flusher_process_for_object_stores():
    """An upload can hang past flush_timeout, and only a process can be killed and
    redone: `auto` is a process for object stores; an explicit choice always wins."""
    from nightshift.collector.config import CollectorConfig

    assert CollectorConfig(data="s3://bucket/lake").flusher_form() == "process"
    assert CollectorConfig(data="file:///tmp/lake").flusher_form() == "thread"
    assert CollectorConfig(data="./lake").flusher_form() == "thread"
    assert CollectorConfig(data="s3://bucket/lake", flusher="thread").flusher_form() == "thread"
    assert CollectorConfig(data="./lake", flusher="process").flusher_form() == "process"
    # The sidecar's other budget levers (docs/deploy.md): 4 MiB of duplicate keys, 5 s at 50k spans/s,
    # and files of at most 32 row groups: Arrow's writer holds ~90 KB of metadata per row group until
    # the file closes (a 256 MiB segment of 2 MiB chunks peaked 16 MiB above a 64 MiB one).
    cfg = CollectorConfig()
    assert cfg.dedup_memory == 4 << 20
    assert cfg.segment_bytes // cfg.flush_chunk_bytes <= 32
