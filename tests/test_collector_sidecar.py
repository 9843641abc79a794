"""The sidecar's lean paths (issue 28, item 6): the flusher's dedup hashes and JSON
text without Polars, and the imports each process is kept from, which are most of
its RSS."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa

from nightshift.collector.datasets import DatasetStore
from nightshift.collector.feedback import RECORD_KEYS
from nightshift.collector.feedback_table import write_feedback
from nightshift.collector.keyhash import LONG, row_hashes
from nightshift.collector.otlp_arrow import _json_strings


def _pairs(keys: pa.Table) -> list[tuple[int, int]]:
    h1, h2 = row_hashes(keys)
    return list(zip(h1.tolist(), h2.tolist()))


def test_a_key_hashes_the_same_whatever_else_is_in_its_batch():
    """The index compares hashes across batches: a retried feedback id arriving
    beside a longer one is still the same key."""
    alone = _pairs(pa.table({"k": ["abc"]}))[0]
    assert _pairs(pa.table({"k": ["abc", "a-much-longer-feedback-id"]}))[0] == alone
    assert _pairs(pa.table({"k": ["zz", "abc"]}))[1] == alone
    ids = pa.array(["0123456789abcdef", "fedcba9876543210", "0011223344556677"])  # packed: viewed in place
    assert _pairs(pa.table({"k": ids.slice(1)})) == _pairs(pa.table({"k": ids}))[1:]
    assert _pairs(pa.table({"k": pa.array(["fedcba9876543210", "x"])}))[0] == _pairs(pa.table({"k": ids}))[1]
    long = "L" * (LONG + 5)
    assert _pairs(pa.table({"k": [long, "a"]}))[0] == _pairs(pa.table({"k": ["b", long]}))[1]


def test_distinct_keys_hash_apart():
    keys = ["", "a", "a\0", "ab", "ba", "abcdefgh", "abcdefgh\0", "abcdefghi", "L" * (LONG + 1), "L" * (LONG + 2)]
    assert len(set(_pairs(pa.table({"k": keys})))) == len(keys)
    # each column is framed by its length: ("ab", "c") is not ("a", "bc")
    two = _pairs(pa.table({"a": ["ab", "a", "L" * LONG + "x"], "b": ["c", "bc", "y"]}))
    three = _pairs(pa.table({"a": ["L" * LONG], "b": ["xy"]}))
    assert len(set(two + three)) == 4
    rng = np.random.default_rng(7)
    many = [rng.bytes(int(rng.integers(0, 40))).hex() for _ in range(20_000)]
    assert len(set(_pairs(pa.table({"k": many})))) == len(set(many))


def _feedback(fid: str) -> dict:
    return {**{k: None for k in RECORD_KEYS}, "feedback_id": fid, "trace_id": "5b8efff798038103d269b633813fc60c",
            "name": "thumbs", "value": 1.0}


def test_a_resent_feedback_label_beside_a_longer_id_is_a_duplicate(tmp_path):
    store, now = DatasetStore(str(tmp_path / "data")), 1_790_000_000 * 10**9
    assert write_feedback(store, "1", [_feedback("fb-1")], now, "http").rows == 1
    again = write_feedback(store, "2", [_feedback("fb-1"), _feedback("a-client-id-longer-than-the-first")], now, "http")
    assert (again.rows, again.duplicates) == (1, 1)
    fresh = DatasetStore(str(tmp_path / "data"))  # the index rebuilt from the files
    assert write_feedback(fresh, "3", [_feedback("a-client-id-longer-than-the-first"), _feedback("fb-1")],
                          now, "http").rows == 0


def test_json_strings_escape_as_json_dumps_does():
    texts = ["plain", 'a "quote"', "back\\slash", "new\nline\ttab\r", "\x00\x01\x1f", "\x7f del", "é ü 日本 😀",
             "\u2028\u2029", "", '\\"', None]
    got = _json_strings(pa.array(texts, pa.string())).to_pylist()
    assert got == [json.dumps(t, ensure_ascii=False) if t is not None else None for t in texts]
    plain = ["x", 'y"', "z\\"]  # none needs the Python path
    assert _json_strings(pa.array(plain)).to_pylist() == [json.dumps(t) for t in plain]


def _imported(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\nprint(json.dumps("
                          "[m for m in ('polars', 'pandas', 'pyarrow', 'numpy', 'grpc') if m in sys.modules]))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_flusher_process_imports_neither_polars_nor_pandas_nor_grpc():
    """Polars (28 MiB), pandas (36 MiB, pulled by pyarrow's list conversion) and gRPC
    are paid in every pod for nothing the flusher does."""
    code = ("import sys\nfrom nightshift.collector import flusher_process as fp\n"
            "sys.meta_path.insert(0, fp.Unused())\n"
            "from nightshift.collector import flusher\nimport pyarrow as pa\npa.array([[1], [2]])")
    assert _imported(code) == ["pyarrow", "numpy"]


def test_the_flusher_process_loads_none_of_arrows_own_object_store_filesystems(tmp_path):
    """pyarrow.parquet imports Arrow's S3, GCS, Azure and HDFS filesystems when it
    can (libarrow_s3: 3.2 MiB of the flusher's RSS); the flusher writes through os
    calls or fsspec and reads local files by path, which still works without them."""
    code = ("import sys\nfrom nightshift.collector import flusher_process as fp\n"
            "sys.meta_path.insert(0, fp.Unused())\n"
            "from nightshift.collector import flusher\nimport pyarrow as pa, pyarrow.parquet as pq\n"
            f"pq.write_table(pa.table({{'a': [1]}}), {str(tmp_path / 'a.parquet')!r})\n"
            f"assert pq.read_table({str(tmp_path / 'a.parquet')!r}).num_rows == 1\n"
            "import json\nprint(json.dumps([m for m in sys.modules if m.endswith(('_s3fs', '_gcsfs', '_azurefs', '_hdfs'))]"
            " + [l.split()[-1] for l in open('/proc/self/maps') if 'libarrow_s3' in l][:1]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_receiver_imports_no_arrow_or_dataframe_library():
    assert _imported("import nightshift.collector.server") == []


def test_nightshift_collect_receives_without_the_command_lines_heavy_imports(collector):
    """The command line's parser imports every stage (Polars, Arrow: 75 MiB); the
    receiver restarts itself lean in the same process, so a supervisor's pid and
    signals still reach it."""
    maps = open(f"/proc/{collector.proc.pid}/maps").read()
    assert "polars" not in maps and "libarrow" not in maps
    assert collector.health()["status"] == "ok"
    assert collector.stop() == 0  # SIGTERM to the pid it was started as


def test_a_collector_on_http_alone_loads_no_grpc(collector_factory):
    c = collector_factory(extra_args=["--grpc", "off"]).start()
    assert "cygrpc" not in open(f"/proc/{c.proc.pid}/maps").read()  # 16 MiB, measured
    assert c.health()["status"] == "ok"
    assert c.stop() == 0


def test_the_ingest_benchmarks_targets_say_what_each_line_ran_with():
    """A sidecar figure is only comparable with the settings it ran with: the
    benchmark's target lines name the flusher's form (asked and resolved), gRPC,
    and every collector or allocator variable the collector inherited."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import ingest
    finally:
        del sys.path[0]
    assert ingest.settings_tag("auto", "thread", False, {}) == "flusher auto->thread, grpc on, the rest at the defaults"
    env = {"NIGHTSHIFT_COLLECTOR_FLUSH_CHUNK_BYTES": "4MiB", "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "0.5",
           "NIGHTSHIFT_COLLECTOR_FLUSHER": "process", "MALLOC_ARENA_MAX": "1", "HOME": "/root"}
    assert ingest.settings_tag("process", "process", True, env) == \
        "flusher process, grpc off, flush_chunk_bytes=4MiB, MALLOC_ARENA_MAX=1"


def test_the_ingest_benchmarks_lines_name_the_flush_interval_and_the_flushers_settings():
    """The sustained ratio depends on the benchmark's own flush interval (0.5 s;
    the collector's is 10 s), and the flusher-alone CPU-seconds on the chunk size,
    codec and key budget it read from the variables: each line read alone (the
    lead's quiet re-measure) must say which."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        import ingest
    finally:
        del sys.path[0]
    assert ingest.settings_tag("auto", "thread", False, {}, flush_interval=0.5) == \
        "flusher auto->thread, grpc on, flush_interval 0.5 s (the benchmark's), the rest at the defaults"
    assert ingest.flusher_tag({}) == \
        "flush_chunk_bytes=2MiB, compression=zstd, dedup_memory=4MiB, dedup_window=600s, Arrow pool jemalloc"
    env = {"NIGHTSHIFT_COLLECTOR_FLUSH_CHUNK_BYTES": "4MiB", "NIGHTSHIFT_COLLECTOR_COMPRESSION": "lz4",
           "ARROW_DEFAULT_MEMORY_POOL": "system", "MALLOC_MMAP_THRESHOLD_": "1048576"}
    assert ingest.flusher_tag(env) == ("flush_chunk_bytes=4MiB (set), compression=lz4 (set), dedup_memory=4MiB, "
                                       "dedup_window=600s, Arrow pool system (set), MALLOC_MMAP_THRESHOLD_=1048576")
