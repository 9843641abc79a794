"""A bucketed build reads the span files once, in order, when the window's traces lie
close together (`transform/stream.py`): no split pass, the same rows as a build in one
bucket; where traces straggle across the window, the split as before."""

from __future__ import annotations

import copy

import fsspec
import numpy as np
import polars as pl

from nightshift.transform import build as B
from nightshift.transform import stream
from nightshift.transform.config import TransformConfig
from traces import agent_run, write_spans


def parts(t, k: int):
    """One trace's spans as two traces of the same id: the first `k` spans and the rest,
    to write into two files (a trace a collector flushed half before a cut, half after)."""
    a, b = copy.copy(t), copy.copy(t)
    a.spans, b.spans = t.spans[:k], t.spans[k:]
    return a, b


def budget(data, buckets: int) -> int:
    """The memory budget that cuts the spans under `data` into `buckets` buckets."""
    fs = fsspec.filesystem("file")
    sizes = B.group_bytes(fs, [str(p) for p in (data / "spans").rglob("*.parquet")])
    return int(sum(sum(s) for s in sizes.values()) * B.OVERHEAD / (buckets - 0.5))


def one_bucket(tmp_path, data) -> pl.DataFrame:
    again = tmp_path / "again"
    again.mkdir()
    (again / "spans").symlink_to(data / "spans", target_is_directory=True)
    B.build(TransformConfig(data=str(again), settle=0))
    return pl.read_parquet(f"{again}/transitions/date=*/*.parquet").sort("transition_id")


def test_a_window_whose_traces_lie_together_is_read_once_without_a_split(tmp_path, monkeypatch):
    """Three files, a trace in each pair of neighbours written half in one and half in
    the next: buckets of whole traces straight from the files, the same rows as one
    bucket. (Before, any window over the budget was split: every span read, copied
    into its bucket's order, written lz4 and read back.)"""
    data = tmp_path / "data"
    runs = [agent_run(f"stream-{i}", i, calls=3, task=f"task {i % 5}", reward=float(i % 3) / 2) for i in range(48)]
    files = [runs[k:k + 4] for k in range(0, 48, 4)]
    for f in range(0, 11, 2):  # the last trace of every other file goes on in the next one
        head, tail = parts(files[f][-1], 3)
        files[f][-1] = head
        files[f + 1].insert(0, tail)
    for f, traces in enumerate(files):
        write_spans(str(data), traces, batch=f"b{f:02d}")

    def no_split(*a, **kw):
        raise AssertionError("the window was split")

    monkeypatch.setattr(B, "_split", no_split)
    s = B.build(TransformConfig(data=str(data), settle=0, memory_budget=budget(data, 4)))
    assert s.buckets == 4 and s.transitions == 48 * 3 and not s.unreadable
    many = pl.read_parquet(f"{data}/transitions/date=*/*.parquet").sort("transition_id")
    monkeypatch.undo()
    assert many.equals(one_bucket(tmp_path, data))  # every column, the advantages too


def test_traces_that_straggle_across_the_window_are_split_as_before(tmp_path, monkeypatch):
    """Every trace's reward span in the window's last file: each trace ends there, so
    a stream would hold the whole window until its last bucket. The plan says so and
    the build splits, with the same rows."""
    data = tmp_path / "data"
    runs = [agent_run(f"late-{i}", i, calls=2, task=f"task {i % 4}", reward=1.0) for i in range(30)]
    early, late = zip(*(parts(t, len(t.spans) - 1) for t in runs))
    write_spans(str(data), list(early[:15]), batch="b0")
    write_spans(str(data), list(early[15:]), batch="b1")
    write_spans(str(data), list(late), batch="b2")
    split = []
    real = B._split

    def spy(*a, **kw):
        split.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(B, "_split", spy)
    s = B.build(TransformConfig(data=str(data), settle=0, memory_budget=20_000))
    assert s.buckets >= 3 and s.transitions == 60 and split
    many = pl.read_parquet(f"{data}/transitions/date=*/*.parquet").sort("transition_id")
    assert many.equals(one_bucket(tmp_path, data))


def test_each_bucket_holds_whole_traces_each_span_once_in_the_files_order(tmp_path):
    data = tmp_path / "data"
    runs = [agent_run(f"order-{i}", i, calls=2, task="t", reward=1.0) for i in range(40)]
    files = [runs[k:k + 5] for k in range(0, 40, 5)]
    for f in (1, 3, 5):
        head, tail = parts(files[f][-1], 2)
        files[f][-1] = head
        files[f + 1].insert(0, tail)
    for f, traces in enumerate(files):
        write_spans(str(data), traces, batch=f"b{f}")
    fs = fsspec.filesystem("file")
    sources = [B._Source(str(p), "d") for p in sorted((data / "spans").rglob("*.parquet"))]
    paths = [src.path for src in sources]
    plan = stream.plan(fs, paths, B.group_bytes(fs, paths), 4)
    assert plan is not None and len(plan.cuts) >= 3
    reader = stream.Stream(plan, sources, lambda src, bad: B._numbered_groups(fs, src, B.SPAN_COLUMNS, bad))
    bad: list[str] = []
    buckets = [reader.bucket(k, bad) for k in range(reader.buckets)]
    whole = B._read(fs, sources, B.SPAN_COLUMNS)
    seen: set[str] = set()
    for got in buckets:
        traces = set(got["trace_id"].to_list())
        assert not traces & seen  # a trace in one bucket only
        seen |= traces
        want = whole.filter(pl.col("trace_id").is_in(list(traces)))
        assert got.equals(want)  # all of its spans, in the files' order
    assert seen == set(whole["trace_id"].to_list()) and not bad
    assert sum(len(x) for x in plan.lasts) == whole.height  # a bucket for each span


def test_the_plan_cuts_are_by_bytes_and_say_none_for_one_bucket(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [agent_run(f"one-{i}", i, calls=1, task="t", reward=1.0) for i in range(8)])
    fs = fsspec.filesystem("file")
    paths = [str(p) for p in (data / "spans").rglob("*.parquet")]
    sizes = B.group_bytes(fs, paths)
    assert stream.plan(fs, paths, sizes, 1) is None
    assert stream.plan(fs, paths, {p: None for p in paths}, 4) is None  # a footer that cannot be read: the split names it


def test_a_row_group_that_cannot_be_read_is_named_and_the_rest_still_read():
    """The plan read `trace_id`; the row group's other columns then fail: it is named
    (as the split names it) and its neighbours' spans are still in their buckets."""
    import pyarrow as pa

    def table(g: int) -> pa.Table:
        return pa.table({"trace_id": [f"t{g}a", f"t{g}b"], "g": [g, g]})

    def read(src, bad):
        for g in range(3):
            if g == 1:
                bad.append(f"{src}: row group 2 of 3 unreadable, its 2 rows skipped")
                continue
            yield g, table(g)

    mine = [np.array([0, 0], np.uint32), np.array([0, 1], np.uint32), np.array([1, 1], np.uint32)]
    plan = stream.Plan(cuts=[2, 5], groups=[(0, 0), (0, 1), (0, 2)], first=[0, 2, 4], lasts=mine)
    reader = stream.Stream(plan, ["f.parquet"], read)
    bad: list[str] = []
    first, second = reader.bucket(0, bad), reader.bucket(1, bad)
    assert first["trace_id"].to_list() == ["t0a", "t0b"] and second["trace_id"].to_list() == ["t2a", "t2b"]
    assert bad == ["f.parquet: row group 2 of 3 unreadable, its 2 rows skipped"]


def test_a_span_file_of_a_newer_schema_is_one_sentence_when_streamed_too(tmp_path):
    """The stream reads row groups through the split's reader, so a file the build must
    not read stops it with the same sentence (`nightshift build` exits 2)."""
    import pyarrow.parquet as pq
    import pytest

    from nightshift.schemas.layout import LayoutError

    data = tmp_path / "data"
    runs = [agent_run(f"newer-{i}", i, calls=2, task="t", reward=1.0) for i in range(24)]
    for f in range(6):
        write_spans(str(data), runs[4 * f:4 * f + 4], batch=f"b{f}")
    (spoiled,) = (data / "spans").rglob("part-b5.parquet")
    table = pq.read_table(spoiled)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"nightshift.schema_version": b"99"}),
                   spoiled)
    fs = fsspec.filesystem("file")
    paths = [str(p) for p in sorted((data / "spans").rglob("*.parquet"))]
    assert stream.plan(fs, paths, B.group_bytes(fs, paths), 3) is not None  # streamed, not split
    with pytest.raises(LayoutError) as e:
        B.build(TransformConfig(data=str(data), settle=0, memory_budget=budget(data, 3)))
    assert str(e.value).startswith(f"{spoiled} is spans schema version 99") and "\n" not in str(e.value)
