"""Advantages from spilled per-bucket parts: the pool of every row (see `pool`) never
held whole in memory, whatever the size of the window.

Each bucket writes its rows' pool columns (`pool.slim`, about 40 bytes a row) to a
file; here they are regrouped by a hash of `group_id` into as many parts as it takes
to hold about `ROWS_PER_PART` rows each, so every group's rows are in one part. A
first pass sums each part's weights and returns (the batch baseline: three numbers
per part, added in part order), a second computes each part's advantages, its groups'
sums over its own rows, and writes them out by the frame they go back to.

The part count depends on the number of rows alone, and each part is sorted by id
before anything is summed, so the sums (and the advantages, to the bit) are the same
whatever the bucket count, the engine, or which dates an incremental build rebuilt.
One part is `credit.advantages` over the whole pool, exactly.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from . import pool

#: Rows regrouped at once: about 60 bytes each while a part is sorted and summed.
ROWS_PER_PART = 1 << 20
_ADV = {"_hi": pl.UInt64, "_lo": pl.UInt64, "advantage": pl.Float64}


def write_ipc(df: pl.DataFrame, path: str) -> str:
    """`df` as an Arrow IPC file, whole or not at all: a bucket's task killed half way
    (and retried) must never leave a part the driver would read."""
    tmp = f"{path}.{os.getpid()}.tmp"
    table = df.to_arrow()  # pyarrow's writer: a third less CPU than Polars' on the rows' nested columns
    with pa.ipc.new_file(tmp, table.schema, options=pa.ipc.IpcWriteOptions(compression="lz4")) as writer:
        writer.write_table(table)
    os.replace(tmp, path)
    return path


def read_ipc(path: str) -> pl.DataFrame:
    return pl.from_arrow(read_arrow(path)).rechunk()


def read_arrow(path: str) -> pa.Table:
    with pa.ipc.open_file(path) as f:  # not pl.read_ipc: Polars keeps the file mapped
        return f.read_all()


def rows_in(path: str) -> int:
    with pa.ipc.open_file(path) as f:
        return sum(f.get_batch(i).num_rows for i in range(f.num_record_batches))


@dataclass
class Advantages:
    """Each frame's advantages (by `_part`), in files under `folder`."""

    folder: str
    parts: int

    def of(self, part: int) -> pl.DataFrame:
        frames = [read_ipc(p) for k in range(self.parts)
                  if os.path.exists(p := os.path.join(self.folder, f"adv-{part}-{k:04d}.arrow"))]
        if not frames:
            return pl.DataFrame(schema=_ADV)
        return pl.concat(frames)


def _part_of(k: int) -> pl.Expr:
    return (pl.col("group_id").hash(seed=11) % k).cast(pl.Int64).alias("_k")


def advantages(slim_files: list[str], folder: str, baseline: str, normalize: bool, eps: float = 1e-6) -> Advantages:
    """The advantage of every row in `slim_files` (each `pool.slim` with `_part`),
    as `credit.advantages` defines it, written under `folder`."""
    os.makedirs(folder, exist_ok=True)
    total = sum(rows_in(p) for p in slim_files)
    k = max(1, math.ceil(total / ROWS_PER_PART))
    for i, path in enumerate(slim_files):  # regroup: every group's rows into one part
        df = read_ipc(path)
        if k == 1:
            write_ipc(df, os.path.join(folder, f"g0000-{i:05d}.arrow"))
            continue
        for (key,), sub in df.with_columns(_part_of(k)).partition_by("_k", as_dict=True, include_key=False).items():
            write_ipc(sub, os.path.join(folder, f"g{key:04d}-{i:05d}.arrow"))
        del df

    def part(key: int) -> pl.DataFrame:
        names = sorted(n for n in os.listdir(folder) if n.startswith(f"g{key:04d}-"))
        if not names:
            return pl.DataFrame()
        return pl.concat([read_ipc(os.path.join(folder, n)) for n in names]).sort(*pool.ID)

    rated = pl.col("return").is_not_null()
    w = pl.when(rated).then(pl.col("weight")).otherwise(0.0)
    r = pl.col("return").fill_null(0.0)
    sw = swr = swrr = 0.0
    for key in range(k):  # the batch's sums, part by part, in part order
        df = part(key)
        if df.height:
            a, b, c = df.select(w.sum().alias("a"), (w * r).sum().alias("b"), (w * r * r).sum().alias("c")).row(0)
            sw, swr, swrr = sw + a, swr + b, swrr + c
    b_mean = swr / sw if sw else math.nan
    b_std = math.sqrt(max(swrr / sw - b_mean * b_mean, 0.0)) if sw else math.nan
    for key in range(k):
        df = part(key)
        if not df.height:
            continue
        adv = df.select(*pool.ID, "_part", _advantage(baseline, normalize, b_mean, b_std, eps))
        for (p,), sub in adv.partition_by("_part", as_dict=True, include_key=False).items():
            write_ipc(sub, os.path.join(folder, f"adv-{p}-{key:04d}.arrow"))
        del df, adv
    for name in os.listdir(folder):
        if name.startswith("g"):
            os.remove(os.path.join(folder, name))
    return Advantages(folder, k)


def _advantage(baseline: str, normalize: bool, b_mean: float, b_std: float, eps: float) -> pl.Expr:
    """`credit.advantages`, with the batch's mean and deviation given (summed over
    every part) and the groups' computed over this part's rows (each group is whole
    in one part)."""
    rated = pl.col("return").is_not_null()
    w = pl.when(rated).then(pl.col("weight")).otherwise(0.0)
    r = pl.col("return").fill_null(0.0)
    if baseline == "none":
        adv = pl.col("return")
        if normalize:
            adv = pl.when(pl.lit(b_std) > eps).then(adv / pl.lit(b_std)).otherwise(0.0)
        return pl.when(rated).then(adv).alias("advantage")
    mean, std = pl.lit(b_mean, pl.Float64), pl.lit(b_std, pl.Float64)
    if baseline == "group":
        g_sw = w.sum().over("group_id")
        g_mean = (w * r).sum().over("group_id") / g_sw
        g_std = ((w * r * r).sum().over("group_id") / g_sw - g_mean * g_mean).clip(lower_bound=0.0).sqrt()
        n_traj = pl.col("trajectory_id").filter(rated).n_unique().over("group_id")
        use_group = pl.col("group_id").is_not_null() & (n_traj >= 2)
        mean = pl.when(use_group).then(g_mean).otherwise(mean)
        std = pl.when(use_group).then(g_std).otherwise(std)
    adv = pl.col("return") - mean
    if normalize:
        adv = pl.when(std > eps).then(adv / std).otherwise(0.0)
    return pl.when(rated).then(adv).alias("advantage")
