"""Writes the transitions dataset one date partition at a time, each partition
replaced whole and atomically, so a reader sees the old day or the new day, never
half of each, and a rebuild over the same input writes the same bytes.

Local folders: the new partition is written beside the old one, then swapped in
with two renames; a crash between them is repaired by the next build (the old one
is put back). Object stores: each file is a single put (atomic), then files the
new partition no longer has are deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from typing import Iterable, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import layout, transitions
from nightshift.storage import fsync

FILE = layout.TRANSITIONS_FILE


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


#: Beside the lake's datasets: a build holds it (flock) from its first repair to its last rename.
LOCK = ".build.lock"


class Busy(RuntimeError):
    """Another build is writing the same transitions."""


@contextlib.contextmanager
def held(fs: fsspec.AbstractFileSystem, lake: str) -> Iterator[None]:
    """One build at a time on a local lake. A second one's `repair` took the first's
    scratch for a crash's leftovers and removed it (the first died on a missing bucket
    file); now it is refused with one sentence. The kernel drops the lock when its
    holder dies, however it dies, so a crash never leaves the lake locked."""
    if not is_local(fs) or not os.path.isdir(lake):  # no lake: the build says so itself
        yield
        return
    fh = open(os.path.join(lake, LOCK), "a+")
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            who = fh.read().strip() or "a process"
            raise Busy(f"another build ({who}) is writing {lake}: wait for it to finish") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}")
        fh.flush()
        yield
    finally:
        fh.close()


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


def place(fs: fsspec.AbstractFileSystem, tmp: str, path: str) -> None:
    """Put the finished file `tmp` (on this machine) at `path` whole or not at all: on
    a local lake it lies beside `path` and is synced, renamed and its folder synced;
    on an object store it is one upload, so readers see the old object or the new
    one. `tmp` is gone afterwards, placed or not. Rewrites that replace files in a
    lake (retention, compaction) land this one way."""
    try:
        if is_local(fs):
            fsync(tmp)
            os.replace(tmp, path)
            fsync(path.rsplit("/", 1)[0])
        else:
            fs.put_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


#: Column paths whose values rarely repeat: message text, token ids, logprobs, per-row ids.
_UNIQUE = frozenset({"input_messages.list.element.content", "output_message.content", "prompt_token_ids.list.element",
                     "completion_token_ids.list.element", "completion_logprobs.list.element", "transition_id",
                     "span_id"})
#: Of those, the values no reader filters on (min/max of prompts and id lists).
_NO_STATS = frozenset(c for c in _UNIQUE if c not in ("transition_id", "span_id"))


def _leaves(fields: Iterable[pa.Field], prefix: str = "") -> list[str]:
    """Parquet's column paths of an Arrow schema (`a.list.element.b`)."""
    out = []
    for f in fields:
        t, name = f.type, prefix + f.name
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            out += _leaves([t.value_field.with_name("element")], name + ".list.")
        elif pa.types.is_struct(t):
            out += _leaves(list(t), name + ".")
        else:
            out.append(name)
    return out


#: How the transitions are written (the benchmark's floor writes with the same). A
#: dictionary only where values repeat: on prompts and token ids one was built, found
#: too large and dropped, a third of the write's CPU for files 7 % larger; zstd 1, not
#: 3, for the rest of that third (the 100k benchmark's first date: 0.51-0.56 -> 0.37
#: CPU-s, 33.0 -> 30.6 MB). Every encoding and codec here is one all readers read.
WRITER = dict(compression="zstd", compression_level=1,
              use_dictionary=[c for c in _leaves(transitions.SCHEMA) if c not in _UNIQUE],
              write_statistics=[c for c in _leaves(transitions.SCHEMA) if c not in _NO_STATS])


def _write(tables: Iterable[pa.Table], path: str, fs) -> int:
    rows = 0
    writer = None
    sink = fs.open(path, "wb") if fs is not None else None
    try:
        for t in tables:
            if t.num_rows == 0:
                continue
            if writer is None:
                writer = pq.ParquetWriter(sink if sink is not None else path, transitions.SCHEMA, **WRITER)
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
