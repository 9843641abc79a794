"""Each call's prompt, as two ids on its transition (transitions version 4).

`system_id` is `prompt_identity.system_id` of the call's leading system/developer
texts, as sent: the id `nightshift route` matches an agent's requests on.
`tools_id` is `prompt_identity.tools_id` of its canonical tools. Both are null for a
call recorded without its messages. They let `nightshift prompts` group a lake's
calls by the prompt they sent without reading a single message: with the texts
hashed at listing time it held 0.9 GB and 6 CPU-s for 625k calls; the build computes
them once per distinct text (a Polars hash finds the distinct ones, SHA-256 names
them, so the ids are the same in every process and version).
"""

from __future__ import annotations

import polars as pl

from .prompt_identity import SYSTEM_ROLES, canonical_tools, system_id, tools_id


def system_texts(messages: str = "input_messages") -> pl.Expr:
    """The leading system/developer messages' contents (`prompt_identity.leading_system`),
    a missing content read as ""."""
    role = pl.element().struct.field("role")
    return (pl.col(messages).list.eval(
        pl.element().filter(role.is_in(list(SYSTEM_ROLES)).cast(pl.Int8).cum_min() == 1)
        .struct.field("content").fill_null("")).alias("system"))


def ids(df: pl.DataFrame, system: pl.Expr, tools: pl.Expr, content: pl.Expr) -> pl.DataFrame:
    """`system_id`, `tools_id` of each row of `df` (null where `content` is false):
    `system` its leading system texts (a list of strings), `tools` its tools' JSON."""
    k = df.select(system.alias("s"), tools.alias("t"), content.fill_null(False).alias("c")).with_columns(
        pl.col("s").hash().alias("hs"), pl.col("t").hash().alias("ht"))
    seen = k.filter(pl.col("c"))
    got = k.select("hs", "ht", "c")
    if not seen.height:
        return pl.DataFrame({"system_id": pl.Series([None] * df.height, dtype=pl.String),
                             "tools_id": pl.Series([None] * df.height, dtype=pl.String)})
    tools_first = seen.unique("ht", maintain_order=True)
    tool_ids = tools_first.select("ht", pl.Series(
        "tools_id", [tools_id(canonical_tools(t or None)) for t in tools_first["t"].to_list()], pl.String))
    sys_first = seen.unique("hs", maintain_order=True)
    sys_ids = sys_first.select("hs", pl.Series(
        "system_id", [system_id(list(s or [])) for s in sys_first["s"].to_list()], pl.String))
    out = got.join(sys_ids, on="hs", how="left", maintain_order="left").join(
        tool_ids, on="ht", how="left", maintain_order="left")
    return out.select(pl.when(pl.col("c")).then(pl.col("system_id")).alias("system_id"),
                      pl.when(pl.col("c")).then(pl.col("tools_id")).alias("tools_id"))
