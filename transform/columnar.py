"""The calls the expressions read, kept as frames from the normalizer to the
transitions table.

Calls made into Python dicts, credited one trajectory at a time and turned back
into Arrow cost as much as normalizing them (3.6 of the 14.1 CPU-seconds of a
100k-span build). Most trajectories need none of what only Python does (a history
to rebuild, feedback or a reward function to read, per-step credit, a rare layout):
their rows are made here with expressions, the same rows `build._trajectory_rows`
makes. What Python still does for them is per trajectory, not per call: the window,
settling, the outcome and the group (`build._plain_trajectory`).

`kept` filters and counts the calls as the records' loop did; `needs_python` says
when a bucket's calls are Python's whole; `tools` finds the trajectories whose
history would be rebuilt and the calls whose tool errored; `rows` makes the rows."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import polars as pl
import pyarrow as pa

from nightshift.schemas import transitions

from . import attribution
from . import calls as C
from . import normalize

#: The record columns a transition takes from its call (the frame's `scope_name` is `scope`).
_CALL_COLUMNS = ("trace_id", "span_id", "start_ns", "end_ns", "service_name", "scope_name", "model", "request_model",
                 "response_model", "provider", "policy_version", "temperature", "tools", "finish_reason",
                 "completion_logprobs", "input_tokens", "output_tokens", "response_id", "convention", "truncated",
                 "flags", "prompt_name", "prompt_version", "input_is_delta")
_NO_MESSAGES = pl.lit([], pl.List(normalize._MESSAGE))
_NO_CALLS = pl.lit([], pl.List(normalize._TOOL_CALL))


@dataclass
class Kept:
    """The calls that make rows: `frame` (the expressions' records, `row` the call
    index, with `agent_name` and `outer`), `flat` their messages, `slow` the Python
    reader's records (with `agent_name`); `outer` maps each kept call's span to the
    call around it."""

    frame: pl.DataFrame | None
    flat: pl.DataFrame | None
    slow: list[dict]
    outer: dict[str, str | None]

    def records(self, where: pl.Expr | None = None) -> list[dict]:
        """The kept calls as `read_record` dicts (with `agent_name`), in call order:
        those of the frame that `where` selects, and every slow one."""
        out: list[dict] = []
        if self.frame is not None:
            frame = self.frame if where is None else self.frame.filter(where)
            if frame.height:
                flat = self.flat.filter(pl.col("row").is_in(frame["row"].implode()))
                out = normalize._to_records(frame.drop("agent_name", "outer"), flat)
                for rec, agent in zip(out, frame["agent_name"].to_list()):
                    rec["agent_name"] = agent
        if self.slow:
            out = sorted(out + self.slow, key=lambda r: r["_call"])
        return out


def kept(got: normalize.Frames, meta: pl.DataFrame, anc: pl.DataFrame, counts: C.Counts) -> Kept:
    """The calls that sent a request and whose layout was read, each with its agent
    and `clock_skew` flag; `counts` told how many each instrumentation made and how
    many made no request (as `build._normalize`'s loop over records counted them)."""
    info = anc.select("agent_name", "outer", pl.col("skew").fill_null(False))
    seen = []  # (row, scope, readable, span_id) of every call that sent a request
    frame = None
    if got.frame is not None:
        f = got.frame.select("row", *_CALL_COLUMNS)
        sides = got.flat.group_by("row").agg((pl.col("side") == 0).any().alias("_in"), (pl.col("side") == 1).any().alias("_out"))
        f = f.join(sides, on="row", how="left", maintain_order="left")
        f = f.with_columns(meta["gen_ai_operation_name"].gather(f["row"]).alias("_op"))
        unread = pl.col("flags").list.contains("unknown_layout")
        no_request = (~unread & (pl.col("_op").is_null() | (pl.col("_op") == "")) & ~pl.col("truncated")
                      & ~pl.col("_in").fill_null(False) & ~pl.col("_out").fill_null(False)
                      & pl.col("input_tokens").is_null() & pl.col("output_tokens").is_null()
                      & (pl.col("response_id").is_null() | (pl.col("response_id") == "")))
        f = f.with_columns(unread.alias("_unread"), no_request.alias("_noreq"))
        counts.no_request += int(f["_noreq"].sum())
        f = f.filter(~pl.col("_noreq"))
        seen.append(f.select("row", pl.col("scope_name").alias("scope"), (~pl.col("_unread")).alias("readable"),
                             "span_id"))
        f = f.filter(~pl.col("_unread")).drop("_in", "_out", "_unread", "_noreq", "_op")
        a = info[f["row"]]
        skew = pl.col("_skew") | (pl.col("end_ns") < pl.col("start_ns")).fill_null(False)
        frame = f.with_columns(a["agent_name"], a["outer"], a["skew"].alias("_skew")).with_columns(
            pl.when(skew).then(pl.col("flags").list.concat(pl.lit(["clock_skew"]))).otherwise(pl.col("flags"))
            .alias("flags")).drop("_skew")
    slow = []
    if got.slow:
        rows = []
        ops, scopes = meta["gen_ai_operation_name"], meta["scope_name"]
        for rec in got.slow:
            i = rec["_call"]
            unreadable = "unknown_layout" in rec["flags"]
            if not unreadable and C.made_no_request(rec, {"gen_ai_operation_name": ops[i]}):
                counts.no_request += 1
                continue
            rows.append((i, scopes[i], not unreadable, rec["span_id"]))
            if not unreadable:
                slow.append(rec)
        seen.append(pl.DataFrame(rows, schema={"row": pl.UInt32, "scope": pl.String, "readable": pl.Boolean,
                                               "span_id": pl.String}, orient="row"))
    _count_scopes(pl.concat(seen).sort("row") if seen else None, counts)
    outer: dict[str, str | None] = {}
    for rec in slow:
        a = info.row(rec["_call"], named=True)
        rec["agent_name"] = a["agent_name"]
        outer[rec["span_id"]] = a["outer"]
        if a["skew"] or (rec["end_ns"] is not None and rec["start_ns"] is not None and rec["end_ns"] < rec["start_ns"]):
            rec["flags"].append("clock_skew")
    if frame is not None:
        frame = frame.sort("row")  # records in call order, as the loop made them
        if frame["outer"].null_count() < frame.height:
            outer.update(zip(frame["span_id"].to_list(), frame["outer"].to_list()))
    return Kept(frame, got.flat if frame is not None else None, slow, outer)


def _count_scopes(seen: pl.DataFrame | None, counts: C.Counts) -> None:
    """`Counts.saw` for every call, in call order (the first scope seen is listed first)."""
    if seen is None or seen.height == 0:
        return
    scope = pl.col("scope")
    per = seen.with_columns(pl.when(scope.is_null() | (scope == "")).then(pl.lit("(no scope)")).otherwise(scope)
                            .alias("scope")).group_by("scope", maintain_order=True).agg(
        pl.len().alias("n"), (~pl.col("readable")).sum().alias("bad"),
        pl.col("span_id").filter(~pl.col("readable")).first().alias("example"))
    for scope_name, n, bad, example in per.iter_rows():
        entry = counts.by_scope.setdefault(scope_name, [0, 0, ""])
        entry[0] += n
        if bad:
            entry[1] += bad
            entry[2] = entry[2] or example


def needs_python(k: Kept, root_calls: set[str]) -> bool:
    """Whether the bucket's calls need what only the Python records do across
    trajectories: a call recorded twice (`dedupe`), a detached client span to merge
    (`merge_detached`), histories sent as deltas (`rebuild_deltas`). Conservative:
    true where they might act, so a bucket built here is one they leave alone."""
    if any(r.get("input_is_delta") for r in k.slow):
        return True
    cols = ("trace_id", "span_id", "response_id", "service_name", "scope_name", "start_ns", "end_ns")
    parts = []
    if k.frame is not None:
        parts.append(k.frame.select(cols).with_columns(pl.col("response_id").cast(pl.String)))
    if k.slow:
        parts.append(pl.DataFrame(
            [(r["trace_id"], r["span_id"], None if r["response_id"] is None else str(r["response_id"]),
              r["service_name"], r["scope"], r["start_ns"], r["end_ns"]) for r in k.slow],
            schema={"trace_id": pl.String, "span_id": pl.String, "response_id": pl.String, "service_name": pl.String,
                    "scope_name": pl.String, "start_ns": pl.Int64, "end_ns": pl.Int64}, orient="row"))
    if not parts:
        return False
    df = pl.concat(parts, how="vertical_relaxed")
    spans = set(df["span_id"].to_list())
    if any(o in spans for o in k.outer.values() if o):
        return True  # an outer span around an inner call
    rid = df.filter(pl.col("response_id").is_not_null() & (pl.col("response_id") != ""))
    if rid.height and rid.select(pl.struct("trace_id", "response_id").is_duplicated().any()).item():
        return True  # two spans of one response
    if not root_calls:
        return False
    lone = df.filter(pl.col("span_id").is_in(list(root_calls)) & (pl.len().over("trace_id") == 1))
    if lone.height == 0:
        return False
    hosts = df.filter(~pl.col("span_id").is_in(list(root_calls)) & pl.col("start_ns").is_not_null()
                      & pl.col("end_ns").is_not_null())
    pairs = lone.select("service_name", "scope_name").unique().join(
        hosts.select("service_name", pl.col("scope_name").alias("host_scope")).unique(), on="service_name",
        nulls_equal=True)
    return bool(pairs.filter(pl.col("scope_name").ne_missing(pl.col("host_scope"))).height)


def with_keys(frame: pl.DataFrame, key_of: dict[str, str] | None) -> pl.DataFrame:
    """Each call's trajectory key (`_key`): its trace, or what `key_of` maps it to."""
    if key_of is None:
        return frame.with_columns(pl.col("trace_id").alias("_key"))
    lut = pl.DataFrame({"trace_id": list(key_of), "_key": list(key_of.values())}, schema={"trace_id": pl.String,
                                                                                       "_key": pl.String})
    return frame.join(lut, on="trace_id", how="left", maintain_order="left")


def _truthy(c: str) -> pl.Expr:
    return pl.col(c).is_not_null() & (pl.col(c) != "")


def tools(steps: pl.DataFrame, flat: pl.DataFrame, pattern: re.Pattern | None) -> tuple[set[str], pl.Series]:
    """What tool results do to each trajectory (`steps`: every call, `ordered`): the
    trajectories where `rebuild_history` would put a turn back (a tool result
    answering an earlier call's output that its own history does not issue: those go
    to Python), and per call whether one of its tool calls came back as an error
    (`credit.tool_errors`; `pattern` None: not looked for)."""
    none = pl.Series("_err", [False] * steps.height, pl.Boolean)
    f = flat.with_row_index("_i")
    at = steps.select("row", "_key", "step")
    results = (f.filter((pl.col("side") == 0) & (pl.col("role") == "tool") & _truthy("tool_call_id"))
               .select("_i", "row", pl.col("tool_call_id").alias("id"), "content").join(at, on="row"))
    if results.height == 0:
        return set(), none

    def ids(side: int) -> pl.DataFrame:
        return (f.filter((pl.col("side") == side) & (pl.col("tool_calls").list.len() > 0))
                .select("row", pl.col("tool_calls").list.eval(pl.element().struct.field("id")).alias("id"))
                .explode("id").filter(_truthy("id")))

    asked = ids(1).join(at, on="row")
    if asked.height == 0:
        return set(), none
    first_asked = asked.group_by("_key", "id").agg(pl.col("step").min().alias("asked_at"))
    late = results.join(first_asked, on=["_key", "id"]).filter(pl.col("asked_at") < pl.col("step"))
    late = late.join(ids(0), on=["row", "id"], how="anti")  # the history does not issue it: a turn to put back
    rebuild = set(late["_key"].unique().to_list())
    if pattern is None:
        return rebuild, none
    answer = (results.sort("step", "_i").group_by("_key", "id", maintain_order=True)
              .agg(pl.col("content").first().fill_null("")))
    hit = asked.join(answer, on=["_key", "id"])
    if hit.height == 0:
        return rebuild, none
    bad = {c: bool(pattern.search(c)) for c in hit["content"].unique().to_list()}
    rows = hit.filter(pl.col("content").replace_strict(bad, return_dtype=pl.Boolean))["row"].unique()
    return rebuild, steps["row"].is_in(rows.implode()).alias("_err")


def ordered(frame: pl.DataFrame) -> pl.DataFrame:
    """The calls of each trajectory in step order (start, then span id: `_trajectory_rows`'
    sort, stable over call order), with `step` and `num_steps`."""
    return (frame.sort("_key", pl.col("start_ns").fill_null(0), "span_id", maintain_order=True)
            .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("_key").alias("step"),
                          pl.len().over("_key").cast(pl.Int64).alias("num_steps")))


def first_user_messages(steps: pl.DataFrame, flat: pl.DataFrame) -> dict[str, str]:
    """Each trajectory's first call's first user message with content (the default group)."""
    first = steps.filter(pl.col("step") == 0).select("row", "_key")
    users = (flat.filter((pl.col("side") == 0) & (pl.col("role") == "user") & pl.col("content").is_not_null()
                         & (pl.col("content") != ""))
             .join(first, on="row").group_by("_key", maintain_order=True).agg(pl.col("content").first()))
    return dict(users.iter_rows())


def selected(steps: pl.DataFrame, include: re.Pattern | None, exclude: re.Pattern | None) -> pl.Series:
    """Whether each call's agent passes agents_include / agents_exclude (Python's
    `re`, once per distinct agent name)."""
    if (include is None and exclude is None) or steps.height == 0:
        return pl.Series("_sel", [True] * steps.height, pl.Boolean)
    names = steps["agent_name"].fill_null("")
    lut = {n: not ((include and not include.search(n)) or (exclude and exclude.search(n)))
           for n in names.unique().to_list()}
    return names.replace_strict(lut, return_dtype=pl.Boolean).alias("_sel")


@dataclass
class Trajectories:
    """What Python decided per trajectory built here, one list entry each."""

    key: list[str]
    trajectory_id: list[str]
    day: list[str]
    start_ns: list[int]
    reward: list[float | None]
    source: list[str | None]
    group_id: list[str | None]
    orphan: list[bool]

    @classmethod
    def empty(cls) -> "Trajectories":
        return cls([], [], [], [], [], [], [], [])

    def frame(self) -> pl.DataFrame:
        return pl.DataFrame({"_key": self.key, "trajectory_id": self.trajectory_id, "_date": self.day,
                             "_ostart": self.start_ns, "_R": self.reward, "_src": self.source,
                             "group_id": self.group_id, "_orphan": self.orphan},
                            schema={"_key": pl.String, "trajectory_id": pl.String, "_date": pl.String,
                                    "_ostart": pl.Int64, "_R": pl.Float64, "_src": pl.String, "group_id": pl.String,
                                    "_orphan": pl.Boolean})


def _credit(strategy: str, gamma: float) -> tuple[pl.Expr, pl.Expr, pl.Expr]:
    """`credit.assign` as expressions (reward, source, return) for every strategy but
    per_step (Python's). The discount is `pow` of the same doubles, so the same floats."""
    R, src = pl.col("_R"), pl.when(pl.col("_R").is_not_null()).then(pl.col("_src"))
    if strategy == "identical":
        return R, src, R
    if strategy == "discounted":
        r = R * pl.lit(float(gamma), pl.Float64).pow((pl.col("num_steps") - 1 - pl.col("step")).cast(pl.Float64))
        return r, src, r
    if strategy == "last":
        last = pl.col("step") == pl.col("num_steps") - 1
        return pl.when(last).then(R), pl.when(last).then(src), pl.when(last).then(R)
    raise ValueError(f"credit strategy {strategy!r} is not made in expressions")


_ROW_SCHEMA = transitions.SCHEMA.remove_metadata()
_LATE = ("prompt_token_ids", "completion_token_ids", "advantage", "system_id", "tools_id")
#: The columns of a bucket's row frame before the token ids and the prompt ids, as `build._table` types them.
WANTED = [f for f in _ROW_SCHEMA if f.name not in _LATE]
TYPES = pl.from_arrow(pa.schema(WANTED).empty_table()).schema
#: Beside them, what orders the rows and splits them by date.
ORDER = ("_ostart", "trajectory_id", "step")


def rows(steps: pl.DataFrame, flat: pl.DataFrame, built: Trajectories, sel: pl.Series, errored: pl.Series,
         strategy: str, gamma: float, penalty: float, by_trajectory: bool) -> tuple[pl.DataFrame, dict[str, int],
                                                                                   dict[str, int]]:
    """The rows of the trajectories in `built` (steps: `ordered` calls, `sel` whether
    each is selected, `errored` whether its tool call came back as an error, lowering
    its return by `penalty`), typed as `build._table` types them, with `_date`,
    `_ostart` and `_call`; and the flags and content-missing conventions they carry,
    counted."""
    t = built.frame()
    df = steps.with_columns(sel, errored).join(t, on="_key", how="inner", maintain_order="left")
    reward, source, ret = _credit(strategy, gamma)
    df = df.with_columns(reward.alias("reward"), source.alias("reward_source"), ret.alias("return"))
    if penalty:  # `credit.penalize`: calls the strategy left uncredited stay so
        hit = pl.col("_err") & pl.col("return").is_not_null()
        df = df.with_columns(pl.when(hit).then(pl.col("reward") - float(penalty)).otherwise(pl.col("reward")).alias("reward"),
                             pl.when(hit).then(pl.col("return") - float(penalty)).otherwise(pl.col("return")).alias("return"))
    rated = (pl.col("_sel") & pl.col("return").is_not_null()).sum().over("_key")
    n_sel = pl.col("_sel").sum().over("_key")
    rated = pl.when(rated > 0).then(rated).when(n_sel > 0).then(n_sel).otherwise(1)
    df = df.with_columns((1.0 / rated.cast(pl.Float64) if by_trajectory else pl.lit(1.0)).alias("weight"))
    df = df.filter("_sel").with_columns(
        pl.when(pl.col("_orphan")).then(pl.col("flags").list.concat(pl.lit(["orphan"]))).otherwise(pl.col("flags"))
        .alias("flags")).with_columns(
        pl.when(pl.col("_err")).then(pl.col("flags").list.concat(pl.lit(["tool_error"]))).otherwise(pl.col("flags"))
        .alias("flags"))
    flagged = dict(df.select(pl.col("flags").explode().drop_nulls().value_counts(sort=False)).unnest("flags").iter_rows())
    missing = dict(df.filter(pl.col("flags").list.contains("content_missing"))
                   .group_by("convention", maintain_order=True).len().iter_rows())
    ids = [hashlib.sha256(f"{a}:{b}".encode()).hexdigest()[:32]
           for a, b in zip(df["trace_id"].to_list(), df["span_id"].to_list())]
    ins = (flat.filter(pl.col("side") == 0).join(df.select("row"), on="row", how="semi")
           .group_by("row", maintain_order=True).agg(_message().alias("input_messages")))
    outs = (flat.filter(pl.col("side") == 1).join(df.select("row"), on="row", how="semi")
            .select("row", _message().alias("output_message")))
    df = (df.join(ins, on="row", how="left", maintain_order="left").join(outs, on="row", how="left", maintain_order="left")
          .with_columns(pl.Series("transition_id", ids, pl.String), pl.col("input_messages").fill_null(_NO_MESSAGES),
                        pl.col("start_ns").alias("start_time"), pl.col("end_ns").alias("end_time"),
                        pl.lit(transitions.VERSION).alias("schema_version"), pl.lit(None, pl.String).alias("prompt_seen"),
                        pl.col("row").cast(pl.Int64).alias("_call")))
    df = _attribute(df)
    out = df.select(*[pl.col(f.name).cast(TYPES[f.name]) for f in WANTED], "_date", "_ostart", "_call")
    return out, flagged, missing


def _message() -> pl.Expr:
    return pl.struct("role", "content", "name", pl.col("tool_calls").fill_null(_NO_CALLS), "tool_call_id")


def _attribute(df: pl.DataFrame) -> pl.DataFrame:
    """`attribution.attribute` on the rows whose model names carry the route's mark
    (few): the rest keep a null `prompt_seen`."""
    names = ("response_model", "model", "request_model", "policy_version")
    marked = pl.any_horizontal(pl.col(c).str.contains("+p:", literal=True).fill_null(False) for c in names[:3])
    idx = df.select(pl.arg_where(marked)).to_series()
    if idx.len() == 0:
        return df
    recs = attribution.attribute(df.select(*names).gather(idx).to_dicts())
    fixed = pl.DataFrame(recs, schema={**{c: pl.String for c in names}, "prompt_seen": pl.String})
    cols = {c: df[c].clone().scatter(idx, fixed[c]) for c in (*names, "prompt_seen")}
    return df.with_columns(**cols)
