"""One record per LLM call from a set of complete traces: what it was given, what
it answered, which agent made it, and what is wrong with it.

The decisions that touch every span (is it an LLM call, an agent, a reward
carrier; which agent encloses each call; which calls are the same call recorded
twice) are taken in Polars. Only the calls themselves (and the few agent and
reward spans) are read in Python, by the layout readers of `conventions`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from . import attrs as A
from . import chains
from .conventions import Call, read_call, read_events, tools_from_events
from .messages import normalize_finish_reason
from .rewards import AGL_SPAN_NAMES, CARRIER_KEYS, CARRIER_PREFIXES

#: Where each convention's content capture is turned on (the hint in the summary).
CAPTURE_HINTS = {
    "otel_genai": "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (or =true for older instrumentations)",
    "otel_genai_event": "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=EVENT_ONLY (or =true)",
    "otel_genai_events_legacy": "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true",
    "openinference": "unset OPENINFERENCE_HIDE_INPUTS / OPENINFERENCE_HIDE_OUTPUTS (and the _MESSAGES variants)",
    "openllmetry_legacy": "TRACELOOP_TRACE_CONTENT=true",
    "agentlightning": "TRACELOOP_TRACE_CONTENT=true (AgentOps/OpenLLMetry underneath)",
    "unknown": "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (or your instrumentation's content switch)",
}

_CLASSIFY_KEYS = {
    "oi_kind": ("openinference.span.kind",),
    "req_type": ("llm.request.type",),
    "tl_kind": ("traceloop.span.kind",),
    "tl_name": ("traceloop.entity.name",),
    "agent_attr": ("agent.name", "recipient_agent_type", "langchain.chain.type", "executor.id"),
    "oi_agent": ("agent.name", "graph.node.id"),
    # LangChain/LangGraph run metadata: OpenInference keeps it as one JSON attribute,
    # OpenLLMetry as association properties.
    "oi_metadata": ("metadata",),
    "tl_lg_node": ("traceloop.association.properties.langgraph_node",),
    "tl_lc_agent": ("traceloop.association.properties.lc_agent_name",),
    "tl_integration": ("traceloop.association.properties.ls_integration",),
    "session": chains.SESSION_KEYS,
    "token_ids": ("response_token_ids",),
}
_REDACTED = "__REDACTED__"
#: The nodes LangGraph's prebuilt agents give themselves (`create_react_agent`: agent,
#: tools; LangChain 1.x `create_agent`: model, tools): not the user's name for the
#: agent, which is the name given to the prebuilt (the graph's name, or `lc_agent_name`).
LANGGRAPH_INTERNAL_NODES = ("agent", "model", "tools")
#: What LangGraph calls a graph compiled without a name: not a name the user gave.
LANGGRAPH_DEFAULT_NAME = "LangGraph"


@dataclass
class Counts:
    spans: int = 0
    calls_seen: int = 0
    duplicates: int = 0
    no_request: int = 0  # LLM-kind spans that sent no request
    content_missing: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    flagged: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bad_rewards: int = 0
    #: instrumentation (the span's scope) -> calls read, calls whose layout no reader knew, an example
    by_scope: dict[str, list] = field(default_factory=dict)

    def saw(self, scope: str | None, readable: bool, span_id: str) -> None:
        entry = self.by_scope.setdefault(scope or "(no scope)", [0, 0, ""])
        entry[0] += 1
        if not readable:
            entry[1] += 1
            entry[2] = entry[2] or span_id

    def add(self, other: "Counts") -> None:
        self.spans += other.spans
        self.calls_seen += other.calls_seen
        self.duplicates += other.duplicates
        self.no_request += other.no_request
        self.bad_rewards += other.bad_rewards
        for k, v in other.content_missing.items():
            self.content_missing[k] += v
        for k, v in other.flagged.items():
            self.flagged[k] += v
        for k, (n, bad, example) in other.by_scope.items():
            mine = self.by_scope.setdefault(k, [0, 0, ""])
            mine[0] += n
            mine[1] += bad
            mine[2] = mine[2] or example


#: GenAI operations that are one LLM call (a row), and those that stand for an agent.
INFERENCE_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
AGENT_OPERATIONS = frozenset({"invoke_agent", "create_agent"})


def transition_id(trace_id: str, span_id: str) -> str:
    return hashlib.sha256(f"{trace_id}:{span_id}".encode()).hexdigest()[:32]


def classify(df: pl.DataFrame, user_reward_keys: tuple[str, ...], group_attr: str | None) -> pl.DataFrame:
    """Per span: `is_call`, `agent` (the agent it stands for), `carrier` (it holds a
    reward), `session`, `group_attr`, `token_ids` (has Agent Lightning ids)."""
    keys = {k for ks in _CLASSIFY_KEYS.values() for k in ks} | set(user_reward_keys) | set(CARRIER_KEYS)
    if group_attr:
        keys.add(group_attr)
    key = pl.col("key")
    keep = key.is_in(sorted(keys))
    for p in CARRIER_PREFIXES:
        keep = keep | key.str.starts_with(p)
    long = A.long_form(df, keep)
    spec = dict(_CLASSIFY_KEYS)
    if group_attr:
        spec["group_attr"] = (group_attr,)
    cols = A.first_of(long, df.height, spec)
    carrier_rows = long.filter(
        pl.any_horizontal([key.str.starts_with(p) for p in CARRIER_PREFIXES])
        | key.is_in(list(user_reward_keys) + list(CARRIER_KEYS))
    ).select("row").unique()
    cols = cols.with_columns(pl.col("row").is_in(carrier_rows["row"].implode()).alias("carrier"))
    op = df["gen_ai_operation_name"]
    name = df["name"].fill_null("")
    base = pl.DataFrame({"op": op, "name": name, "genai_agent": df["gen_ai_agent_name"],
                         "provider": df["gen_ai_provider_name"],
                         "conv": df["gen_ai_conversation_id"]}).hstack(cols.drop("row"))
    is_call = (
        pl.when(pl.col("op").is_not_null()).then(pl.col("op").is_in(sorted(INFERENCE_OPERATIONS)))
        .when(pl.col("oi_kind").is_not_null()).then(pl.col("oi_kind") == "LLM")
        .otherwise(pl.col("req_type").is_in(["chat", "completion"])
                   | pl.col("name").str.contains(r"openai\.chat\.completion")
                   | pl.col("token_ids").is_not_null())
    )
    # The user's name for the agent, from the attributes that carry it; never made up
    # from a span name (`writer.on_messages_stream`, `researcher._execute_core`), except
    # the GenAI convention's own `invoke_agent {gen_ai.agent.name}`. An agent span
    # without a name does not count: the call's agent is then the nearest named one above.
    semconv_name = (pl.when(pl.col("name").str.starts_with("invoke_agent "))
                    .then(pl.col("name").str.splitn(" ", 2).struct.field("field_1")))
    genai_agent = pl.coalesce(pl.col("genai_agent"), semconv_name)
    # OpenLLMetry names a graph's `invoke_agent` span after the graph: unnamed, "LangGraph".
    genai_agent = pl.when((genai_agent == LANGGRAPH_DEFAULT_NAME) & (pl.col("provider") == "langgraph")).then(None) \
        .otherwise(genai_agent)
    agent = (
        pl.when(pl.col("op").is_in(sorted(AGENT_OPERATIONS))).then(genai_agent)
        .when(pl.col("oi_kind") == "AGENT").then(pl.col("oi_agent"))
        .when(pl.col("tl_kind") == "agent").then(pl.col("tl_name"))
        .when(pl.col("op").is_null() & (pl.col("oi_kind").is_null() | (pl.col("oi_kind") != "LLM")))
        .then(pl.col("agent_attr"))
    )
    agent = pl.coalesce(agent, _langgraph_agent())
    out = base.select(
        is_call.fill_null(False).alias("is_call"),
        agent.alias("agent"),
        (pl.col("carrier") | pl.col("name").is_in(list(AGL_SPAN_NAMES))).alias("carrier"),
        pl.coalesce(pl.col("conv"), pl.col("session")).alias("session"),
        (pl.col("group_attr") if group_attr else pl.lit(None, pl.String)).alias("group_attr"),
    )
    return out.with_columns(pl.when(pl.col("is_call")).then(None).otherwise(pl.col("agent")).alias("agent"))


def _langgraph_agent() -> pl.Expr:
    """The agent a LangChain/LangGraph span runs in, from the run metadata both
    instrumentations copy onto every span of a node: `lc_agent_name` (LangChain 1.x
    agents), else the graph node (`langgraph_node`) unless it is a prebuilt agent's
    own node, else, on OpenInference's span of a compiled graph's own run (metadata
    `ls_integration: langgraph`, no node: the span is named after the run, which is
    the name the user compiled the graph or prebuilt agent with), that name."""
    meta = pl.col("oi_metadata")
    node = pl.coalesce(pl.col("tl_lg_node"), meta.str.json_path_match("$.langgraph_node"))
    lc_agent = pl.coalesce(pl.col("tl_lc_agent"), meta.str.json_path_match("$.lc_agent_name"))
    integration = pl.coalesce(pl.col("tl_integration"), meta.str.json_path_match("$.ls_integration"))
    graph_run = (pl.when(pl.col("oi_kind").is_not_null() & (integration == "langgraph") & node.is_null()
                         & (pl.col("name") != LANGGRAPH_DEFAULT_NAME) & (pl.col("name") != ""))
                 .then(pl.col("name")))
    return pl.coalesce(lc_agent, pl.when(~node.is_in(LANGGRAPH_INTERNAL_NODES)).then(node), graph_run)


def ancestry(df: pl.DataFrame, cls: pl.DataFrame, max_depth: int = 64) -> pl.DataFrame:
    """For each call: the nearest enclosing agent, the nearest enclosing call (the
    same call recorded by an outer instrumentation), and whether its clock disagrees
    with its parent's (starts before it, or ends before it starts)."""
    nodes = pl.DataFrame({
        "trace_id": df["trace_id"], "span_id": df["span_id"], "parent": df["parent_span_id"],
        "p_agent": cls["agent"], "p_call": cls["is_call"], "p_start": df["start_time"],
    })
    calls = nodes.with_row_index("row").filter(cls["is_call"])
    out = calls.select("row", pl.lit(None, pl.String).alias("agent_name"), pl.lit(None, pl.String).alias("outer"),
                       pl.lit(False).alias("skew"))
    skew = calls.join(nodes.select("trace_id", pl.col("span_id").alias("parent"), pl.col("p_start").alias("ps")),
                      on=["trace_id", "parent"], how="left")
    skew = skew.select("row", ((pl.col("ps") > pl.col("p_start")).fill_null(False)
                               | (df["end_time"].gather(skew["row"]) < pl.col("p_start")).fill_null(False)).alias("skew"))
    cur = calls.select("row", "trace_id", pl.col("parent").alias("anc"))
    found_agent: list[pl.DataFrame] = []
    found_outer: list[pl.DataFrame] = []
    look = nodes.select("trace_id", pl.col("span_id").alias("anc"), "parent", "p_agent", "p_call", "span_id")
    agent_done = pl.Series("row", [], pl.UInt32)
    outer_done = pl.Series("row", [], pl.UInt32)
    for _ in range(max_depth):
        cur = cur.filter(pl.col("anc").is_not_null())
        if cur.height == 0:
            break
        j = cur.join(look, on=["trace_id", "anc"], how="inner")
        a = j.filter(pl.col("p_agent").is_not_null() & ~pl.col("row").is_in(agent_done.implode())).select("row", pl.col("p_agent").alias("agent_name"))
        o = j.filter(pl.col("p_call") & ~pl.col("row").is_in(outer_done.implode())).select("row", pl.col("span_id").alias("outer"))
        found_agent.append(a)
        found_outer.append(o)
        agent_done = pl.concat([agent_done, a["row"]])
        outer_done = pl.concat([outer_done, o["row"]])
        cur = j.filter(~(pl.col("row").is_in(agent_done.implode()) & pl.col("row").is_in(outer_done.implode()))).select(
            "row", "trace_id", pl.col("parent").alias("anc"))
    res = out.select("row")
    if found_agent:
        res = res.join(pl.concat(found_agent), on="row", how="left")
        res = res.join(pl.concat(found_outer), on="row", how="left")
    else:
        res = res.with_columns(pl.lit(None, pl.String).alias("agent_name"), pl.lit(None, pl.String).alias("outer"))
    return res.join(skew, on="row", how="left").sort("row")


def _first(attrs: dict, *keys: str) -> Any:
    for k in keys:
        v = attrs.get(k)
        if v is not None:
            return v
    return None


#: A published version in a served model name: `agent@v0003` (nightshift publish).
_VERSION_RE = re.compile(r"@(v\d+)$")


def policy_version(*models: Any) -> str | None:
    """Which published version produced a call: the `@vNNNN` of the model name the
    server answered with (the stand-in answers a stable name with its versioned
    one), else of the one requested; None when neither names a version (the base
    model, or a model Nightshift never published)."""
    for m in models:
        if isinstance(m, str) and (found := _VERSION_RE.search(m)):
            return found.group(1)
    return None


#: Instrumentations whose `llm.model_name` is the model the agent configured, not
#: the one that answered (OpenInference's Agents-SDK bridge and LlamaIndex
#: instrumentor read the agent's settings; its openai instrumentor reads the response).
REQUEST_MODEL_SCOPES = frozenset({"openinference.instrumentation.openai_agents",
                                  "openinference.instrumentation.llama_index"})
#: ... and those whose `llm.model_name` is neither: OpenInference's AutoGen instrumentor
#: records AutoGen's own table lookup of the request's model (`gpt-4o` -> `gpt-4o-2024-08-06`
#: whatever answered). Both columns stay null; `model` keeps what the span says.
UNKNOWN_MODEL_SCOPES = frozenset({"openinference.instrumentation.autogen_agentchat"})


def request_model(attrs: dict, scope: str | None = None) -> str | None:
    """The model the agent asked for (`gpt-4o-mini`), what users filter on; the
    response names a dated one (`gpt-4o-mini-2024-07-18`). OpenInference keeps the
    request's in `llm.invocation_parameters` (JSON) and, for most of its
    instrumentors, the answer's in `llm.model_name`."""
    if scope in UNKNOWN_MODEL_SCOPES:
        return None
    m = _first(attrs, "gen_ai.request.model", "llm.request.model")
    if m is None and scope in REQUEST_MODEL_SCOPES:
        m = attrs.get("llm.model_name")
    if m is None and isinstance(params := attrs.get("llm.invocation_parameters"), str) and '"model"' in params:
        try:
            m = json.loads(params).get("model")
        except (json.JSONDecodeError, AttributeError):
            m = None
    return m if isinstance(m, str) and m else None


def response_model(attrs: dict, scope: str | None = None) -> str | None:
    if scope in UNKNOWN_MODEL_SCOPES:
        return None
    m = _first(attrs, "gen_ai.response.model", "llm.response.model")
    if m is None and scope not in REQUEST_MODEL_SCOPES:
        m = attrs.get("llm.model_name")
    return m if isinstance(m, str) and m else None


def _float(v: Any) -> float | None:
    try:
        f = float(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None
    return f if f is not None and math.isfinite(f) and f >= 0 else None


def _int(v: Any) -> int | None:
    try:
        return int(v) if v is not None and not isinstance(v, bool) else None
    except (TypeError, ValueError):
        return None


PROMPT_IDS = ("prompt_token_ids", "gen_ai.request.token_ids", "llm.hosted_vllm.prompt_token_ids")
COMPLETION_IDS = ("response_token_ids", "gen_ai.response.token_ids", "llm.hosted_vllm.response_token_ids")
TOKEN_KEYS = frozenset(PROMPT_IDS + COMPLETION_IDS)
#: A JSON list of integers that fit int64 (no leading zeros: JSON's parse raised on "[007]",
#: and past 18 digits it read a null id inside the list)
_JSON_INT = r"-?(0|[1-9]\d{0,17})"
_INT_LIST = rf"^\s*\[\s*({_JSON_INT}\s*(,\s*{_JSON_INT}\s*)*)?\]\s*$"


def token_columns(call_rows: pl.DataFrame) -> pl.DataFrame:
    """`prompt_token_ids`, `completion_token_ids` for each call row, decoded in Polars
    (they are long: reading them in Python would cost more than everything else).
    Accepts OTLP int arrays, JSON text and stringified Python lists (LiteLLM); a
    list per choice takes the first; anything else is null."""
    long = A.long_form(call_rows, pl.col("key").is_in(sorted(TOKEN_KEYS)))
    cols = A.first_of(long, call_rows.height, {"p": PROMPT_IDS, "c": COMPLETION_IDS})

    def ids(col: str, guard: bool) -> pl.Expr:
        if not guard:  # the common case, one JSON parse and nothing else
            return pl.col(col).str.json_decode(pl.List(pl.Int64)).cast(pl.List(pl.Int32))
        text = pl.col(col).str.strip_chars()
        text = pl.when(text.str.starts_with("[[")).then(text.str.extract(r"^\[(\[[^\]]*\])", 1)).otherwise(text)
        text = pl.when(text.str.contains(_INT_LIST)).then(text).otherwise(None)
        wide = text.str.json_decode(pl.List(pl.Int64))
        fits = (wide.list.max().fill_null(0) <= 2**31 - 1) & (wide.list.min().fill_null(0) >= -(2**31))
        return pl.when(fits).then(wide.cast(pl.List(pl.Int32), strict=False))  # ids past int32: not ids

    errors = (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError, pl.exceptions.SchemaError)
    # a list per choice ("[[") would flatten under the split; a torn "[1,2" would pass it
    plain = cols.select(pl.all_horizontal(
        (pl.col(c).str.starts_with("[") & pl.col(c).str.ends_with("]") & ~pl.col(c).str.starts_with("[[")).fill_null(True)
        .all() for c in ("p", "c"))).item()
    # `bad_token_ids`: a value was there but is not a list of ids (counted and reported)
    bad = ((pl.col("p").is_not_null() & pl.col("prompt_token_ids").is_null())
           | (pl.col("c").is_not_null() & pl.col("completion_token_ids").is_null())).alias("bad_token_ids")
    if plain and "trace_id" in call_rows.columns:
        try:
            got = _from_longest(cols, call_rows["trace_id"])
            return got.select("prompt_token_ids", "completion_token_ids", bad)
        except errors:
            pass  # a value the split cannot read: the attempts below say which rows are not ids
    attempts = ([lambda c: _split_ids(pl.col(c))] if plain else []) + [lambda c: ids(c, False), lambda c: ids(c, True)]
    for parse in attempts:  # the fastest that can read every value; the guarded one never raises
        try:
            got = cols.with_columns(parse("p").alias("prompt_token_ids"), parse("c").alias("completion_token_ids"))
        except errors:
            continue
        return got.select("prompt_token_ids", "completion_token_ids", bad)
    raise AssertionError("the guarded parse never raises")  # it makes nulls, not errors


def _split_ids(text: pl.Expr) -> pl.Expr:
    """The common case, `[1,2,3]` as the collector writes an OTLP int array: split on
    commas and cast, three times faster than a JSON parse of the same text. Raises on
    anything else ("" inside `[]` included, which the caller keeps apart)."""
    return text.str.strip_chars("[]").str.split(",").list.eval(pl.element().cast(pl.Int32, strict=True))


def _from_longest(cols: pl.DataFrame, trace: pl.Series) -> pl.DataFrame:
    """`_split_ids` of every row, each trace's ids parsed about once: an agent's next
    prompt is its last prompt, the answer and the new turn, so a call's ids are most
    often a prefix of its trace's longest prompt (its completion the ids after that
    prefix). Those are sliced out of the longest one, parsed once, and the text itself
    is what proves it (the row's text is the longest one's, byte for byte, up to a
    comma); the rest are parsed alone. Raises where `_split_ids` would: the caller
    falls back. In a five-call trajectory it parses 1,200 of 4,000 ids (the benchmark)."""
    p, c = pl.col("p"), pl.col("c")
    f = cols.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("i"), "p", "c").with_columns(trace.alias("t"))
    longest = (f.filter(p.is_not_null() & (p != "[]")).group_by("t", maintain_order=True)
               .agg(pl.col("i").get(p.str.len_bytes().arg_max()).alias("a")))
    text = f["p"].gather(longest["a"])
    parsed, ends, first, whole, at = _anchors(text)  # raises: the caller falls back
    k = longest.select("t", pl.int_range(pl.len(), dtype=pl.UInt32).alias("k"),
                       pl.Series("_whole", whole))  # an anchor with a bracket inside covers no row
    f = f.join(k, on="t", how="left", maintain_order="left").drop("t")
    f = f.with_columns(text.gather(f["k"]).alias("_a"))
    # "[1,2,3]" covered: the anchor is "[1,2,3," and more (it goes on with another id), or
    # the same text; its completion "[4,5]": "4,5," follows. Compared in place, not by
    # concatenating each row's texts into a needle (a copy of every prompt). Places are
    # bytes and `slice` counts characters: the same wherever a text can match the anchor,
    # which the parse found ASCII (a row's text that is not is never covered)
    a, lp, lc = pl.col("_a"), p.str.len_bytes(), c.str.len_bytes()
    f = f.with_columns((pl.col("_whole") & ((a == p) | ((a.str.slice(lp - 1, 1) == ",")
                                                         & a.str.starts_with(p.str.head(-1))))).fill_null(False).alias("_cp"))
    f = f.with_columns((pl.col("_cp") & (a.str.slice(lp + lc - 2, 1) == ",")
                        & (a.str.slice(lp, lc - 2) == c.str.slice(1, lc - 2))).fill_null(False).alias("_cc"))
    # ids in a covered prefix: where its closing bracket falls among the anchor's commas
    n_p = n_c = np.zeros(f.height, np.int64)
    if longest.height:
        k = f["k"].fill_null(0).to_numpy()  # a row of no anchor covers nothing: any will do
        start = first[k]
        base = at[k]  # where the row's anchor's text starts among the anchors' bytes
        lp = f["p"].str.len_bytes().fill_null(1).to_numpy().astype(np.int64)
        lc = f["c"].str.len_bytes().fill_null(1).to_numpy().astype(np.int64)
        at_p = np.searchsorted(ends, base + lp - 1)  # the id ending at the prompt's closing bracket
        at_c = np.searchsorted(ends, base + lp + lc - 2)  # and at the completion's
        n_p, n_c = np.maximum(at_p - start + 1, 0), np.maximum(at_c - at_p, 0)  # (rows not covered: unused)
    f = f.with_columns(pl.Series("_np", n_p), pl.Series("_nc", n_c), parsed.gather(f["k"]).alias("_ids"))
    own = lambda s, covered: pl.when(~covered & s.is_not_null() & (s != "[]")).then(s)  # noqa: E731
    f = f.with_columns(_split_ids(own(p, pl.col("_cp"))).alias("_op"), _split_ids(own(c, pl.col("_cc"))).alias("_oc"))
    empty = pl.lit([], pl.List(pl.Int32))
    ids = pl.col("_ids")
    return f.select(
        pl.when(p == "[]").then(empty).when(pl.col("_cp")).then(ids.list.slice(0, pl.col("_np")))
        .otherwise(pl.col("_op")).alias("prompt_token_ids"),
        pl.when(c == "[]").then(empty).when(pl.col("_cc")).then(ids.list.slice(pl.col("_np"), pl.col("_nc")))
        .otherwise(pl.col("_oc")).alias("completion_token_ids"),
        "p", "c")


def _anchors(text: pl.Series) -> tuple[pl.Series, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The anchors' ids (`_split_ids` of each: raises where it would), where each id
    ends in their text (the comma or bracket after it) as a place among the anchors'
    bytes, each anchor's first id's index and where its text starts, and whether the
    anchor has one end per id (a bracket inside, "[]1]", has more): only then are the
    ends its ids'. The ends are found in the bytes themselves (one pass: counting each
    id's digits from its value took a pass per power of ten, more than the parse).
    Whatever else the text holds ("+1", "007"), a row whose text is the anchor's bytes
    up to one of those commas has the ids `_split_ids` reads before it."""
    arr = text.to_arrow()
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    arr = arr.cast(pa.large_string()) if arr.type != pa.large_string() else arr
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset:arr.offset + len(arr) + 1]
    data = np.frombuffer(arr.buffers()[2] or b"", np.uint8)
    buf = data[offsets[0]:offsets[-1]]
    at = offsets - offsets[0]
    # in blocks: a block's temporaries stay in the CPU's cache and are reused, where
    # whole-text ones (tens of MB a bucket) were each faulted in anew
    ends_in, other = [], 0  # each block's ends; bytes neither digits nor ends
    for lo in range(0, len(buf), _BYTES):
        b = buf[lo:lo + _BYTES]
        end = b == 44  # ","
        end |= b == 93  # "]"
        found = np.flatnonzero(end)
        found += lo
        ends_in.append(found)
        other += len(b) - len(found) - np.count_nonzero((b - np.uint8(48)) < 10)
    ends = np.concatenate(ends_in) if ends_in else np.zeros(0, np.int64)
    bounds = np.searchsorted(ends, at)  # each anchor's first end: the first at or after its start
    parsed = _digit_ids(buf, at, ends, bounds) if other == len(at) - 1 else None  # the "[" alone
    if parsed is None:  # not every id plain digits: Polars' parse, what every other row goes through
        parsed = text.to_frame("p").select(_split_ids(pl.col("p")))["p"]
    whole = np.diff(bounds) == parsed.list.len().to_numpy().astype(np.int64)
    return parsed, ends, bounds[:-1], whole, at[:-1]


#: Subtracted from 8 ASCII digits read as one little-endian integer: their values.
_ZEROS = np.uint64(0x3030303030303030)
#: Bytes and ids worked on at once: a block's arrays stay in the CPU's cache.
_BYTES, _IDS = 1 << 18, 1 << 15


def _digit_ids(buf: np.ndarray, at: np.ndarray, ends: np.ndarray, bounds: np.ndarray) -> pl.Series | None:
    """The anchors' ids read straight from their bytes where every anchor is "[" ids
    "," ... "]" and every id 1 to 8 ASCII digits (a collector's OTLP int array: token
    ids are under a million), else None; the caller has checked that every byte is a
    digit, a "," or "]" (an end), or one "[" per anchor. Those texts `_split_ids` reads
    too, as the same numbers (leading zeros included), and they fit int32: the same
    ids, for about half its CPU (it makes a string of each id, then parses it).
    Each id is the 8 bytes that end at its end, read as one integer, the bytes before
    the id shifted out, whose digits are summed in pairs, fours and eights (SWAR)."""
    n = len(at) - 1
    first, last = at[:-1], at[1:] - 1
    if (n == 0 or len(ends) == 0 or not (buf[first] == 91).all() or not (buf[last] == 93).all()
            or sum(np.count_nonzero(buf[ends[i:i + _IDS]] == 93) for i in range(0, len(ends), _IDS)) != n):
        return None  # a bracket elsewhere than around each anchor
    pad = np.empty(len(buf) + 8, np.uint8)  # 8 bytes before the first: each id has 8 to read
    pad[:8] = 48
    np.maximum(buf, 48, out=pad[8:])  # "," as "0": no byte below "0", so none borrows from the id's
    words = np.ndarray((len(pad) - 7,), np.dtype("<u8"), pad, 0, (1,))  # the 8 bytes from each place
    out = np.empty(len(ends), np.int32)
    heads = bounds[:-1]  # each anchor's first id: it starts after the "[", not after an end
    for i in range(0, len(ends), _IDS):
        e = ends[i:i + _IDS]
        width = np.empty(len(e), np.int64)
        width[0] = e[0] - (ends[i - 1] if i else -1) - 1
        np.subtract(e[1:], e[:-1], out=width[1:])
        width[1:] -= 1
        h = heads[np.searchsorted(heads, i):np.searchsorted(heads, i + len(e))]
        width[h - i] = e[h - i] - first[np.searchsorted(heads, h)] - 1
        if width.min() < 1 or width.max() > 8:
            return None  # an empty id ("[1,,2]") or one of 9 digits or more
        v = words[e]  # the 8 bytes before each id's end (the pad shifts places by 8)
        v -= _ZEROS  # each digit's value, the id's first digit in the lowest of its bytes
        shift = (8 - width).astype(np.uint64) << np.uint64(3)
        v >>= shift  # the bytes before the id out, zeros in their place
        v <<= shift
        v = (v * np.uint64(10) + (v >> np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
        v = (v * np.uint64(100) + (v >> np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
        out[i:i + _IDS] = v * np.uint64(10000) + (v >> np.uint64(32))  # the low 32 bits: under 10^8
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.diff(bounds), out=offsets[1:])
    return pl.from_arrow(pa.ListArray.from_arrays(pa.array(offsets), pa.array(out)))


def _logprobs(v: Any) -> list[float] | None:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            return None
    if isinstance(v, list) and all(isinstance(x, dict) for x in v):
        try:
            return [float(x["logprob"]) for x in v]
        except (KeyError, TypeError, ValueError):
            return None
    return None


def normalize_tools(tools: list[Any]) -> list[dict]:
    """Tool definitions in OpenAI's nested form `{"type": "function", "function":
    {name, description, parameters}}`, what chat templates take, from the flat GenAI
    form, logfire's nested form or OpenInference's JSON schema."""
    out = []
    for t in tools:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("function"), dict):
            out.append({"type": "function", "function": t["function"]})
        elif "name" in t:
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            out.append({"type": t.get("type") or "function", "function": fn})
        else:
            out.append(t)
    return out


def _missing(call: Call | None) -> bool:
    if call is None:
        return True
    out = call.output_message
    no_out = out is None or (not out["content"] and not out["tool_calls"]) or out["content"] == _REDACTED
    no_in = not call.input_messages or all(m["content"] in (None, _REDACTED) and not m["tool_calls"] for m in call.input_messages)
    return no_out and no_in


#: Attributes a span carries when its instrumentation was told not to record content.
_CAPTURE_OFF_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt",
                     "llm.usage.prompt_tokens", "gen_ai.response.model", "gen_ai.request.model", "llm.model_name")


#: Keys that hold content in some layout. `gen_ai.prompt.{i}.*` is OpenLLMetry's content,
#: `gen_ai.prompt.name` / `.version` / `.variable.*` the GenAI convention's prompt template:
#: not content. (`CONTENT_KEY_PATTERN` is the same test for Polars.)
_CONTENT_KEY = re.compile(r"(gen_ai\.input|gen_ai\.output|gen_ai\.(prompt|completion)(\Z|\.[0-9])|llm\.input_messages"
                          r"|llm\.output_messages|input\.value|output\.value)")
CONTENT_KEY_PATTERN = (r"^(gen_ai\.input|gen_ai\.output|gen_ai\.(prompt|completion)($|\.[0-9])|llm\.input_messages"
                       r"|llm\.output_messages|input\.value|output\.value)")
CAPTURE_OFF_KEYS = _CAPTURE_OFF_KEYS


def _no_content_expected(attrs: dict) -> bool:
    """A known instrumentation with content capture off: it still records the model
    and the token counts. That is `content_missing`, not an unknown layout."""
    return any(k in attrs for k in _CAPTURE_OFF_KEYS) and not any(_CONTENT_KEY.match(k) for k in attrs)


def made_no_request(rec: dict, row: dict) -> bool:
    """An LLM-kind span that sent nothing: no messages either way, no token counts,
    no response id (LlamaIndex's `_prepare_chat_with_tools`, which only builds the
    request the next span sends). Not a GenAI inference span (the convention makes
    one per request: with capture off it is a call without content), nor one whose
    attributes were dropped."""
    return (not row.get("gen_ai_operation_name") and not rec["truncated"] and not rec["input_messages"]
            and rec["output_message"] is None and rec["input_tokens"] is None and rec["output_tokens"] is None
            and not rec["response_id"])


_SCHEMA_URL = re.compile(r"/schemas/(\d+)\.(\d+)(?:\.(\d+))?/?\Z")
#: The GenAI conventions' version that moved message content from per-message log
#: events onto the call (`gen_ai.input.messages`, on the span or the details event).
JSON_CONTENT_SINCE = (1, 37, 0)


def semconv_version(url: str | None) -> tuple[int, int, int] | None:
    """The semantic-conventions version a span's schema URL names
    (`https://opentelemetry.io/schemas/1.37.0`), None when it names none."""
    found = _SCHEMA_URL.search(url) if isinstance(url, str) else None
    return (int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)) if found else None


def events_generation(row: dict) -> bool:
    """Whether the span says (by its scope's schema URL, else its resource's) that it
    follows the GenAI conventions before 1.37, whose content is per-message log
    events: where there is none, that is the capture switch to name."""
    version = semconv_version(row.get("scope_schema_url") or row.get("resource_schema_url"))
    return version is not None and version < JSON_CONTENT_SINCE


def read_record(row: dict, attrs: dict, events: list[dict]) -> dict:
    """The record of one call span (`row`: its columns; `attrs`: its attributes)."""
    flags: list[str] = []
    call = read_call(attrs)
    if events and (call is None or call.output_message is None or not call.input_messages):
        from_events = read_events(events)  # content logged as events, alone or beside the span's
        if from_events is not None:
            if call is None or (call.output_message is None and not call.input_messages):
                call = from_events
            else:
                call.input_messages = call.input_messages or from_events.input_messages
                call.output_message = call.output_message or from_events.output_message
                call.finish_reason = call.finish_reason or from_events.finish_reason
    if call is not None and not call.tools and events:
        call.tools = tools_from_events(events) or []
    if call is None and any(k in attrs for k in TOKEN_KEYS):
        call = Call("agentlightning")
    if call is not None and call.convention == "openllmetry_legacy" and "response_token_ids" in attrs:
        call.convention = "agentlightning"
    convention = call.convention if call else (
        ("otel_genai_events_legacy" if events_generation(row) else "otel_genai") if row.get("gen_ai_operation_name") else
        "openinference" if attrs.get("openinference.span.kind") else "unknown")
    for p in (call.problems if call else []):
        flags.append("invalid_content:" + p.split(":", 1)[0])
    if call is None and not _no_content_expected(attrs):
        # an LLM-kind span in a layout no reader knows (a framework release that
        # changed its attributes): flagged and counted per instrumentation, never guessed at
        flags.append("unknown_layout")
    elif _missing(call):
        flags.append("content_missing")
    finish = (call.finish_reason if call else None) or normalize_finish_reason(
        _first(attrs, "gen_ai.response.finish_reasons", "llm.response.finish_reason"))
    out = call.output_message if call else None
    if finish is None and out and (out["tool_calls"] or out["content"]):
        # Some producers never record it (openai-agents' generation spans): what the
        # output shows, flagged so a user who cares about `length` can tell.
        finish = "tool_call" if out["tool_calls"] else "stop"
        flags.append("finish_reason_inferred")
    tools = normalize_tools(call.tools) if call else []
    return {
        "trace_id": row["trace_id"],
        "span_id": row["span_id"],
        "start_ns": row["start_ns"],
        "end_ns": row["end_ns"],
        "service_name": row["service_name"],
        "scope": row.get("scope_name"),
        "model": _first(attrs, "gen_ai.response.model", "gen_ai.request.model", "llm.model_name", "llm.response.model"),
        "request_model": request_model(attrs, row.get("scope_name")),
        "response_model": response_model(attrs, row.get("scope_name")),
        "provider": _first(attrs, "gen_ai.provider.name", "gen_ai.system", "llm.provider", "llm.system"),
        "policy_version": policy_version(_first(attrs, "gen_ai.response.model", "llm.response.model"),
                                         _first(attrs, "gen_ai.request.model", "llm.model_name")),
        "temperature": _float(_first(attrs, "gen_ai.request.temperature", "llm.request.temperature")),
        "input_messages": call.input_messages if call else [],
        "output_message": call.output_message if call else None,
        "tools": json.dumps(tools, ensure_ascii=False, separators=(",", ":")) if tools else None,
        "finish_reason": finish,
        "completion_logprobs": _logprobs(_first(attrs, "logprobs.content")),
        "input_tokens": _int(_first(attrs, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens",
                                    "llm.token_count.prompt", "llm.usage.prompt_tokens")),
        "output_tokens": _int(_first(attrs, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens",
                                     "llm.token_count.completion", "llm.usage.completion_tokens")),
        "response_id": _first(attrs, "gen_ai.response.id"),
        "convention": convention,
        "truncated": bool(row.get("dropped_attributes_count") or 0),
        "flags": flags,
        # the GenAI convention's named prompt template, when the call used one
        "prompt_name": _first(attrs, "gen_ai.prompt.name"),
        "prompt_version": _first(attrs, "gen_ai.prompt.version"),
        "input_is_delta": bool(call and call.input_is_delta),
        **({"_delta_system": call.delta_system} if call and call.input_is_delta else {}),
    }


def _has_content(rec: dict) -> bool:
    return "content_missing" not in rec["flags"]


def dedupe(records: list[dict], outer_of: dict[str, str | None], counts: Counts) -> list[dict]:
    """One record per real call: an outer span around an inner call (a framework span
    around the client span) and a second span with the same response id are the
    same call. The one with content wins; the inner one when both have it."""
    by_span = {r["span_id"]: r for r in records}
    drop: set[str] = set()
    for r in records:
        outer = outer_of.get(r["span_id"])
        if outer and outer in by_span:
            o = by_span[outer]
            if not _has_content(r) and _has_content(o):
                drop.add(r["span_id"])
            else:
                drop.add(outer)
    seen: dict[tuple[str, str], dict] = {}
    for r in sorted(records, key=lambda r: (not _has_content(r), r["start_ns"], r["span_id"])):
        if r["span_id"] in drop or not r["response_id"]:
            continue
        k = (r["trace_id"], str(r["response_id"]))
        if k in seen:
            drop.add(r["span_id"])
        else:
            seen[k] = r
    counts.duplicates += len(drop)
    return [r for r in records if r["span_id"] not in drop]


#: What a detached record brings to the framework's record of the same call: the wire's view.
_WIRE_FIELDS = ("input_messages", "output_message", "tools", "finish_reason", "request_model", "response_model",
                "model", "provider", "policy_version", "temperature", "completion_logprobs", "input_tokens",
                "output_tokens", "response_id", "convention", "truncated", "flags", "_call")
#: How far a client span may stick out of the framework span around it (clock reads differ).
_SLACK_NS = 5_000_000


def _texts(rec: dict) -> list:
    return [m.get("content") for m in rec["input_messages"] or []]


def _same_call(a: dict, b: dict) -> bool:
    """Two records of one request: equal token counts where both have them, and equal
    input texts where both have them; at least one of the two must be there."""
    agree = 0
    ta, tb = (a["input_tokens"], a["output_tokens"]), (b["input_tokens"], b["output_tokens"])
    if None not in ta and None not in tb:
        if ta != tb:
            return False
        agree += 1
    xa, xb = _texts(a), _texts(b)
    if any(x is not None for x in xa) and any(x is not None for x in xb):
        if xa != xb:
            return False
        agree += 1
    oa, ob = a["output_message"], b["output_message"]
    if oa and ob and (oa.get("content") or None, [c.get("name") for c in oa.get("tool_calls") or []]) != (
            ob.get("content") or None, [c.get("name") for c in ob.get("tool_calls") or []]):
        return False
    return agree > 0


def merge_detached(records: list[dict], root_calls: set[str], counts: Counts) -> list[dict]:
    """One call recorded by a framework span in the agent's trace and by a client
    span that lost its parent (OpenInference's CrewAI event listener, LangChain with
    the openai instrumentor) and became a trace of its own: the same service, the
    client span inside the framework span's time, the same tokens or input. The
    call keeps its place in the agent's trajectory with the client span's content
    (what went over the wire), and the detached trace makes no trajectory."""
    per_trace: dict[str, int] = defaultdict(int)
    for r in records:
        per_trace[r["trace_id"]] += 1
    lone = [r for r in records if r["span_id"] in root_calls and per_trace[r["trace_id"]] == 1]
    if not lone:
        return records
    hosts: dict[str | None, list[dict]] = defaultdict(list)
    for r in records:
        if r["span_id"] not in root_calls and r["start_ns"] is not None and r["end_ns"] is not None:
            hosts[r["service_name"]].append(r)
    for hs in hosts.values():
        hs.sort(key=lambda r: r["start_ns"])
    starts = {k: [h["start_ns"] for h in hs] for k, hs in hosts.items()}
    drop: set[str] = set()
    taken: set[str] = set()
    for d in lone:
        hs = hosts.get(d["service_name"])
        if not hs or d["start_ns"] is None or d["end_ns"] is None:
            continue
        i = bisect.bisect_right(starts[d["service_name"]], d["start_ns"] + _SLACK_NS)
        best = None
        for h in reversed(hs[max(0, i - 64):i]):  # the nearest enclosing spans, a bounded look back
            # one call recorded twice is recorded by two instrumentations: a host of the
            # same scope is another call (concurrent rollouts of one prompt look alike)
            if (h["trace_id"] != d["trace_id"] and h["scope"] != d["scope"] and h["span_id"] not in taken
                    and h["end_ns"] + _SLACK_NS >= d["end_ns"]
                    and _same_call(h, d) and (best is None or h["end_ns"] - h["start_ns"] < best["end_ns"] - best["start_ns"])):
                best = h
        if best is None:
            continue
        for f in _WIRE_FIELDS:
            if f == "flags":
                best["flags"] = [x for x in d["flags"] if x != "finish_reason_inferred" or not best["finish_reason"]]
            elif d.get(f) not in (None, [], ""):
                best[f] = d[f]
        taken.add(best["span_id"])
        drop.add(d["span_id"])
    counts.duplicates += len(drop)
    return [r for r in records if r["span_id"] not in drop]


def rebuild_history(steps: list[dict]) -> None:
    """Put back an assistant tool-call turn that a producer left out of the next
    call's history (openlit does): a tool result whose call id no earlier message
    issued gets, just before it, the earlier output that issued it."""
    outputs: dict[str, dict] = {}
    for s in steps:
        msgs = s["input_messages"]
        # most histories answer no tool call this trajectory's outputs issued: nothing to put back, and the
        # set of ids issued (every message of every step's history) is not worth building
        if outputs and any(m.get("tool_call_id") in outputs for m in msgs if m.get("role") == "tool"):
            _put_back(s, msgs, outputs)
        out = s["output_message"]
        if out:
            for c in out.get("tool_calls") or []:
                if c.get("id"):
                    outputs[c["id"]] = out


def _put_back(s: dict, msgs: list[dict], outputs: dict[str, dict]) -> None:
    """One call's history with the tool-call turns it lacks put back."""
    issued = {c["id"] for m in msgs for c in (m.get("tool_calls") or []) if c.get("id")}
    fixed: list[dict] = []
    inserted = False
    for m in msgs:
        tcid = m.get("tool_call_id")
        if m.get("role") == "tool" and tcid and tcid not in issued and tcid in outputs:
            turn = outputs[tcid]
            fixed.append(turn)
            issued |= {c["id"] for c in turn["tool_calls"] if c.get("id")}
            inserted = True
        fixed.append(m)
    if inserted:
        s["input_messages"] = fixed
        s["flags"].append("history_rebuilt")


def rebuild_deltas(records: list[dict], conversation: list[str | None], day: list | None = None) -> None:
    """Put back the history of the calls that recorded only the messages appended since
    their conversation's previous call (`gen_ai.input.messages_delta`): a conversation's
    calls in order (start, span id), each history that of the call before plus its own
    delta, headed by the call's own system instructions. A call that recorded its whole
    input (`gen_ai.input.messages`: the first, or one after a compaction or a rewrite)
    starts the history again. `conversation` is each call row's `gen_ai.conversation.id`;
    a delta call without one keeps its delta, as does the first call of a conversation
    (the convention has it record its whole input as its delta). Rows rebuilt so are
    flagged `history_from_delta`.

    `day` is each call row's trajectory's day: a history is carried only between calls
    of one day (an incremental build redoes days, and must agree with a full one). A
    day's first call of a conversation whose delta opens with the model's answer or a
    tool's result is not the conversation's first: its history is elsewhere (an earlier
    day, or made outside the lake), and it and the calls built on it are flagged
    `history_incomplete` (the trainer leaves them out) instead of passing for whole."""
    by_conv: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        conv = conversation[r["_call"]]
        if conv:
            by_conv[(conv, None if day is None else day[r["_call"]])].append(r)
    for calls in by_conv.values():
        if not any(r["input_is_delta"] for r in calls):
            continue
        calls.sort(key=lambda r: (r["start_ns"] or 0, r["span_id"]))
        body: list[dict] | None = None  # the history without the system instructions
        broken = False
        for i, r in enumerate(calls):
            if not r["input_is_delta"]:
                body, broken = list(r["input_messages"]), False
                nxt = calls[i + 1] if i + 1 < len(calls) else None
                if nxt is not None and nxt.get("_delta_system") and body and body[0]["role"] == "system":
                    body = body[1:]  # the next call heads the history with its own
                continue
            if body is None and not broken:
                opening = next((m["role"] for m in r["input_messages"] if m["role"] not in ("system", "developer")), None)
                broken = opening in ("assistant", "tool")
            if broken:
                r["flags"].append("history_incomplete")
                body = (body or []) + r["input_messages"]
                continue
            body = (body or []) + r["input_messages"]
            system = r.get("_delta_system")
            head = [system] if system is not None and not any(
                m["role"] == "system" and m["content"] == system["content"] for m in body) else []
            r["input_messages"] = head + body
            r["flags"].append("history_from_delta")


#: The response a call continues (OpenAI's `previous_response_id`, Gemini's
#: `previous_interaction_id`): the call sent only its new items, the provider the rest.
PREVIOUS_RESPONSE = "gen_ai.request.previous_response.id"


def previous_responses(call_rows: pl.DataFrame) -> pl.Series:
    """Per call row, the `gen_ai.response.id` of the response it continues, or null."""
    key = pl.element().struct.field("key")
    return call_rows.select(pl.col("attributes").list.eval(
        pl.element().filter(key == PREVIOUS_RESPONSE).struct.field("value").struct.field("string_value"))
        .list.first().alias("previous")).to_series()


def _leading_system(msgs: list[dict]) -> int:
    n = 0
    while n < len(msgs) and msgs[n]["role"] in ("system", "developer"):
        n += 1
    return n


def rebuild_continuations(records: list[dict], previous: list[str | None], day: list | None = None) -> None:
    """Put back the history of the calls that continued a stored response
    (`gen_ai.request.previous_response.id`): the model saw the continued call's
    whole history and answer, then the new items; the span holds only the new
    items. Each such history is the continued call's (itself rebuilt when it
    continued another) without its instructions, its answer, then the call's own
    messages under its own instructions, as the provider assembles it (a stored
    response's instructions are not carried over). Rebuilt rows are flagged
    `history_from_previous_response`; a call whose continued response is not among
    the bucket's calls (another bucket's trace, a response made outside the lake)
    keeps its new items and is flagged `history_incomplete`, which the trainer
    leaves out: trained on, the answer would be learned for a state the model never saw.
    `day` is each call row's trajectory's day: a response is continued from only
    within one day (`rebuild_deltas` says why); one of another day counts as not found."""
    if not any(previous[r["_call"]] for r in records):
        return
    by_id = {str(r["response_id"]): r for r in records if r["response_id"]}
    full: dict[int, list[dict] | None] = {}
    for r in sorted(records, key=lambda r: (r["start_ns"] or 0, r["span_id"])):
        prev = previous[r["_call"]]
        if not prev:
            full[id(r)] = r["input_messages"]
            continue
        before = by_id.get(prev)
        if before is not None and day is not None and day[before["_call"]] != day[r["_call"]]:
            before = None
        history = full.get(id(before)) if before is not None and before is not r else None
        if history is None:
            full[id(r)] = None
            r["flags"].append("history_incomplete")
            continue
        own = r["input_messages"]
        k = _leading_system(own)
        answer = [before["output_message"]] if before["output_message"] is not None else []
        r["input_messages"] = own[:k] + history[_leading_system(history):] + answer + own[k:]
        full[id(r)] = r["input_messages"]
        r["flags"].append("history_from_previous_response")


def events_of(df: pl.DataFrame) -> dict[tuple[str, str], list[dict]]:
    """GenAI events recorded as span events (some producers put content there)."""
    out: dict[tuple[str, str], list[dict]] = {}
    if "events" not in df.columns:
        return out
    ev = df.select("trace_id", "span_id", "events").filter(pl.col("events").list.len() > 0)
    if ev.height == 0:
        return out
    ev = ev.explode("events").filter(pl.col("events").struct.field("name").str.starts_with("gen_ai."))
    if ev.height == 0:
        return out
    dicts = A.to_dicts(ev["events"].struct.field("attributes").to_arrow())
    for t, s, name, a in zip(ev["trace_id"], ev["span_id"], ev["events"].struct.field("name"), dicts):
        out.setdefault((t, s), []).append({"event_name": name, "body": None, "attributes": a})
    return out

