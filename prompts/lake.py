"""What this stage reads from the lake: the transitions (which prompt each call was
made with, and how its trajectory ended), and around them the spans (the prompt
name and version an instrumentation recorded, tool spans that failed, the
conversation a trace belongs to) and the feedback (users' comments).

Reads only: nothing here writes under the data root. Each reader selects the few
columns it needs; the heavy ones (whole message lists, attributes) only for the
rows asked for.
"""

from __future__ import annotations

import polars as pl

from nightshift.schemas import layout, prompt_ids, transitions
from nightshift.schemas.common import attr

#: Where an instrumentation records which managed prompt a call used: the GenAI
#: conventions' (being added), OpenInference's template version, Langfuse's.
PROMPT_NAME_KEYS = ("gen_ai.prompt.name", "langfuse.observation.prompt.name")
PROMPT_VERSION_KEYS = ("gen_ai.prompt.version", "llm.prompt_template.version", "langfuse.observation.prompt.version")
UNNAMED = "(unnamed)"


class NoTransitions(FileNotFoundError):
    """Nothing built yet under the data root: said, never a traceback."""


READER = "nightshift prompts"
_TRANSITIONS = dict(pl.from_arrow(transitions.SCHEMA.empty_table()).schema)


def _scan(data: str, dataset: str, storage_options: dict | None) -> pl.LazyFrame:
    """Every file checked first (its version, the columns schemas/ declares this stage
    reads: a `layout.LayoutError` sentence, not a ColumnNotFoundError), then scanned."""
    found = layout.check_dataset(data, dataset, READER, storage_options)
    # the transitions' columns given: one a later version added is read from the files that have it even
    # when the first file (the oldest date) lacks it (Polars takes the columns from the first file otherwise);
    # none given to an empty dataset, which then says so as it did
    schema = _TRANSITIONS if dataset == "transitions" and found else None
    return pl.scan_parquet(layout.files(data, dataset), hive_partitioning=True,
                           storage_options=storage_options or None, missing_columns="insert", schema=schema)


def _empty(e: Exception) -> bool:
    return isinstance(e, FileNotFoundError) or "expanded paths were empty" in str(e) or "no such file" in str(e).lower()


def agent_expr() -> pl.Expr:
    """The agent a call belongs to: its agent name, else its service's (an agent
    program that names no agent is one agent), else UNNAMED."""
    return pl.coalesce(pl.col("agent_name"), pl.col("service_name"), pl.lit(UNNAMED)).alias("agent")


def system_expr() -> pl.Expr:
    """The leading system/developer messages' contents, as `schemas.prompt_identity.leading_system` reads them."""
    return prompt_ids.system_texts()


def calls(data: str, since: str = "", storage_options: dict | None = None, agent: str | None = None) -> pl.DataFrame:
    """One row per call: ids, `agent`, `system_id` and `tools_id` (`schemas.prompt_ids`),
    `content` (false: recorded without its messages), `model`, `reward`,
    `start_time`, `prompt_seen`; and `system` (leading system texts, raw) and `tools`
    (JSON text) on the first call with content of each (agent, system_id, tools_id)
    only, null on the rest.

    No message is read but those: the build wrote each call's prompt ids (transitions
    version 4). Hashing the texts here held every call's messages at once (0.9 GB and
    6 CPU-s for 625k calls; 2.9 GB with the texts on every row). Partitions built
    before version 4 have no ids: theirs are made from their texts as the build makes
    them, so such a lake lists as before, at the old cost, until it is rebuilt."""
    lf = _scan(data, "transitions", storage_options)
    if since:
        lf = lf.filter(pl.col("start_time") >= pl.lit(since).str.to_datetime(time_zone="UTC"))
    lf = lf.with_columns(agent_expr())
    if agent is not None:
        lf = lf.filter(pl.col("agent") == agent)
    content = (~pl.col("flags").fill_null([]).list.contains("content_missing")).alias("content")
    keys = ["agent", "system_id", "tools_id"]
    try:
        rows = lf.select(
            "transition_id", "trajectory_id", "trace_id", "span_id", "step", "agent", "system_id", "tools_id",
            content, pl.coalesce("response_model", "model").alias("model"), "reward", "start_time", "prompt_seen",
        ).collect(engine="streaming")
        if rows.filter(pl.col("content") & pl.col("system_id").is_null()).height:  # partitions older than version 4
            rows = rows.update(_ids_of_older(lf.filter(content & pl.col("system_id").is_null())), on="transition_id")
        # (the ids alone: a filter of the whole frame copied every row's columns)
        firsts = (rows.lazy().filter("content").group_by(keys, maintain_order=True)
                  .agg(pl.col("transition_id").first()).collect())
        texts = _texts(data, firsts["transition_id"], storage_options) if firsts.height else None
    except (FileNotFoundError, pl.exceptions.ComputeError, OSError) as e:
        if _empty(e):
            raise NoTransitions(f"no transitions under {data} yet (run `nightshift build`)") from None
        raise
    if texts is None:
        return rows.with_columns(pl.lit(None, pl.List(pl.String)).alias("system"), pl.lit(None, pl.String).alias("tools"))
    texts = texts.unique("transition_id")  # (a call stored twice: its text once)
    return rows.hstack(beside(rows.select("transition_id"), texts, "transition_id", ["system", "tools"]))


def beside(keys: pl.DataFrame, other: pl.DataFrame, on: str | list[str], columns: list[str],
            **join) -> list[pl.Series]:
    """`other`'s `columns` for each row of `keys` (a left join of the key columns
    alone): what a frame gains from a join without the join copying the rest of it
    (a frame of 625k calls is 113 MiB; each whole-frame join held another)."""
    return keys.join(other, on=on, how="left", maintain_order="left", **join).select(columns).get_columns()


def _texts(data: str, transition_ids: pl.Series, storage_options: dict | None) -> pl.DataFrame:
    """`transition_id`, `system` (leading system texts), `tools` of these few rows: the
    messages of the row groups that hold them only. A filtered scan read every row
    group's messages to find them (1.4 CPU-s for 625k calls)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    fs = fsspec.core.url_to_fs(data, **(storage_options or {}))[0]
    wanted = pa.array(transition_ids.unique().to_list(), pa.string())
    parts = []
    for path in layout.check_dataset(data, "transitions", READER, storage_options):
        # ParquetFile(...).read_row_group on a file object, never pq.read_table (retention.py says why)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            for rg in range(pf.num_row_groups):
                mask = pc.is_in(pf.read_row_group(rg, columns=["transition_id"]).column(0), value_set=wanted)
                if pc.any(mask).as_py():
                    t = pf.read_row_group(rg, columns=["transition_id", "input_messages", "tools"]).filter(mask)
                    parts.append(pl.from_arrow(t).select("transition_id", system_expr(), "tools"))
    if not parts:
        return pl.DataFrame(schema={"transition_id": pl.String, "system": pl.List(pl.String), "tools": pl.String})
    return pl.concat(parts)


def _ids_of_older(lf: pl.LazyFrame) -> pl.DataFrame:
    """`transition_id`, `system_id`, `tools_id` of rows written before transitions version
    4: a 64-bit hash of each row's texts as they are read, then the ids made from the
    texts of the first row of each (the texts of every row at once held 2 GB for 625k)."""
    keyed = lf.select("transition_id", system_expr().list.join("\x1f").hash().alias("_hs"),
                      pl.col("tools").fill_null("").hash().alias("_ht")).collect(engine="streaming")
    firsts = keyed.unique(["_hs", "_ht"], keep="first")
    texts = (lf.filter(pl.col("transition_id").is_in(firsts["transition_id"].implode()))
             .select("transition_id", system_expr(), "tools").collect().unique("transition_id"))
    made = firsts.join(texts, on="transition_id")
    made = made.select("_hs", "_ht").hstack(prompt_ids.ids(made, pl.col("system"), pl.col("tools"), pl.lit(True)))
    return keyed.join(made, on=["_hs", "_ht"], how="left").select("transition_id", "system_id", "tools_id")


def trajectory_outcomes(data: str, trajectory_ids: list[str], storage_options: dict | None = None) -> pl.DataFrame:
    """`trajectory_id`, `reward`: each trajectory's outcome, the reward of its last rated
    step over every agent's calls (what `nightshift versions` takes), null when unrated
    or not finite."""
    lf = _scan(data, "transitions", storage_options).filter(pl.col("trajectory_id").is_in(trajectory_ids))
    out = (lf.select("trajectory_id", "step", "reward").collect().sort("trajectory_id", "step")
           .group_by("trajectory_id", maintain_order=True).agg(pl.col("reward").drop_nulls().last().alias("outcome")))
    finite = pl.col("outcome").is_finite().fill_null(False)
    return out.select("trajectory_id", pl.when(finite).then(pl.col("outcome")).alias("reward"),
                      (pl.col("outcome").is_not_null() & ~finite).alias("bad"))


def messages(data: str, transition_ids: list[str], storage_options: dict | None = None) -> list[dict]:
    """The whole rows of these transitions (messages included), for the few calls the
    proposer reads."""
    if not transition_ids:
        return []
    lf = _scan(data, "transitions", storage_options).filter(pl.col("transition_id").is_in(transition_ids))
    return lf.select("transition_id", "trajectory_id", "trace_id", "span_id", "step", "input_messages",
                     "output_message", "tools", "reward", "finish_reason").collect().to_dicts()


def prompt_names(data: str, span_ids: list[str] | pl.Series, storage_options: dict | None = None) -> pl.DataFrame:
    """`span_id`, `prompt_name`, `prompt_version` of the call spans that record them
    (on the call's own span), empty when no spans dataset or none do.

    Few spans name a prompt, and the attributes are most of a span's bytes: each row
    group's attribute keys are read first (their own Parquet column, a tenth of the
    cost), and the whole attributes only of the row groups where a wanted span has
    one of the keys. Reading every span's attributes took 9 CPU-s and 2.5 GB for 1M
    spans that named none."""
    empty = pl.DataFrame(schema={"span_id": pl.String, "prompt_name": pl.String, "prompt_version": pl.String})
    if len(span_ids) == 0:
        return empty
    import fsspec
    import pyarrow.parquet as pq

    try:
        found = layout.check_dataset(data, "spans", READER, storage_options)
    except (FileNotFoundError, OSError) as e:
        if _empty(e):
            return empty
        raise
    wanted = pl.DataFrame({"span_id": pl.Series(span_ids, dtype=pl.String)}).unique()
    keys = list(PROMPT_NAME_KEYS + PROMPT_VERSION_KEYS)
    fs = fsspec.core.url_to_fs(data, **(storage_options or {}))[0]
    parts = []
    for path in found:
        # ParquetFile(...).read_row_group on a file object, never pq.read_table (retention.py says why)
        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            key_leaf = [c.path for c in pf.schema if c.path.startswith("attributes.") and c.path.endswith(".key")]
            for rg in range(pf.num_row_groups if key_leaf else 0):
                head = pl.from_arrow(pf.read_row_group(rg, columns=["span_id", key_leaf[0]]))
                named = head.with_row_index("_i").filter(
                    pl.col("attributes").list.eval(pl.element().struct.field("key").is_in(keys)).list.any())
                if named.height:  # (a set of ids as large as the lake's calls: tested only where a key is)
                    named = named.join(wanted, on="span_id", how="semi")
                if named.height:
                    whole = pl.from_arrow(pf.read_row_group(rg, columns=["span_id", "attributes"]))
                    parts.append(whole[named["_i"].to_list()])
    if not parts:
        return empty
    df = pl.concat(parts).select(
        "span_id", pl.coalesce([attr(k) for k in PROMPT_NAME_KEYS]).alias("prompt_name"),
        pl.coalesce([attr(k) for k in PROMPT_VERSION_KEYS] + [attr(k, "int").cast(pl.String)
                                                             for k in PROMPT_VERSION_KEYS]).alias("prompt_version"))
    return df.filter(pl.col("prompt_name").is_not_null() | pl.col("prompt_version").is_not_null()).unique("span_id")


def around(data: str, trace_ids: list[str], storage_options: dict | None = None) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per trace: the tool spans that failed (`trace_id`, `tool`, `message`) and the
    conversation ids its spans carry (`trace_id`, `conversation_id`); empty frames
    without a spans dataset."""
    tools = pl.DataFrame(schema={"trace_id": pl.String, "tool": pl.String, "message": pl.String})
    convs = pl.DataFrame(schema={"trace_id": pl.String, "conversation_id": pl.String})
    if not trace_ids:
        return tools, convs
    try:
        lf = _scan(data, "spans", storage_options).filter(pl.col("trace_id").is_in(trace_ids))
        df = lf.select("trace_id", "name", "status_code", "status_message", "gen_ai_operation_name",
                       "gen_ai_conversation_id", attr("gen_ai.tool.name").alias("tool_attr"),
                       attr("tool.name").alias("oi_tool")).collect()
    except (FileNotFoundError, pl.exceptions.ComputeError, OSError) as e:
        if _empty(e):
            return tools, convs
        raise
    is_tool = ((pl.col("gen_ai_operation_name") == "execute_tool") | pl.col("tool_attr").is_not_null()
               | pl.col("oi_tool").is_not_null())
    tools = df.filter(is_tool & (pl.col("status_code") == "error")).select(
        "trace_id", pl.coalesce("tool_attr", "oi_tool", "name").alias("tool"),
        pl.col("status_message").fill_null("").alias("message"))
    convs = df.filter(pl.col("gen_ai_conversation_id").is_not_null()).select(
        "trace_id", pl.col("gen_ai_conversation_id").alias("conversation_id")).unique()
    return tools, convs


def comments(data: str, trace_ids: list[str], conversation_ids: list[str],
             storage_options: dict | None = None) -> pl.DataFrame:
    """Feedback with a comment on these traces or conversations: `trace_id`,
    `conversation_id`, `name`, `value`, `comment`."""
    empty = pl.DataFrame(schema={"trace_id": pl.String, "conversation_id": pl.String, "name": pl.String,
                                 "value": pl.Float64, "comment": pl.String})
    try:
        lf = _scan(data, "feedback", storage_options).filter(
            (pl.col("trace_id").is_in(trace_ids) | pl.col("conversation_id").is_in(conversation_ids))
            & pl.col("comment").is_not_null() & (pl.col("comment").str.strip_chars() != ""))
        return lf.select("trace_id", "conversation_id", "name", "value", "comment").collect()
    except (FileNotFoundError, pl.exceptions.ComputeError, OSError) as e:
        if _empty(e):
            return empty
        raise
