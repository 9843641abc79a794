"""Which dates hold which traces, read from the `trace_id` column alone.

An incremental build must know where a trace's spans are before it reads them: a
span that arrives late lands in the partition of its own start time, so a trace
that began before midnight (or days before) has spans on several dates, and its
rows must be rebuilt from all of them, into the date it started on. One column of
each file is a small part of a span dataset (prompts and attributes are the rest),
so finding the dates costs far less than reading the spans themselves.

A file or row group that cannot be read is passed over here: the build reads the
dates it rebuilds in full and names what it could not read, as a full build does.
"""

from __future__ import annotations

from collections import defaultdict

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq


def trace_ids(fs, path: str) -> pl.Series:
    """The distinct trace ids of one file (empty for one that cannot be read)."""
    chunks: list[pa.Array] = []
    try:
        fh = fs.open(path, "rb")
    except OSError:
        return pl.Series("trace_id", [], pl.String)
    with fh:
        try:
            pf = pq.ParquetFile(fh)
        except (pa.ArrowException, OSError):
            return pl.Series("trace_id", [], pl.String)
        if "trace_id" not in pf.schema_arrow.names:
            return pl.Series("trace_id", [], pl.String)
        for g in range(pf.num_row_groups):
            try:
                chunks.append(pf.read_row_group(g, columns=["trace_id"]).column("trace_id").combine_chunks())
            except (pa.ArrowException, OSError):
                continue
    if not chunks:
        return pl.Series("trace_id", [], pl.String)
    ids = pl.from_arrow(pa.chunked_array(chunks, pa.string())).alias("trace_id")
    return ids.drop_nulls().unique()


class Scan:
    """The trace ids of the few files a build asks about again and again (the new
    ones, those of the dates it rebuilds), read once; a pass over every file keeps
    nothing, so memory stays that of one date, not of the whole dataset."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self._ids: dict[str, pl.Series] = {}

    def ids(self, path: str, keep: bool = True) -> pl.Series:
        if path in self._ids:
            return self._ids[path]
        got = trace_ids(self.fs, path)
        if keep:
            self._ids[path] = got
        return got

    def traces_of(self, paths: list[str], keep: bool = True) -> pl.Series:
        """The distinct trace ids of these files together."""
        parts = [self.ids(p, keep) for p in paths]
        if not parts:
            return pl.Series("trace_id", [], pl.String)
        return pl.concat(parts).unique()

    def dates_of(self, files: dict[str, list[str]], traces: pl.Series) -> dict[str, set[str]]:
        """For each of `traces` found in `files` (date -> paths), the dates holding it.
        One join per date: the wanted set is hashed once per date, not once per file."""
        out: dict[str, set[str]] = defaultdict(set)
        if traces.len() == 0:
            return out
        want = traces.unique().to_frame("trace_id")
        for date, paths in sorted(files.items()):
            found = self.traces_of(paths, keep=False).to_frame("trace_id").join(want, on="trace_id", how="semi")
            for t in found["trace_id"]:
                out[t].add(date)
        return out
