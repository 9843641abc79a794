"""benchmarks/transform.py's own parts: a replicated dataset (copies of a base set
with new trace ids) is one of distinct traces, and the Ray figures in CPU-seconds
are read back from the build's summary lines."""

from __future__ import annotations

import glob
import importlib.util
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    # by path, under its own name: `transform` is also the repository's package
    spec = importlib.util.spec_from_file_location("bench_transform", _BENCH / "transform.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_transform"] = mod
    spec.loader.exec_module(mod)  # puts benchmarks/ on sys.path for its harness and synth_traces
    mod.st.TOKEN_POOL_MIN = 1 << 14  # a smaller token pool: same code, faster to make
    return mod


def test_replicated_dataset_has_distinct_traces(bench, tmp_path):
    """Three copies of a 2-date base: three times the rows, every trace id new, and
    each copy's file holds the base file's spans, schema and metadata."""
    st = bench.st
    p = st.Params(spans=8 * 12, calls=5, prompt_chars=40, response_chars=20, prompt_tokens=4, prompt_step=2,
                  response_tokens=2, attempts=2, days=2, seed=3)
    full = bench.replicated(st.Params.from_json({**p.to_json(), "spans": 3 * p.total_spans + 5}), p.total_spans)
    assert full.total_spans == 3 * p.total_spans  # whole copies: what the checks expect is what is on disk
    st.write_dataset(p, str(tmp_path), chunk_spans=48, row_group_spans=16)
    rows, _, files = bench.replicate_dataset(tmp_path, 3, 1, lambda *a: None)
    base_files = [f for f in glob.glob(str(tmp_path / "spans" / "date=*" / "*.parquet")) if "-copy" not in f]
    assert rows == 2 * p.total_spans and files == 2 * len(base_files)
    df = pl.read_parquet(str(tmp_path / "spans" / "date=*" / "*.parquet"))
    assert df.height == 3 * p.total_spans
    assert df["trace_id"].n_unique() == 3 * p.trajectories
    assert df.select(pl.struct("trace_id", "span_id").n_unique()).item() == df.height
    src = base_files[0]
    copy = src[:-len(".parquet")] + "-copy0002.parquet"
    a, b = pq.read_table(src), pq.read_table(copy)
    assert a.schema.equals(b.schema, check_metadata=True)
    assert a.drop_columns(["trace_id"]).equals(b.drop_columns(["trace_id"]))
    assert [int(x[:4], 16) ^ 2 for x in a.column("trace_id").to_pylist()] == [
        int(x[:4], 16) for x in b.column("trace_id").to_pylist()]
    assert [x[4:] for x in a.column("trace_id").to_pylist()] == [x[4:] for x in b.column("trace_id").to_pylist()]


def test_a_copy_never_gives_a_base_trace_its_own_id(bench, tmp_path):
    """A base trace whose id begins with a copy's number kept its id in that copy
    (the first four hex digits were replaced by the number): 18 traces of 1.25M
    at 10M spans were built as one."""
    import pyarrow as pa

    src = str(tmp_path / "base.parquet")
    pq.write_table(pa.table({"trace_id": ["0002" + "a" * 28, "0000" + "c" * 28, "ffff" + "b" * 28],
                             "span_id": ["s1", "s2", "s3"]}), src)
    bench.copy_file(src, 2)
    base = pq.read_table(src).column("trace_id").to_pylist()
    copy = pq.read_table(str(tmp_path / "base-copy0002.parquet")).column("trace_id").to_pylist()
    assert not set(base) & set(copy) and len(set(copy)) == 3


def test_ray_cpu_seconds_read_from_the_summary(bench):
    """The driver's whole process counts as serial: with 7 s of it, 16 s of tasks
    split 8 + 8 give (7 + 16) / (7 + 8), not the 1.9x the build's own second gives."""
    def run(ray_cpu: str, wait4: float):
        r = bench.BuildRun([], stdout="time: split 1.0 s, buckets 9.0 s (the buckets' own work: 12.0 s; the driver's "
                                      f"CPU: 1.0 s)\nray: 8 bucket(s) on 2 worker process(es), peak RSS 500 MiB, "
                                      f"510 MiB; tasks' CPU {ray_cpu}")
        r.cpu_user = wait4
        return r

    assert bench._ray_line(run("8.0 s, 8.0 s", 7.0).stdout) == ("500 MiB, 510 MiB", [8.0, 8.0])
    lines = bench._cpu_lines([(1, run("16.0 s", 7.0)), (2, run("8.0 s, 8.0 s", 7.0))])
    assert f"{23 / 15:.2f}x (target >= 1.7x one worker) [NOT met]" in lines[2]
    assert f"{17 / 9:.2f}x without the driver's fixed start-up" in lines[2]


def test_each_ray_round_is_compared_between_the_worker_counts(bench):
    """The Ray part's rounds of one worker count against the other's, read back from
    each build's `time:` line, so a quiet re-measure says which round (the split, the
    buckets, the dates) or the driver alone keeps 2 workers from 2x."""
    def run(wall: float, split: float, buckets: float, partitions: float):
        return bench.BuildRun([], wall=wall, stdout=f"time: split {split} s, buckets {buckets} s, advantages 0.5 s, "
                                                    f"partitions {partitions} s (the buckets' own work: 40.0 s; "
                                                    "the driver's CPU: 1.6 s)")

    (line,) = bench._round_lines([(1, run(80.0, 20.0, 45.0, 10.0)), (2, run(50.0, 10.0, 25.0, 8.0))])
    assert "split 20.0 -> 10.0 (2.00x)" in line and "buckets 45.0 -> 25.0 (1.80x)" in line
    assert "partitions 10.0 -> 8.0 (1.25x)" in line
    assert line.endswith("the driver alone (start-up, advantages, commit, stop) 5.0 -> 7.0")
    assert bench._round_lines([(1, run(80.0, 20.0, 45.0, 10.0))]) == []  # one count: nothing to compare


def test_each_ray_rounds_idle_worker_seconds_are_read_from_the_summary(bench):
    """The build's `ray idle worker-seconds by round` line, by worker count, the
    rounds by name: where a round waits on a worker (a tail, a late process), which
    its CPU-seconds do not show."""
    def run(idle: str):
        return bench.BuildRun([], stdout=f"ray: 8 bucket(s) on 2 worker process(es)\nray idle worker-seconds by round: {idle}")

    lines = bench._idle_lines([(1, run("split_files 1.20 s, run_bucket 0.10 s, stage_day 0.05 s")),
                               (2, run("split_files 2.40 s, run_bucket 0.31 s, stage_day 0.67 s")), (3, run(""))])
    assert len(lines) == 2 and lines[0].startswith("  1 worker(s), idle worker-seconds by round")
    assert lines[1].endswith("tails): split 2.40, buckets 0.31, dates 0.67")


def test_the_ray_title_gives_the_buckets_the_build_made(bench):
    """--build-buckets is a floor: the memory budget made 67 buckets of the 1M benchmark
    while the title said 8. The title gives what each build's summary says, and a
    difference between the worker counts (not the same work) is said."""
    from types import SimpleNamespace

    def run(wall: float, buckets: int):
        return bench.BuildRun([], rc=0, wall=wall, stdout=f"transitions: 625000 rows from 125000 trajectories "
                                                          f"(1000000 spans, {wall} s, {buckets} bucket(s))")

    p, args = SimpleNamespace(total_spans=1_000_000), SimpleNamespace(buckets=0, worker_counts=[1, 2])
    out = bench.ray_lines(p, args, [(1, run(80.0, 67)), (2, run(49.0, 67))])
    assert "--build-buckets 8, at least that many buckets; the build made 67," in out[1]
    assert not any("not the same work" in x for x in out)
    out = bench.ray_lines(p, args, [(1, run(80.0, 67)), (2, run(49.0, 70))])
    assert "the build made 67 and 70" in out[1] and "not the same work" in out[2]
