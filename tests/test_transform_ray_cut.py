"""The split's plan in the driver, before any Ray task starts (no cluster here): each
span file's footer read once, all of them at once, and the runs cut from them as
before. On S3 a footer is a request or two; read one after another, twice (the
buckets' sizing, then the cut), a week of files kept the cluster waiting."""

from __future__ import annotations

import threading
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from nightshift.transform import build as B
from traces import agent_run, write_spans


class Together(LocalFileSystem):
    """A folder whose first two opens each wait until both have begun: footers read
    one after another never get past the first (`AssertionError`, not an OSError the
    reader would take for an unreadable file)."""

    cachable = False  # an instance of its own, not fsspec's cached local one

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.lock, self.both, self.opened = threading.Lock(), threading.Event(), []

    def _open(self, path, mode="rb", **kw):
        with self.lock:
            self.opened.append(path)
            first = len(self.opened) <= 2
            if len(self.opened) == 2:
                self.both.set()
        if first and not self.both.wait(5):
            raise AssertionError("the footers were read one after another")
        return super()._open(path, mode, **kw)


def lake(tmp_path: Path) -> list[Path]:
    """Five span files of 12 spans a row group, large ones and small ones."""
    data = tmp_path / "data"
    traces = [agent_run(f"cut-{i}", i, calls=2, task=f"task {i % 4}", reward=float(i % 3 == 0)) for i in range(40)]
    for name, part in (("a", traces[:10]), ("b", traces[10:20]), ("c", traces[20:30]), ("d", traces[30:33]),
                       ("e", traces[33:])):
        write_spans(str(data), part, batch=name)
    paths = sorted((data / "spans").rglob("*.parquet"))
    for path in paths:
        pq.write_table(pq.read_table(path), path, row_group_size=12)
    return paths


def test_the_footers_are_read_at_once_each_once_and_cut_the_same_runs(tmp_path):
    paths = lake(tmp_path)
    (tmp_path / "data" / "spans" / "junk.parquet").write_bytes(b"not parquet")  # stays whole, reported when read
    paths.insert(2, tmp_path / "data" / "spans" / "junk.parquet")
    sources = [B._Source(str(p), "d") for p in paths]
    # each row group's bytes as Parquet's footer gives them, read here one file after another
    want = {}
    for p in paths:
        try:
            md = pq.ParquetFile(p).metadata
        except Exception:
            want[str(p)] = None
            continue
        want[str(p)] = [B._uncompressed_md(md, g) for g in range(md.num_row_groups)]
    assert sum(w is None for w in want.values()) == 1 and sum(len(w) > 1 for w in want.values() if w) == 4
    together = Together()
    runs = B._cut(together, sources, 4)  # the plan as the build makes it: fails if it reads one footer at a time
    assert sorted(together.opened) == sorted(str(p) for p in paths)  # each footer once
    assert B.group_bytes(fsspec.filesystem("file"), [str(p) for p in paths] * 2) == want  # a path asked twice: once
    assert runs == B._cut(fsspec.filesystem("file"), sources, 4, want)
    flat = [(s.path, s.groups) for run in runs for s in run]
    assert (str(paths[2]), None) in flat  # the unreadable file whole, in its place
    covered = {str(p): set() for p in paths if want[str(p)]}
    for path, groups in flat:
        if want[path]:
            covered[path] |= set(range(*(groups or (0, len(want[path])))))
    assert all(covered[p] == set(range(len(want[p]))) for p in covered)  # every row group in one run...
    assert sum(len(range(*(g or (0, len(want[p]))))) for p, g in flat if want[p]) == sum(map(len, covered.values()))
    assert [s.path for run in runs for s in run] == sorted([s.path for run in runs for s in run],
                                                           key=[str(p) for p in paths].index)  # ...in the files' order
