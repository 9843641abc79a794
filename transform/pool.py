"""Advantages pooled over every row of the dataset, whichever dates a build rebuilds.

A row's advantage is its return less a baseline: the mean return of the same task's
trajectories (`group_id`), or of the whole batch. A full build pools every row it
builds. An incremental build rebuilds a few dates, yet their rows move those means,
so the rows of the dates it keeps join the pool: a few of their columns are read
back (ids, return, weight: about 40 bytes a row, what the full build holds too), and
a kept partition whose advantages changed is rewritten with the new ones, every other
column as it was. The pool is then the rows a full build would hold, in the same
order (by transition id), so the sums, and the advantages, are the same to the bit.
"""

from __future__ import annotations

from typing import Iterator

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import layout, transitions

from . import output

#: `transition_id` (32 hex digits) as two integers: the same order, a quarter of the bytes.
ID = ("_hi", "_lo")
_READ = list(layout.needs(layout.TRANSITIONS, "nightshift build"))
_ROW_SCHEMA = transitions.SCHEMA.remove_metadata()


class Unreadable(RuntimeError):
    """A kept transitions partition could not be read back."""


def id_parts() -> list[pl.Expr]:
    tid = pl.col("transition_id")
    return [tid.str.slice(0, 16).str.to_integer(base=16, dtype=pl.UInt64).alias("_hi"),
            tid.str.slice(16, 16).str.to_integer(base=16, dtype=pl.UInt64).alias("_lo")]


def slim(t: pl.DataFrame) -> pl.DataFrame:
    """What the advantage pass needs of each row, in about 40 bytes (ids as integers):
    it is the one thing a build holds for the whole dataset."""
    return t.select(*id_parts(), pl.col("trajectory_id").hash(seed=7),
                    pl.col("group_id").str.to_integer(base=16, dtype=pl.UInt64), "return", "weight")


def add_advantages(t: pa.Table, adv: pl.DataFrame) -> pa.Table:
    """`t`'s rows, in their order, with the advantages of `adv` (by id): a frame's
    spilled rows, or a kept partition's row group. Only the ids go through Polars (the
    join), not the prompts and token ids, which a Polars copy of this converted to
    Polars and back again (about 0.6 ms per thousand rows). A kept partition of an
    older schema version gains the newer columns, null."""
    ids = pl.from_arrow(t.select(["transition_id"])).with_columns(*id_parts()).join(
        adv, on=list(ID), how="left", maintain_order="left")
    t = t.drop_columns([c for c in ("advantage",) if c in t.column_names])
    t = t.append_column("advantage", ids["advantage"].to_arrow())
    for f in _ROW_SCHEMA:  # a spilled frame lacks only the advantage; an older partition, what later versions added
        if f.name not in t.column_names:
            t = t.append_column(f.name, pa.nulls(t.num_rows, f.type))
    return t.select([f.name for f in _ROW_SCHEMA]).cast(_ROW_SCHEMA)


def _path(out_root: str, date: str) -> str:
    return f"{out_root}/{layout.partition(date)}/{output.FILE}"


def read_kept(fs, out_root: str, date: str) -> pl.DataFrame:
    """A kept partition's pool columns, and the advantages it holds now (`_was`)."""
    path = _path(out_root, date)
    try:
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            # a partition of a newer version would be rewritten as this one's, its new columns lost: refused
            layout.check(layout.shown(fs, path), pf.schema_arrow, layout.TRANSITIONS, "nightshift build")
            t = pl.from_arrow(pf.read(columns=_READ))
    except (pa.ArrowException, OSError) as e:
        raise Unreadable(f"the transitions partition {path} cannot be read ({e}): delete it, and the next "
                         "incremental build rebuilds it") from None
    return slim(t).with_columns(t["advantage"].alias("_was"))


def changed(kept: pl.DataFrame, adv: pl.DataFrame) -> bool:
    """Whether any advantage of a kept partition differs from the pool's."""
    both = kept.select(*ID, "_was").join(adv, on=list(ID), how="left")
    return not both.select(pl.col("_was").eq_missing(pl.col("advantage")).all()).item()


def rewrite(fs, out_root: str, date: str, adv: pl.DataFrame) -> int:
    """A kept partition with its advantages replaced, written like any partition."""
    path = _path(out_root, date)

    if not output.is_local(fs):  # the new file replaces the old in place: read the old first
        with fs.open(path, "rb") as fh:
            whole = pq.ParquetFile(fh).read()
        return output.write_partition(fs, out_root, date, [add_advantages(whole, adv)])

    def tables() -> Iterator[pa.Table]:  # locally the new is written beside the old: stream it
        with fs.open(path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            for g in range(pf.num_row_groups):
                yield add_advantages(pf.read_row_group(g), adv)

    return output.write_partition(fs, out_root, date, tables())
