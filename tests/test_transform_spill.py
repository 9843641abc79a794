"""Item 2 of issue 28: a build's memory is bounded at any size. The advantages are
pooled over every row of the window, yet computed from the per-bucket parts spilled
to disk, a part of about `spill.ROWS_PER_PART` rows at a time, never from one table
of the whole window's rows; and they are the advantages `credit.advantages` gives on
the whole pool (to the bit in one part, whatever the bucket count in any)."""

from __future__ import annotations

import os
import random

import polars as pl
import pytest

from nightshift.transform import build as B
from nightshift.transform import credit, pool, spill
from nightshift.transform.config import TransformConfig
from traces import Trace, agent_run, write_logs, write_spans

S = 10**9


def pool_frame(n: int, seed: int) -> pl.DataFrame:
    """`n` rows as `pool.slim` makes them: trajectories of 1 to 3 calls in a few
    groups (some null), some unrated."""
    rng = random.Random(seed)
    rows, i = [], 0
    while len(rows) < n:
        group = rng.choice([None, 1, 2, 3, 4, 5])
        ret = rng.choice([None, 0.0, 0.25, 1.0, rng.random()])
        steps = rng.randint(1, 3)
        for _ in range(steps):
            rows.append({"_hi": rng.getrandbits(64), "_lo": rng.getrandbits(64), "trajectory_id": i,
                         "group_id": group, "return": ret, "weight": 1.0 / steps})
        i += 1
    return pl.DataFrame(rows[:n], schema={"_hi": pl.UInt64, "_lo": pl.UInt64, "trajectory_id": pl.UInt64,
                                          "group_id": pl.UInt64, "return": pl.Float64, "weight": pl.Float64})


def spilled(df: pl.DataFrame, files: int, folder) -> list[str]:
    """`df` cut into `files` bucket parts, advantages from the spill, in id order."""
    df = df.with_row_index("_r").with_columns((pl.col("_r") % files).cast(pl.UInt64).alias("_part")).drop("_r")
    paths = [spill.write_ipc(part, str(folder / f"slim-{k}.arrow"))
             for k, (_, part) in enumerate(sorted(df.partition_by("_part", as_dict=True).items()))]
    return paths


@pytest.mark.parametrize("baseline,normalize", [("group", False), ("group", True), ("batch", False),
                                                ("batch", True), ("none", False), ("none", True)])
def test_one_part_is_credit_advantages_to_the_bit(tmp_path, baseline, normalize):
    df = pool_frame(3000, 1)
    want = df.sort(*pool.ID)
    want = want.select(*pool.ID, credit.advantages(want, baseline, normalize))
    for files in (1, 7):
        (tmp_path / f"in{files}").mkdir()
        adv = spill.advantages(spilled(df, files, tmp_path / f"in{files}"), str(tmp_path / f"adv{files}"), baseline,
                               normalize)
        assert adv.parts == 1
        got = pl.concat([adv.of(p) for p in range(files)]).sort(*pool.ID)
        assert got.equals(want), (files, baseline, normalize)


def test_many_parts_give_the_same_advantages_whatever_the_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "ROWS_PER_PART", 400)
    df = pool_frame(3000, 2)
    want = df.sort(*pool.ID)
    want = want.select(*pool.ID, credit.advantages(want, "group", True))
    results = []
    for files in (1, 5, 11):
        (tmp_path / f"in{files}").mkdir()
        adv = spill.advantages(spilled(df, files, tmp_path / f"in{files}"), str(tmp_path / f"adv{files}"), "group",
                               True)
        assert adv.parts == 8
        results.append(pl.concat([adv.of(p) for p in range(files)]).sort(*pool.ID))
    assert results[0].equals(results[1]) and results[0].equals(results[2])  # to the bit, whatever the buckets
    both = results[0].join(want, on=list(pool.ID), suffix="_whole")
    assert both.height == 3000
    diff = both.select((pl.col("advantage") - pl.col("advantage_whole")).abs().max()).item()
    assert diff < 1e-12  # the batch's sums are added part by part: the same up to rounding


def test_no_table_of_the_whole_windows_rows_is_held(tmp_path, monkeypatch):
    """The pool of a window in many buckets is never one frame: every frame of pool
    columns the build makes holds one bucket's rows or one part's. (Before the
    spill, the whole window's pool was concatenated, sorted and joined in memory.)"""
    data = tmp_path / "data"
    traces = [agent_run(f"spill-{i}", i, calls=3, task=f"task {i % 7}", reward=float(i % 3) / 2) for i in range(60)]
    write_spans(str(data), traces)
    monkeypatch.setattr(spill, "ROWS_PER_PART", 20)
    sizes: list[int] = []
    real = pl.concat

    def concat(items, *a, **kw):
        out = real(items, *a, **kw)
        if isinstance(out, pl.DataFrame) and "return" in out.columns and "_hi" in out.columns:
            sizes.append(out.height)
        return out

    monkeypatch.setattr(pl, "concat", concat)
    s = B.build(TransformConfig(data=str(data), settle=0, memory_budget=20_000))
    assert s.transitions == 180 and s.buckets >= 8
    assert sizes and max(sizes) <= 60, sizes  # a part: 20 rows give or take a group; never the window's 180
    monkeypatch.setattr(pl, "concat", real)
    again = tmp_path / "again"
    again.mkdir()
    (again / "spans").symlink_to(data / "spans", target_is_directory=True)
    B.build(TransformConfig(data=str(again), settle=0))  # one bucket, one part: the same rows
    one = pl.read_parquet(f"{again}/transitions/date=*/*.parquet").sort("transition_id")
    many = pl.read_parquet(f"{data}/transitions/date=*/*.parquet").sort("transition_id")
    assert one.select(pl.exclude("advantage")).equals(many.select(pl.exclude("advantage")))
    assert (one["advantage"] - many["advantage"]).abs().max() < 1e-12


def test_log_events_are_split_by_bucket_not_read_for_the_whole_window(tmp_path, monkeypatch):
    """GenAI log events (the content of the instrumentations that log it) go to the
    bucket of their trace with the spans: no bucket, and not the driver, reads the
    window's events at once; the rows are those of a build in one bucket. (Before,
    the driver read every event of the window into one frame and sent it to every
    bucket.)"""
    data = tmp_path / "data"
    traces, events = [], []
    for i in range(30):
        t = Trace(f"logs-{i}")
        s = t.span("chat m1", {"gen_ai.operation.name": "chat", "gen_ai.system": "openai"}, start=i, end=i + 1)
        traces.append(t)
        events += [{"trace": t, "span": s, "name": "gen_ai.user.message", "body": {"content": f"question {i}"}},
                   {"trace": t, "span": s, "name": "gen_ai.choice", "body": {
                       "index": 0, "finish_reason": "stop", "message": {"content": f"answer {i}"}}}]
    write_spans(str(data), traces)
    write_logs(str(data), events)
    read: list[int] = []
    real = B._read

    def spy(fs, sources, columns, bad=None, dataset=B.layout.SPANS):
        out = real(fs, sources, columns, bad, dataset)
        if dataset == B.layout.LOGS:
            read.append(out.height)
        return out

    monkeypatch.setattr(B, "_read", spy)
    s = B.build(TransformConfig(data=str(data), settle=0, memory_budget=20_000))
    assert s.buckets >= 3 and s.transitions == 30
    assert not read or max(read) < 60, read  # never the window's 60 events in one frame
    many = pl.read_parquet(f"{data}/transitions/date=*/*.parquet").sort("transition_id")
    assert set(many["output_message"].struct.field("content")) == {f"answer {i}" for i in range(30)}  # from the logs
    monkeypatch.setattr(B, "_read", real)
    again = tmp_path / "again"
    again.mkdir()
    for name in ("spans", "logs"):
        (again / name).symlink_to(data / name, target_is_directory=True)
    B.build(TransformConfig(data=str(again), settle=0))  # one bucket: the same rows
    one = pl.read_parquet(f"{again}/transitions/date=*/*.parquet").sort("transition_id")
    assert one.select(pl.exclude("advantage")).equals(many.select(pl.exclude("advantage")))


def test_a_spilled_frame_read_as_arrow_gets_the_advantages_with_advantages_gives(tmp_path):
    # the partitions read each frame's rows as Arrow and join only their ids (pool.add_advantages)
    import pyarrow as pa
    import test_transform_pool
    import transitions_data as TD

    from nightshift.schemas import transitions

    rows = [TD.row(f"question {i}", f"answer {i}", float(i % 4), step=i % 3, prompt_token_ids=[i, i + 1],
                   completion_token_ids=[7], completion_logprobs=[-0.5]) for i in range(40)]
    df = pl.from_arrow(pa.Table.from_pylist(rows, schema=transitions.SCHEMA)).drop("advantage")
    path = spill.write_ipc(df, str(tmp_path / "rows.arrow"))
    ids = df.select(*pool.id_parts())
    rng = random.Random(3)
    want = [rng.choice([None, rng.uniform(-1, 1)]) for _ in range(df.height)]
    adv = ids.with_columns(pl.Series("advantage", want, pl.Float64)).sample(fraction=1.0, shuffle=True, seed=5)
    adv = adv.filter(pl.int_range(pl.len()) % 7 != 0)  # some ids not in the pool: null
    got = pool.add_advantages(spill.read_arrow(path), adv)
    old = test_transform_pool.with_advantages(spill.read_ipc(path), adv)  # the dropped Polars path
    assert got.equals(old) and got.schema.equals(old.schema) and got.num_rows == 40
    by_id = {(h, lo): a for h, lo, a in adv.iter_rows()}
    assert got["advantage"].to_pylist() == [by_id.get(k) for k in ids.iter_rows()]
    assert got["prompt_token_ids"].to_pylist()[:2] == [[0, 1], [1, 2]]


def test_a_buckets_split_pieces_read_back_as_the_spans_of_its_traces_in_order(tmp_path):
    # `_read_bucket` reads one run's piece with Polars' reader, several runs' with pyarrow:
    # either way each bucket holds its traces' spans as the files had them, in their order
    import fsspec

    data = tmp_path / "data"
    for b in range(3):  # three span files, so three pieces of each bucket
        write_spans(str(data), [agent_run(f"{b}{i:031x}", i, calls=2, task=f"t{i % 3}", reward=1.0) for i in range(12)],
                    batch=f"b{b}")
    files = sorted(str(p) for p in (data / "spans").rglob("*.parquet"))
    assert len(files) == 3
    fs = fsspec.filesystem("file")
    src = [B._Source(f, "d") for f in files]
    whole = B._read(fs, src, B.SPAN_COLUMNS)
    one = B._split(fs, src, 4, str(tmp_path), 2_000, [])  # one run: a batch per file in each piece
    runs = [B._split(fs, [s], 4, str(tmp_path), 2_000, [], tag=f"-{k}") for k, s in enumerate(src)]
    for b in range(4):
        want = whole.filter(B._bucket_of(pl.col("trace_id"), 4) == b)
        assert want.height and B._read_bucket([one[b]], consume=True).equals(want)
        assert B._read_bucket([r[b] for r in runs]).equals(want)
    assert not any(os.path.exists(p) for p in one)  # consumed


def test_the_split_lets_each_row_group_go_once_it_is_in_bucket_order(tmp_path):
    # a cut took every held group into bucket order while still holding all the groups:
    # its Arrow peak was 2.7x what it held (4 files here), now 1.9x (-70 MiB of the 100k
    # benchmark's split: 624-628 -> 552-559 MiB peak RSS)
    import fsspec
    import pyarrow as pa

    data = tmp_path / "data"
    for b in range(4):
        write_spans(str(data), [agent_run(f"{b}{i:031x}", i, calls=3, task=f"t{i % 3}", reward=1.0,
                                          answer="answer {k} " + "x" * 3000) for i in range(40)], batch=f"b{b}")
    fs = fsspec.filesystem("file")
    src = [B._Source(str(p), "d") for p in sorted((data / "spans").rglob("*.parquet"))]
    held = sum(t.nbytes for s in src for t in B._row_groups(fs, s, B.SPAN_COLUMNS, []))
    base = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(base)  # its own high-water mark, whatever ran before
    pa.set_memory_pool(pool)
    try:
        paths = B._split(fs, src, 3, str(tmp_path), 10**9, [])  # one cut: all four groups held at once
    finally:
        pa.set_memory_pool(base)
    assert pool.max_memory() < 2.3 * held, pool.max_memory() / held
    whole = B._read(fs, src, B.SPAN_COLUMNS)
    for b, path in enumerate(paths):  # and the same pieces
        assert B._read_bucket([path]).equals(whole.filter(B._bucket_of(pl.col("trace_id"), 3) == b))
