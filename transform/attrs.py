"""Span attributes out of Arrow: as plain dicts for the few spans read in Python,
and as columns (vectorized) for the decisions taken on every span.

Reading every span's attributes in Python would cost more than the rest of the
build together, so only LLM calls, agents and reward carriers are read that way;
which spans those are is decided in Polars on the keys alone.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa


def _value(t: str | None, s, i, d, b, j, by) -> Any:
    if t == "string":
        return s
    if t == "int":
        return i
    if t == "double":
        return d
    if t == "bool":
        return b
    if t in ("array", "kvlist"):
        try:
            return json.loads(j) if j is not None else None
        except json.JSONDecodeError:
            return j
    if t == "bytes":
        return by
    return None


def to_dicts_without(column: pl.Series, keys: frozenset[str]) -> list[dict[str, Any]]:
    """`to_dicts` of a Polars attributes column whose entries under `keys` only say
    they are there (True): token-id lists are read in Polars (`calls.token_columns`)
    and are most of a call's bytes, so they stay behind when the rest is copied out."""
    k = pl.element().struct.field("key")
    sk = sorted(keys)
    # exported as string views, zero-copy: a plain export would copy every buffer the
    # views point into, token ids included
    out = to_dicts(column.list.eval(pl.element().filter(~k.is_in(sk))).to_arrow(compat_level=pl.CompatLevel.newest()))
    present = column.list.eval(k.filter(k.is_in(sk)))
    for i in (present.list.len() > 0).arg_true().to_list():
        for key in present[i]:
            out[i][key] = True
    return out


def to_dicts(column: pa.Array | pa.ChunkedArray) -> list[dict[str, Any]]:
    """A list<struct{key, value: ANY_VALUE}> column as one `{key: python value}` per
    row (arrays and kvlists decoded from their JSON); nulls become `{}`. Large values
    read elsewhere stay out by `to_dicts_without`."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(column)
    if n == 0:
        return []
    offsets = column.offsets.to_pylist()
    base = offsets[0]
    flat = column.values.slice(base, offsets[-1] - base)
    keys = flat.field("key").to_pylist()
    v = flat.field("value")
    if pa.types.is_string_view(v.type.field("json_value").type):  # Polars' zero-copy export: `take` wants plain strings
        v = v.cast(pa.struct([pa.field(f.name, pa.large_string() if pa.types.is_string_view(f.type) else
                                       pa.large_binary() if pa.types.is_binary_view(f.type) else f.type) for f in v.type]))
    types = v.field("type").to_numpy(zero_copy_only=False)
    values = v.field("string_value").to_pylist()
    for name, tname in (("int_value", "int"), ("double_value", "double"), ("bool_value", "bool"), ("bytes_value", "bytes")):
        idx = np.flatnonzero(types == tname)
        if len(idx):
            for i, x in zip(idx.tolist(), v.field(name).take(pa.array(idx)).to_pylist()):
                values[i] = x
    idx = np.flatnonzero((types == "array") | (types == "kvlist"))
    if len(idx):
        for i, j in zip(idx.tolist(), v.field("json_value").take(pa.array(idx)).to_pylist()):
            try:
                values[i] = json.loads(j) if j is not None else None
            except json.JSONDecodeError:
                values[i] = j
    out: list[dict[str, Any]] = []
    for r in range(n):
        a, b = offsets[r] - base, offsets[r + 1] - base
        out.append(dict(zip(keys[a:b], values[a:b])))
    return out


def long_form(df: pl.DataFrame, keep: pl.Expr, column: str = "attributes") -> pl.DataFrame:
    """`row, key, text, number` for the attributes whose key passes `keep` (an
    expression on `pl.col("key")`): `text` is the value as text (JSON for arrays),
    `number` its numeric value where it has one. Keys are filtered before values
    are touched, so long prompts are never copied."""
    v = pl.col("value")
    return (
        df.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("row"), pl.col(column))
        .explode(column)
        .filter(pl.col(column).is_not_null())
        .select("row", pl.col(column).struct.field("key").alias("key"), pl.col(column).struct.field("value").alias("value"))
        .filter(keep)
        .select(
            "row",
            "key",
            pl.coalesce(
                v.struct.field("string_value"),
                v.struct.field("int_value").cast(pl.String),
                v.struct.field("double_value").cast(pl.String),
                v.struct.field("bool_value").cast(pl.String),
                v.struct.field("json_value"),
            ).alias("text"),
            pl.coalesce(
                v.struct.field("double_value"),
                v.struct.field("int_value").cast(pl.Float64),
                v.struct.field("bool_value").cast(pl.Float64),
                v.struct.field("string_value").cast(pl.Float64, strict=False),
            ).alias("number"),
        )
    )


def first_of(long: pl.DataFrame, n_rows: int, columns: dict[str, tuple[str, ...]], what: str = "text") -> pl.DataFrame:
    """One column per entry of `columns` (name -> keys, first present wins), `n_rows`
    long, null where none of the keys is there. All the columns in one pass (a join
    on a table of (key, column, rank), then a pivot): a filter, sort, group and join
    per column cost about 70 Polars operations per bucket for `classify`, a fixed
    cost that a bucket of a few thousand spans paid as much as its rows."""
    spec = pl.DataFrame([(k, name, i) for name, keys in columns.items() for i, k in enumerate(keys)],
                        schema={"key": pl.String, "_name": pl.String, "_p": pl.Int32}, orient="row")
    hit = (long.select("row", "key", what).join(spec, on="key", how="inner", maintain_order="left")  # a key can feed two
           .sort("row", "_name", "_p", maintain_order=True)
           .group_by("row", "_name", maintain_order=True).agg(pl.col(what).first()))
    out = pl.DataFrame({"row": pl.arange(0, n_rows, dtype=pl.UInt32, eager=True)})
    if hit.height:
        out = out.join(hit.pivot(on="_name", index="row", values=what, aggregate_function=None), on="row", how="left",
                       maintain_order="left")
    dtype = long.schema[what]
    return out.select("row", *[pl.col(c) if c in out.columns else pl.lit(None, dtype).alias(c) for c in columns])
