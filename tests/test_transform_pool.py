"""The advantages a kept partition is rewritten with (`pool.rewrite`, an incremental
build's) come from the same Arrow code as a fresh build's partitions (`pool.add_advantages`):
a Polars copy of it (`with_advantages`) computed the same thing and was dropped. Its
code is kept here as the reference both must equal, on partitions of every schema
version (an older one gains the newer columns, null)."""

from __future__ import annotations

import random

import fsspec
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightshift.schemas import layout, transitions
from nightshift.schemas.common import METADATA_VERSION
from nightshift.transform import build as B
from nightshift.transform import output, pool
from nightshift.transform.config import TransformConfig
from traces import agent_run, write_spans

_ROW_SCHEMA = transitions.SCHEMA.remove_metadata()


def with_advantages(df: pl.DataFrame, adv: pl.DataFrame) -> pa.Table:
    """The dropped Polars path, as it was (transform/pool.py before this test)."""
    df = (df.drop("advantage", strict=False).with_columns(*pool.id_parts())
          .join(adv, on=list(pool.ID), how="left", maintain_order="left"))
    df = df.with_columns([pl.lit(None).alias(f.name) for f in _ROW_SCHEMA if f.name not in df.columns])
    return df.select([f.name for f in _ROW_SCHEMA]).to_arrow().cast(_ROW_SCHEMA)


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    data = tmp_path_factory.mktemp("pool") / "data"
    write_spans(str(data), [agent_run(f"{i:032x}", i, calls=1 + i % 3, task=f"t{i % 4}", reward=float(i % 2))
                            for i in range(30)])
    B.build(TransformConfig(data=str(data), settle=0))
    return data


def _as_version(path, version: str) -> None:
    """A partition as a Nightshift of `version` wrote it: without the columns later ones added."""
    t = pq.read_table(path)
    later = [c for v, cols in transitions.ADDED.items() if int(v) > int(version) for c in cols]
    pq.write_table(t.drop(later).replace_schema_metadata({**t.schema.metadata, METADATA_VERSION: version.encode()}),
                   path, row_group_size=7)  # several row groups: the local rewrite streams them


@pytest.mark.parametrize("version", ["1", "2", transitions.VERSION])
def test_a_kept_partition_is_rewritten_with_the_advantages_the_polars_copy_gave(lake, tmp_path, version):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(lake, data)
    out_root = str(data / layout.TRANSITIONS)
    fs = fsspec.filesystem("file")
    paths = sorted((data / layout.TRANSITIONS).rglob("*.parquet"))
    assert paths
    rng = random.Random(int(version))
    for path in paths:
        _as_version(path, version)
        old = pq.read_table(path)
        ids = pl.from_arrow(old.select(["transition_id"])).select(*pool.id_parts())
        adv = ids.with_columns(pl.Series("advantage", [rng.choice([None, rng.uniform(-1, 1)]) for _ in range(ids.height)],
                                         pl.Float64))
        adv = adv.sample(fraction=1.0, shuffle=True, seed=1).filter(pl.int_range(pl.len()) % 5 != 0)  # some not pooled
        want = with_advantages(pl.from_arrow(old), adv)
        got = pool.add_advantages(old, adv)
        assert got.equals(want) and got.schema.equals(want.schema)
        date = path.parent.name.split("=", 1)[1]
        assert pool.rewrite(fs, out_root, date, adv) == old.num_rows
        again = pq.read_table(path)
        assert again.schema.metadata[METADATA_VERSION] == transitions.VERSION.encode()  # written as this version
        assert again.cast(_ROW_SCHEMA).equals(want)
        later = [c for v, cols in transitions.ADDED.items() if int(v) > int(version) for c in cols]
        assert all(again[c].null_count == again.num_rows for c in later)
        assert again["advantage"].null_count >= 1 and again["input_messages"].equals(old["input_messages"])


def test_the_remote_rewrite_reads_the_old_whole_and_gives_the_same(lake, tmp_path, monkeypatch):
    # an object store replaces the file in place: read whole first, the same add_advantages (the one path)
    assert not hasattr(pool, "with_advantages")
    import shutil

    data = tmp_path / "data"
    shutil.copytree(lake, data)
    path = sorted((data / layout.TRANSITIONS).rglob("*.parquet"))[0]
    _as_version(path, "1")
    old = pq.read_table(path)
    adv = pl.from_arrow(old.select(["transition_id"])).select(*pool.id_parts(), pl.lit(0.5).alias("advantage"))
    monkeypatch.setattr(output, "is_local", lambda fs: False)
    date = path.parent.name.split("=", 1)[1]
    assert pool.rewrite(fsspec.filesystem("file"), str(data / layout.TRANSITIONS), date, adv) == old.num_rows
    assert pq.read_table(path).cast(_ROW_SCHEMA).equals(with_advantages(pl.from_arrow(old), adv))
