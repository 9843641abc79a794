"""Buckets of whole traces read straight from the span files, in the files' order,
when the window's traces lie close together (what a collector writes): no split.

The split (`build._split`) reads every span, copies it into its bucket's order and
writes it, lz4, to a scratch file the bucket reads back: on the 1M-span benchmark a
fifth of the build's CPU went to that round trip (the take, lz4 both ways, the
kernel's pages), a sixth of what it does beyond its floor. Yet a trace's spans are
seldom far apart in the files: a collector writes them as they end, minutes apart
at most. So a first pass reads the `trace_id` column alone, finds each trace's last
span (its row in the window, files in order), and cuts the window into buckets by
that: bucket k holds the traces whose last span is in its range of rows, the same
share of the bytes each. The spans are then read once, in order, each row group by
the bucket its first row belongs to; a span whose trace ends in a later bucket is
held until then. Where traces straggle (the spans held past a cut would be more than
a bucket's, `CARRY`: traces left open for hours, row groups larger than a bucket),
`plan` says None and the build splits as before.

A bucket holds whole traces either way, its rows in the files' order, so it builds
the same rows; the partitions' rows follow the buckets, as with the split.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from . import chains

#: The spans held past a cut, at most, as a share of a bucket's span bytes. A bucket
#: at work holds about `build.OVERHEAD` (8) times its spans, the held ones only
#: themselves: an eighth more at most (the split's buckets hold none). Mostly the rest
#: of a row group read for the bucket before (a row group is read whole): 0.45 of a
#: bucket at most on the 1M benchmark's (10k-span row groups), 0.53 at 200k.
CARRY = 1.0


@dataclass
class Plan:
    """Where each bucket ends, and each row's trace's end, by row group."""

    cuts: list[int]  # bucket k: the traces whose last row is at or before cuts[k] (and after cuts[k-1])
    groups: list[tuple[int, int]]  # (source, row group) in the window's order
    first: list[int]  # each row group's first row in the window
    lasts: list[np.ndarray]  # each row group's rows: their bucket, the one their trace ends in (4 bytes a span)


def plan(fs, paths: list[str], sizes: dict[str, list[int] | None], buckets: int,
         together: dict[str, str] | None = None) -> Plan | None:
    """The cuts for `buckets` buckets of about equal bytes (the footers' `sizes`), or
    None where a file or row group cannot be read here (the split reads it and names
    it) or the traces straggle (`CARRY`). A trace in `together` ends where its group's
    last trace ends (`chains`: one bucket for traces that need each other's calls)."""
    hashes, groups, per_row = [], [], []
    for i, path in enumerate(paths):
        sz = sizes.get(path)
        if sz is None:
            return None
        try:
            with fs.open(path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                if "trace_id" not in pf.schema_arrow.names or pf.num_row_groups != len(sz):
                    return None
                for g in range(pf.num_row_groups):
                    ids = pf.read_row_group(g, columns=["trace_id"]).column("trace_id")
                    # a trace as a 64-bit hash: two traces that collide only share a bucket
                    keys = pl.from_arrow(ids)
                    if together:
                        keys = keys.to_frame("t").select(chains.bucket_key(pl.col("t"), together)).to_series()
                    hashes.append(keys.hash(seed=7).to_numpy())
                    groups.append((i, g))
                    per_row.append(sz[g] / max(len(ids), 1))
        except (pa.ArrowException, OSError):
            return None
    n = np.array([len(h) for h in hashes], np.int64)
    rows = int(n.sum())
    if rows == 0 or buckets < 2:
        return None
    first = np.concatenate([[0], np.cumsum(n)[:-1]])
    last = (pl.DataFrame({"h": np.concatenate(hashes)}).with_row_index("r")
            .select(pl.col("r").max().over("h"))["r"].to_numpy())
    del hashes
    weight = np.repeat(np.array(per_row, np.float64), n)
    # the bytes of the traces that have ended by each row: cut where they reach k/buckets
    order = np.argsort(last, kind="stable")
    ended = np.cumsum(weight[order])
    at = np.searchsorted(ended, ended[-1] * np.arange(1, buckets) / buckets)
    cuts = np.unique(np.append(last[order[np.minimum(at, rows - 1)]], rows - 1))
    del order, ended
    if len(cuts) < 2:  # traces as large as the window: nothing to cut between them
        return None
    # each row's bucket (its trace's end's), and the bytes held past each cut: a row
    # is held from the bucket its row group is read in to its trace's
    mine = np.searchsorted(cuts, last).astype(np.uint32)
    del last
    read_in = np.repeat(np.searchsorted(cuts, first), n)  # a row group is read whole, by its first row's bucket
    held = np.cumsum(np.bincount(read_in, weight, len(cuts) + 1) - np.bincount(mine, weight, len(cuts) + 1))
    if held[:-1].max(initial=0.0) > CARRY * float(weight.sum()) / len(cuts):
        return None
    return Plan([int(c) for c in cuts], groups, [int(f) for f in first],
                [mine[f:f + k] for f, k in zip(first, n)])


@dataclass
class Stream:
    """Reads the plan's buckets in order, each row group once (a local build: the
    buckets run one after another in this process)."""

    plan: Plan
    sources: list
    #: (source, bad) -> (row group, table with `_pdate`) of the file, in order: `build`'s reader
    read: Callable[[object, list[str]], Iterator[tuple[int, pa.Table]]]
    _next: int = 0
    _k: int = 0
    _open: tuple[int, Iterator] | None = None
    _held: list[tuple[pl.DataFrame, np.ndarray]] = field(default_factory=list)

    @property
    def buckets(self) -> int:
        return len(self.plan.cuts)

    def _group(self, i: int, g: int, bad: list[str]) -> pa.Table | None:
        """Row group `g` of source `i`: None if it could not be read (named in `bad`)."""
        if self._open is None or self._open[0] != i:
            self._open = (i, self.read(self.sources[i], bad))
        for got, table in self._open[1]:
            if got == g:
                return table
            if got > g:  # g was unreadable (named in `bad`): the next one goes back in front
                self._open = (i, itertools.chain([(got, table)], self._open[1]))
                return None
        return None

    def bucket(self, k: int, bad: list[str]) -> pl.DataFrame:
        """Bucket `k`'s spans, in the files' order."""
        if k != self._k:
            raise RuntimeError(f"bucket {k} asked for before bucket {self._k}: a stream is read in order")
        self._k += 1
        cut, p = self.plan.cuts[k], self.plan
        while self._next < len(p.groups) and p.first[self._next] <= cut:
            i, g = p.groups[self._next]
            last = p.lasts[self._next]
            self._next += 1
            table = self._group(i, g, bad)
            if table is not None and table.num_rows != len(last):  # rewritten since the plan read it
                bad.append(f"{self.sources[i].path}: row group {g + 1} changed while the build read it, skipped")
            elif table is not None:  # in Polars at once: one row group's Arrow copy at a time, not a bucket's
                self._held.append((pl.from_arrow(table), last))
                del table
        out, keep = [], []
        for frame, last in self._held:
            mine = last <= k
            if mine.all():
                out.append(frame)
                continue
            if mine.any():
                out.append(frame.filter(pl.Series(mine)))
            keep.append((frame.filter(pl.Series(~mine)), last[~mine]))
        self._held = keep
        if not out:
            return pl.DataFrame()
        if all(f.schema == out[0].schema for f in out):
            return pl.concat(out, rechunk=False)
        # files of other schema versions: Arrow's promotion, as the split's pieces get
        return pl.from_arrow(pa.concat_tables([f.to_arrow() for f in out], promote_options="default"))
