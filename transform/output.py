"""Writes the transitions dataset one date partition at a time, each partition
replaced whole and atomically, so a reader sees the old day or the new day, never
half of each, and a rebuild over the same input writes the same bytes.

Local folders: the new partition is written beside the old one, then swapped in
with two renames; a crash between them is repaired by the next build (the old one
is put back). Object stores: each file is a single put (atomic), then files the
new partition no longer has are deleted.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Iterable

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import layout, transitions
from nightshift.storage import fsync

FILE = layout.TRANSITIONS_FILE


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def repair(fs: fsspec.AbstractFileSystem, root: str) -> None:
    """Finish or undo a swap a crash interrupted; remove half-written partitions."""
    if not is_local(fs) or not os.path.isdir(root):
        return
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".old-"):
            date_dir = os.path.join(root, name.split("-", 2)[2])
            if not os.path.exists(date_dir):
                os.rename(path, date_dir)  # the new one never arrived: keep the old
            else:
                shutil.rmtree(path, ignore_errors=True)
        elif name.startswith((".new-", ".build-")):
            shutil.rmtree(path, ignore_errors=True)


def write_partition(fs: fsspec.AbstractFileSystem, root: str, date: str, tables: Iterable[pa.Table]) -> int:
    """Replace `<root>/date=<date>/` with the given tables (in order; none: the
    partition is removed). Returns the rows written."""
    part = layout.partition(date)
    final = f"{root}/{part}"
    if is_local(fs):
        os.makedirs(root, exist_ok=True)
        staged = os.path.join(root, f".new-{uuid.uuid4().hex[:8]}-{part}")
        rows = stage(tables, staged)
        commit(root, date, staged, rows)
        return rows
    rows = _write(tables, f"{final}/{FILE}", fs)
    existing = fs.ls(final, detail=False) if fs.exists(final) else []
    for path in existing:
        if not path.rstrip("/").endswith("/" + FILE):
            fs.rm(path)
    if rows == 0 and fs.exists(f"{final}/{FILE}"):
        fs.rm(f"{final}/{FILE}")
    return rows


def stage(tables: Iterable[pa.Table], folder: str) -> int:
    """A local partition written into `folder` (on the output's disk), durable, not yet
    in place: a Ray worker can stage a date while the driver alone commits. Returns
    the rows written (0: nothing staged)."""
    os.makedirs(folder, exist_ok=True)
    rows = _write(tables, os.path.join(folder, FILE), None)
    if rows:
        fsync(folder)
    return rows


def commit(root: str, date: str, staged: str, rows: int) -> None:
    """Swap a staged partition in (two renames; a crash between them is repaired by
    the next build), or, with no rows, remove the partition."""
    part = layout.partition(date)
    final = f"{root}/{part}"
    if rows == 0:
        shutil.rmtree(staged, ignore_errors=True)
        if os.path.exists(final):
            old = os.path.join(root, f".old-{uuid.uuid4().hex[:8]}-{part}")
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        return
    if os.path.exists(final):
        old = os.path.join(root, f".old-{uuid.uuid4().hex[:8]}-{part}")
        os.rename(final, old)
        os.rename(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staged, final)
    fsync(root)


def _write(tables: Iterable[pa.Table], path: str, fs) -> int:
    rows = 0
    writer = None
    sink = fs.open(path, "wb") if fs is not None else None
    try:
        for t in tables:
            if t.num_rows == 0:
                continue
            if writer is None:
                writer = pq.ParquetWriter(sink if sink is not None else path, transitions.SCHEMA, compression="zstd",
                                          compression_level=3)
            writer.write_table(t.cast(transitions.SCHEMA), row_group_size=16384)
            rows += t.num_rows
    finally:
        if writer is not None:
            writer.close()
        if sink is not None:
            sink.close()
    if rows and fs is None:
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
    return rows
