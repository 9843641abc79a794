"""Traces whose calls need each other's: kept in one bucket.

Two ways of recording a call leave its history in another trace: a call that
continued a stored response (`gen_ai.request.previous_response.id`: OpenAI's
`previous_response_id`, Gemini's interactions) names the response whose history and
answer the provider put in front of the model, and a call that recorded only the
messages appended since its conversation's previous call
(`gen_ai.input.messages_delta`) needs that call's. Each user turn is often a trace of
its own, and the build reads its window in buckets of traces (a hash of the trace id,
or where the traces end in the files): without this, such a call's history was
found only when the two traces fell in one bucket by chance.

Before the buckets are cut, `together` reads what it needs to link the traces: each
row group's attribute keys (their own Parquet column, a tenth of the attributes'
bytes) and the promoted `gen_ai_conversation_id`; the attributes themselves only of
the row groups that hold a continued or continuing call, and only when the window
has a continuing call at all. The buckets then use the first trace (by id) of each
group in place of each of its traces, so a group lands in one bucket whole.

The same pass keeps together what makes one trajectory across traces: with
`trajectory: conversation` the traces naming a conversation (the conversation
column, or a session key's value), with `linked` the traces their spans' links join
(the links' trace-id leaf). `conversations` and `links` read the same columns of
every span file for an incremental build, which grows the traces it touches to
their trajectories' (`incremental._Joined`).

Which history is put back stays the rebuild's decision (`calls.rebuild_*`): only
from a call whose trajectory started the same day, the unit an incremental build
redoes, so that it and a full build always agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Iterator

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

#: The response a call continues; the id of a call's own response.
PREVIOUS = "gen_ai.request.previous_response.id"
RESPONSE = "gen_ai.response.id"
#: The attribute of a call that recorded only its conversation's new messages.
DELTA = "gen_ai.input.messages_delta"
#: The keys a span names its conversation by, beside the promoted `gen_ai.conversation.id`
#: (`calls.classify`'s `session`).
SESSION_KEYS = ("session.id", "conversation.id", "traceloop.association.properties.session_id")


def components(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Each id joined to another by `pairs` -> the first id (in string order) of its
    connected group; ids joined to none are not in the map."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            parent[x] = parent.get(parent[x], parent[x])
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {t: find(t) for t in list(parent)}


def together(fs, sources: list, how: str = "trace") -> Groups:
    """Trace -> its group's first trace, for the traces of `sources` (the build's
    `_Source`s: path, the traces it keeps, the row groups it reads) that continue or
    are continued by another's call; with `how` (the build's `trajectory`)
    "conversation", also the traces that share a conversation (`session`: any value of
    the keys `calls.classify` reads one from, so a group holds at least each
    trajectory's traces), and with "linked", the traces their spans' links join.
    Empty when none do, the common case, after one read of the keys. A file or row
    group that cannot be read is left out: the build's own read reports it."""
    response_keys = pa.array([PREVIOUS, RESPONSE])
    convs: list[pa.Table] = []  # (trace, conversation) of the spans that name a conversation
    deltas: set[str] = set()
    pending: list[tuple[object, int]] = []  # (source, row group) with either response key
    links: list[pl.DataFrame] = []  # (trace, other): a span's link, or a shared session (`how`)
    continuing = False
    for rg in _row_groups(fs, sources, how == "linked"):
        if pc.any(pc.is_in(rg.keys, value_set=response_keys)).as_py():
            continuing = continuing or pc.any(pc.equal(rg.keys, PREVIOUS)).as_py()
            pending.append((rg.src, rg.g))
        if how == "linked" and "links" in rg.t.column_names:
            links.append(pl.from_arrow(rg.t.select(["trace_id", "links"])).explode("links").select(
                "trace_id", pl.col("links").struct.field("trace_id").alias("other")).drop_nulls())
        if how == "conversation":
            links.append(_sessions(rg))
        if "gen_ai_conversation_id" not in rg.t.column_names:
            continue
        delta = pc.equal(rg.keys, DELTA)
        if pc.any(delta).as_py():
            rows = pc.unique(pc.filter(pc.list_parent_indices(rg.lists), delta))
            deltas.update(c for c in rg.t.column("gen_ai_conversation_id").take(rows).to_pylist() if c)
        convs.append(_named(rg))
    pairs: list[pl.DataFrame] = []
    named = pl.from_arrow(pa.concat_tables(convs)).unique().rename({"gen_ai_conversation_id": "s"}) if convs else None
    if how == "conversation":  # a session's traces, each with its first: by the conversation column too
        found = [x for x in links if x.height] + ([named] if named is not None else [])
        links = [_firsts(pl.concat(found))] if found else []
    elif deltas and named is not None:  # every trace of a conversation some call sent a delta in, with its first
        pairs.append(_firsts(named.filter(pl.col("s").is_in(list(deltas)))))
    pairs += [x for x in links if x.height]
    if continuing:
        pairs.append(_continued(fs, pending))
    del convs, pending, links
    if not pairs:
        return Groups()
    edges = pl.concat(pairs).filter(pl.col("trace_id") != pl.col("other")).unique()
    return Groups(components(edges.iter_rows()))


@dataclass
class _RowGroup:
    """A row group's trace ids and attribute keys (and what else was asked for), with
    what reading more of it needs."""

    src: object
    g: int
    pf: pq.ParquetFile
    leaves: list[str]
    keep: pa.Array | None  # the rows of the traces `src.only` keeps (None: all)
    t: pa.Table
    lists: pa.ListArray  # the keys, a list per span
    keys: pa.Array  # the keys flat


def _row_groups(fs, sources: list, links: bool = False) -> Iterator[_RowGroup]:
    """Each row group of `sources` (the traces `only` keeps, the row groups `groups`
    names): its trace ids, attribute keys and conversation column, and its links'
    trace ids when asked for; one that cannot be read is left out."""
    for src in sources:
        try:
            with fs.open(src.path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                leaves = [c.path for c in pf.schema]
                leaf = [c for c in leaves if c.startswith("attributes.") and c.endswith(".key")]
                if not leaf or "trace_id" not in pf.schema_arrow.names:
                    continue
                extra = ["gen_ai_conversation_id"] if "gen_ai_conversation_id" in pf.schema_arrow.names else []
                if links:
                    extra += [c for c in leaves if c.startswith("links.") and c.endswith("element.trace_id")]
                only = None if src.only is None else src.only.to_arrow()
                for g in range(*(src.groups or (0, pf.num_row_groups))):
                    try:
                        t = pf.read_row_group(g, columns=["trace_id", leaf[0], *extra])
                    except (pa.ArrowException, OSError):
                        continue
                    keep = None if only is None else pc.is_in(t.column("trace_id"), value_set=only)
                    if keep is not None:
                        t = t.filter(keep)
                    # the keys flat, in Arrow: one pass over the row group's keys, no list per span
                    lists = t.column("attributes").combine_chunks()
                    yield _RowGroup(src, g, pf, leaves, keep, t, lists, pc.list_flatten(lists).field("key"))
        except (pa.ArrowException, OSError):
            continue


def _firsts(sessions: pl.DataFrame) -> pl.DataFrame:
    """(trace_id, other): each trace with the first trace of each conversation (`s`) it names."""
    return sessions.select("trace_id", pl.col("trace_id").min().over("s").alias("other"))


def links(fs, sources: list) -> Groups:
    """Trace -> the first trace of the traces its spans' links join it to (the links'
    trace-id leaf of every row group): what an incremental build of linked
    trajectories grows its traces by."""
    found = [pl.from_arrow(rg.t.select(["trace_id", "links"])).explode("links").select(
        "trace_id", pl.col("links").struct.field("trace_id").alias("other")).drop_nulls()
        for rg in _row_groups(fs, sources, links=True) if "links" in rg.t.column_names]
    found = [x for x in found if x.height]
    if not found:
        return Groups()
    edges = pl.concat(found).filter(pl.col("trace_id") != pl.col("other")).unique()
    return Groups(components(edges.iter_rows()))


def conversation_groups(sessions: pl.DataFrame) -> Groups:
    """Trace -> the first trace of the traces it shares a conversation with (`conversations`' rows)."""
    edges = _firsts(sessions).filter(pl.col("trace_id") != pl.col("other")).unique()
    return Groups(components(edges.iter_rows()))


def _named(rg: _RowGroup) -> pa.Table:
    conv = rg.t.select(["trace_id", "gen_ai_conversation_id"])
    return conv.filter(pc.is_valid(conv.column("gen_ai_conversation_id")))


@dataclass
class Source:
    """A span file to read whole (what `together` and `conversations` take of the build's `_Source`)."""

    path: str
    only: object = None
    groups: tuple[int, int] | None = None


def conversations(fs, sources: list) -> pl.DataFrame:
    """`trace_id`, `s`: each conversation a trace's spans name (the conversation column,
    or a session key's value, as `together` reads them): what an incremental build of
    conversation trajectories grows its traces by."""
    parts = []
    for rg in _row_groups(fs, sources):
        parts.append(_sessions(rg))
        if "gen_ai_conversation_id" in rg.t.column_names:
            parts.append(pl.from_arrow(_named(rg)).rename({"gen_ai_conversation_id": "s"}))
    parts = [p for p in parts if p.height]
    return pl.concat(parts).unique() if parts else pl.DataFrame(schema={"trace_id": pl.String, "s": pl.String})


def _sessions(rg: _RowGroup) -> pl.DataFrame:
    """(trace_id, s) for each session value the spans of a row group carry: the keys
    and the value leaves `attrs.long_form` reads (not the bytes values), the session
    keys' values taken out in Arrow, then made text as `long_form` makes it."""
    empty = pl.DataFrame(schema={"trace_id": pl.String, "s": pl.String})
    if not pc.any(pc.is_in(rg.keys, value_set=pa.array(SESSION_KEYS))).as_py():
        return empty
    fields = ("string_value", "int_value", "double_value", "bool_value", "json_value")
    value = [c for c in rg.leaves if c.startswith("attributes.") and c.rsplit(".", 1)[-1] in ("key", *fields)]
    t = rg.pf.read_row_group(rg.g, columns=["trace_id", *value])
    if rg.keep is not None:
        t = t.filter(rg.keep)
    lists = t.column("attributes").combine_chunks()
    flat = pc.list_flatten(lists)
    hit = pc.is_in(flat.field("key"), value_set=pa.array(SESSION_KEYS))
    values = pc.filter(flat.field("value"), hit)
    got = pa.table({"trace_id": t.column("trace_id").take(pc.filter(pc.list_parent_indices(lists), hit)),
                    **{f: values.field(f) for f in fields if f in {values.type.field(i).name
                                                                   for i in range(values.type.num_fields)}}})
    v = pl.from_arrow(got)
    text = [pl.col(f) if f in ("string_value", "json_value") else pl.col(f).cast(pl.String) for f in fields if f in v.columns]
    return v.select("trace_id", pl.coalesce(text).alias("s")).drop_nulls().unique()


def _continued(fs, pending: list[tuple[object, int]]) -> pl.DataFrame:
    """(trace, other) for each call that continued a response made in another trace.
    Of the row groups `together` found either key in, only the attributes' keys and
    string values are read, and the two values taken out in Arrow: a Polars list
    expression over the attributes kept each row group's whole string buffer alive
    behind the ids it took (6 GB and 19 CPU-s for 1M spans, against 0.3 GB and 2.6)."""
    made: list[pa.Table] = []
    wants: list[pa.Table] = []
    by_path: dict[str, list[tuple[object, int]]] = {}
    for item in pending:
        by_path.setdefault(item[0].path, []).append(item)
    for path, items in by_path.items():
        try:
            with fs.open(path, "rb") as fh:
                pf = pq.ParquetFile(fh)
                leaves = [c.path for c in pf.schema if c.path.startswith("attributes.")]
                key = next(c for c in leaves if c.endswith(".key"))
                value = next((c for c in leaves if c.endswith(".string_value")), None)
                if value is None:
                    continue
                for src, g in items:
                    try:
                        t = pf.read_row_group(g, columns=["trace_id", key, value])
                    except (pa.ArrowException, OSError):
                        continue
                    if src.only is not None:
                        t = t.filter(pc.is_in(t.column("trace_id"), value_set=src.only.to_arrow()))
                    lists = t.column("attributes").combine_chunks()
                    flat = pc.list_flatten(lists)
                    owner = pc.list_parent_indices(lists)
                    keys, values = flat.field("key"), flat.field("value").field("string_value")
                    for k, out in ((RESPONSE, made), (PREVIOUS, wants)):
                        m = pc.and_(pc.equal(keys, k), pc.is_valid(values))
                        out.append(pa.table({"trace_id": t.column("trace_id").take(pc.filter(owner, m)),
                                             "id": pc.filter(values, m)}))
        except (pa.ArrowException, OSError, StopIteration):
            continue
    if not wants:
        return pl.DataFrame(schema={"trace_id": pl.String, "other": pl.String})
    made_by = pl.from_arrow(pa.concat_tables(made)).unique().rename({"trace_id": "other"})
    return pl.from_arrow(pa.concat_tables(wants)).join(made_by, on="id").select("trace_id", "other")


class Groups(dict):
    """Trace -> its group's first trace (`together`), with its two columns made once:
    the split replaces the ids of every batch and the stream of every row group."""

    @functools.cached_property
    def columns(self) -> tuple[pl.Series, pl.Series]:
        return pl.Series(list(self), dtype=pl.String), pl.Series(list(self.values()), dtype=pl.String)


def bucket_key(trace: pl.Expr, groups: dict[str, str] | None) -> pl.Expr:
    """The id a trace is bucketed by: its group's first trace where it has a group."""
    if not groups:
        return trace
    old, new = groups.columns if isinstance(groups, Groups) else Groups(groups).columns
    return trace.replace(old, new)
