"""The per-call normalizer in bulk: one record per call span, built by Polars
expressions over the bucket's call rows instead of one Python reader call each.

`calls.read_record` stays the definition of a record (and its tests' oracle). This
module gives the same records, field for field, for the layouts most calls come
in: OpenTelemetry GenAI JSON messages (`gen_ai.input.messages`, its delta form,
`gen_ai.output.messages`), OpenInference's flattened `llm.*_messages.{i}.message.*`,
OpenLLMetry's older `gen_ai.prompt.{i}.*` (Agent Lightning's), and spans with no
content (capture off, token ids only). A call that any of its values makes unusual
(content in log or span events, a value of an unexpected type, JSON that a fixed
shape cannot vouch for, a layout only Python reads) goes to `read_record` whole,
and is counted by why: the summary says how many calls took the Python path.

Values whose exact reading is a small Python function over few distinct values
(tool definitions, finish reasons, token counts, model names) are read once per
distinct value and joined back: the same function, so the same result.
"""

from __future__ import annotations

import gc
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import polars as pl

from . import attrs as A
from . import calls as C
from .conventions import Call
from .messages import TEXT_PARTS, MessageError, from_system_instructions, normalize_finish_reason

#: Keys whose value the expression path reads (exactly these, and the indexed groups below).
GENAI_JSON = ("gen_ai.input.messages", "gen_ai.input.messages_delta", "gen_ai.output.messages",
              "gen_ai.system_instructions", "gen_ai.tool.definitions")
FINISH_KEYS = ("gen_ai.response.finish_reasons", "llm.response.finish_reason", "llm.finish_reason")
MODEL_KEYS = ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name", "llm.response.model",
              "llm.request.model")
PROVIDER_KEYS = ("gen_ai.provider.name", "gen_ai.system", "llm.provider", "llm.system")
TEMPERATURE_KEYS = ("gen_ai.request.temperature", "llm.request.temperature")
INPUT_TOKEN_KEYS = ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens", "llm.token_count.prompt",
                    "llm.usage.prompt_tokens")
OUTPUT_TOKEN_KEYS = ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens", "llm.token_count.completion",
                     "llm.usage.completion_tokens")
PROMPT_KEYS = ("gen_ai.prompt.name", "gen_ai.prompt.version")
#: Read through Python once per distinct value: any OTLP type is fine there.
_ANY_TYPE = frozenset(TEMPERATURE_KEYS + INPUT_TOKEN_KEYS + OUTPUT_TOKEN_KEYS + FINISH_KEYS + ("logprobs.content",))
_EXACT = frozenset(GENAI_JSON + FINISH_KEYS + MODEL_KEYS + PROVIDER_KEYS + PROMPT_KEYS + tuple(_ANY_TYPE) + (
    "input.value", "output.value", "openinference.span.kind", "llm.invocation_parameters", "gen_ai.response.id"))
#: The keys `_records` reads as text, one column each.
_TEXT_KEYS = tuple(sorted(set(MODEL_KEYS + PROVIDER_KEYS + PROMPT_KEYS) | {
    "gen_ai.response.id", "openinference.span.kind", "llm.invocation_parameters", "output.value"}))
#: Which sets of keys each attribute's key is in, as columns of `_long`'s `vals`: worked
#: out once per distinct key, where testing each attribute's key text against a set
#: (hashing it) cost about 5 ms per set and bucket.
_KEY_SETS = {"_genai": GENAI_JSON[:3], "_genai_any": GENAI_JSON, "_any_type": tuple(sorted(_ANY_TYPE)),
             "_text_key": _TEXT_KEYS}
_PREFIXES = ("gen_ai.prompt.", "gen_ai.completion.", "llm.input_messages.", "llm.output_messages.", "llm.tools.",
             "llm.request.functions.")
#: `prefix.{i}.rest`, as `conventions.indexed` groups keys (ASCII digits; other keys under
#: these prefixes send the call to Python).
_INDEXED = r"^(gen_ai\.prompt|gen_ai\.completion|llm\.input_messages|llm\.output_messages|llm\.tools|llm\.request\.functions)\.([0-9]+)\.(.+)$"

# GenAI JSON: the one shape decoded in Polars. A field of another JSON type than the
# shape says (an object as tool-call arguments, a null content, a number as a role)
# would read differently, so such text goes to Python; so does a lone surrogate escape.
_PART = pl.Struct({"type": pl.String, "content": pl.String, "id": pl.String, "name": pl.String,
                   "arguments": pl.String, "response": pl.String, "result": pl.String})
_MESSAGES = pl.List(pl.Struct({"role": pl.String, "parts": pl.List(_PART), "name": pl.String,
                               "finish_reason": pl.String}))
_UNVOUCHED = "|".join((
    r'"(role|content|response|result)"\s*:\s*[^"\s]',  # must be text
    r'"(arguments|name|id|type|finish_reason)"\s*:\s*[^"\sn]',  # text or null
    r'"parts"\s*:\s*[^\[\s]',
    r"\\u[dD][89a-fA-F]",
))

_EMPTY_CALLS = pl.lit([], pl.List(pl.Struct({"id": pl.String, "name": pl.String, "arguments": pl.String})))


@dataclass
class Normalized:
    """Every call's record, in call-row order (`_call` is the row), and how many
    took the Python reader, by why."""

    records: list[dict]
    python: Counter = field(default_factory=Counter)


@dataclass
class Frames:
    """The records as the expressions left them, not yet Python: `frame` (one row per
    call they read, `row` its call index, the record's scalar fields) and `flat` (their
    messages, one per line, `side` 0 input in order then 1 the output); `slow`, the
    records `read_record` made (rare layouts), each with its `_call`. The build keeps
    the frames columnar to the transitions table; `records` is the Python form."""

    frame: pl.DataFrame | None
    flat: pl.DataFrame | None
    slow: list[dict]
    python: Counter = field(default_factory=Counter)

    def records(self) -> list[dict]:
        """Every call's record, in call-row order (the rows of the frames and the slow
        ones interleaved as the calls were)."""
        out = _to_records(self.frame, self.flat) if self.frame is not None else []
        if self.slow:
            out = sorted(out + self.slow, key=lambda r: r["_call"])
        return out


def read_records(call_rows: pl.DataFrame, events: dict[tuple[str, str], list[dict]]) -> Normalized:
    """The record of every row of `call_rows` (`trace_id, span_id, start_ns, end_ns,
    service_name, gen_ai_operation_name, scope_name, dropped_attributes_count,
    attributes`), `events` by (trace, span) as `read_record` takes them."""
    got = read_frames(call_rows, events)
    out: list[dict | None] = [None] * call_rows.height
    for rec in got.records():
        out[rec["_call"]] = rec
    return Normalized(out, got.python)  # type: ignore[arg-type]


def read_frames(call_rows: pl.DataFrame, events: dict[tuple[str, str], list[dict]]) -> Frames:
    """`read_records`' records, those the expressions read still as frames."""
    n = call_rows.height
    got = Frames(None, None, [])
    if n == 0:
        return got
    meta = call_rows.select("trace_id", "span_id", "start_ns", "end_ns", "service_name", "gen_ai_operation_name",
                            "scope_name", "dropped_attributes_count",
                            *[pl.col(c) if c in call_rows.columns else pl.lit(None, pl.String).alias(c)
                              for c in ("scope_schema_url", "resource_schema_url")])
    feats, vals = _long(call_rows)
    why = _python_reasons(meta, feats, vals, events)
    fast = why.filter(pl.col("why").is_null())["row"]
    if fast.len():
        frame, flat = _records(meta, feats, vals, fast)
        slow_too = frame.filter(pl.col("_why").is_not_null()).select("row", pl.col("_why").alias("why"))
        frame = frame.filter(pl.col("_why").is_null())
        if frame.height:
            got.frame = frame.sort("row")
            got.flat = flat.filter(pl.col("row").is_in(frame["row"].implode()))
        why = why.update(slow_too, on="row")
    slow = why.filter(pl.col("why").is_not_null())
    if slow.height:
        rows = slow["row"]
        attrs = A.to_dicts_without(call_rows["attributes"].gather(rows), C.TOKEN_KEYS)
        for i, reason, a in zip(rows.to_list(), slow["why"].to_list(), attrs):
            row = meta.row(i, named=True)
            rec = C.read_record(row, a, events.get((row["trace_id"], row["span_id"]), []))
            rec["_call"] = i
            got.slow.append(rec)
            got.python[reason] += 1
    return got


# --- the attributes, long --------------------------------------------------------------


def _long(call_rows: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`feats`: per row, what its keys say (content keys, token ids, OpenInference
    groups, ...); `vals`: (row, key, type, text, value) of the attributes the records
    read, `text` their value as text where it is text, `_kid` the key's number in this
    frame, and whether the key is in each of `_KEY_SETS`."""
    long = (call_rows.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("row"), "attributes")
            .explode("attributes").filter(pl.col("attributes").is_not_null())
            .select("row", pl.col("attributes").struct.field("key").alias("key"),
                    pl.col("attributes").struct.field("value").alias("value")))
    key = pl.col("key")
    # what each distinct key says, worked out once per key (a bucket's calls repeat a
    # few hundred keys a million times), then per row
    pre = pl.any_horizontal([key.str.starts_with(p) for p in _PREFIXES])
    kinfo = long.select(key.unique()).with_columns(
        pl.int_range(pl.len(), dtype=pl.UInt32).alias("_kid"),  # the key as a number, for the duplicate check
        key.str.contains(C.CONTENT_KEY_PATTERN).alias("has_content_key"),
        key.is_in(list(C.CAPTURE_OFF_KEYS)).alias("capture_off_key"),
        key.is_in(sorted(C.TOKEN_KEYS)).alias("token_key"),
        (key == "response_token_ids").alias("response_ids"),
        key.str.contains(r"^llm\.input_messages\.[0-9]+\.").alias("oi_in"),
        key.str.contains(r"^llm\.output_messages\.[0-9]+\.").alias("oi_out"),
        (key == "input.value").alias("input_value"),
        (key == "output.value").alias("output_value"),
        (key == "gen_ai.input.messages_delta").alias("delta"),
        key.str.contains(r"^llm\.input_messages\.[0-9]+\.function\.[0-9]+$").alias("oi_function"),
        (key.is_in(sorted(_EXACT)) | pre).alias("_keep"),
        # `gen_ai.prompt.01.x` is group 1 in Python; a non-ASCII digit is a group there too
        pl.when(pre & key.str.contains(r"\.0[0-9]")).then(pl.lit("indexed keys with leading zeros"))
        .when(pre & key.str.contains(r"[^\x00-\x7f]")).then(pl.lit("indexed keys with non-ASCII characters"))
        .alias("_key_why"),
        key.str.extract_groups(_INDEXED).alias("_k"),
    ).with_columns(pl.col("_k").struct.field("1").alias("head"),
                   pl.col("_k").struct.field("2").cast(pl.Int64).alias("g"),
                   pl.col("_k").struct.field("3").alias("rest")).drop("_k")
    flags = [c for c in kinfo.columns if c not in ("key", "_kid", "_keep", "_key_why", "head", "g", "rest")]
    flagged = kinfo.filter(pl.any_horizontal(flags))
    # inner joins: the keys' filter and their columns in one operation, not two (half the CPU)
    feats = (long.select("row", "key").join(flagged.select("key", *flags), on="key")
             .group_by("row").agg([pl.col(c).any() for c in flags]))
    kept = kinfo.filter("_keep").select("key", "_kid", "head", "g", "rest", "_key_why",
                                         *[key.is_in(ks).alias(name) for name, ks in _KEY_SETS.items()])
    long = long.join(kept, on="key", how="inner", maintain_order="left")
    v = pl.col("value")
    typ = v.struct.field("type")
    vals = long.select(
        "row", "key", "_kid", "head", "g", "rest", "_key_why", *_KEY_SETS, typ.alias("type"),
        pl.when(typ == "string").then(v.struct.field("string_value"))
        .when(typ.is_in(["array", "kvlist"])).then(v.struct.field("json_value")).alias("text"),
        "value")
    return feats, vals


def _python_none(typ: pl.Expr, value: pl.Expr) -> pl.Expr:
    """Where `attrs.to_dicts` gives None: `_first` skips those, `in` does not."""
    f = value.struct.field
    return (pl.when(typ == "string").then(f("string_value").is_null())
            .when(typ == "int").then(f("int_value").is_null())
            .when(typ == "double").then(f("double_value").is_null())
            .when(typ == "bool").then(f("bool_value").is_null())
            .when(typ == "bytes").then(f("bytes_value").is_null())
            .when(typ.is_in(["array", "kvlist"])).then(f("json_value").is_null() | (f("json_value").str.strip_chars() == "null"))
            .otherwise(True))


def _python_reasons(meta: pl.DataFrame, feats: pl.DataFrame, vals: pl.DataFrame,
                    events: dict[tuple[str, str], list[dict]]) -> pl.DataFrame:
    """(row, why): why a row must go to `read_record`, null where the expressions read it."""
    key, typ, text = pl.col("key"), pl.col("type"), pl.col("text")
    bad_value = (
        _python_none(typ, pl.col("value"))
        | (pl.col("_genai_any") & ~typ.is_in(["string", "array"]))
        | (~pl.col("_genai_any") & ~pl.col("_any_type") & (typ != "string"))
    )
    per_key = vals.select(
        "row",
        pl.when(bad_value).then(pl.lit("values of unexpected types"))
        .when(pl.col("_key_why").is_not_null()).then(pl.col("_key_why"))
        # (the pattern tried on the GenAI messages' text only, not on every attribute's)
        .when(pl.col("_genai") & pl.when(pl.col("_genai")).then(text).str.contains(_UNVOUCHED))
        .then(pl.lit("GenAI messages with structured or null fields"))
        .alias("why"),
    ).filter(pl.col("why").is_not_null()).group_by("row").agg(pl.col("why").min())
    # (a key twice: Python keeps the last value; only the keys read here matter)
    # (row, key) as one integer: hashing it costs half of hashing the pair with the key's text
    pair = pl.col("row").cast(pl.UInt64) * pl.lit(1 << 32, pl.UInt64) + pl.col("_kid").cast(pl.UInt64)
    dup = vals.select("row", pair.is_duplicated().alias("_dup")).filter("_dup").select(
        "row", pl.lit("repeated attribute keys").alias("why")).unique("row") if vals.select(
        pair.n_unique()).item() < vals.height else pl.DataFrame(schema={"row": pl.UInt32, "why": pl.String})
    has = feats
    # (each filter on the columns it needs: a filter copies every column it keeps)
    oi_kind = vals.select("row", "key", "text").filter(key == "openinference.span.kind").group_by("row").agg(
        text.last().alias("oi_kind"))
    genai = vals.select("row", "_genai").filter("_genai").group_by("row").agg(pl.len().alias("g"))
    t = (meta.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("row"), "trace_id", "span_id")
         .join(has, on="row", how="left").join(oi_kind, on="row", how="left").join(genai, on="row", how="left"))
    ev = [(a, b) in events for a, b in zip(t["trace_id"].to_list(), t["span_id"].to_list())] if events else None
    oi = ~pl.col("g").is_not_null() & (pl.col("oi_in").fill_null(False) | pl.col("oi_out").fill_null(False))
    layout_why = (
        pl.when(pl.col("_ev")).then(pl.lit("content in log or span events"))
        .when(pl.col("delta").fill_null(False)).then(pl.lit("GenAI input deltas"))
        .when(oi & pl.col("oi_function").fill_null(False)).then(pl.lit("OpenInference AutoGen tool results"))
        .when(oi & ~pl.col("oi_in").fill_null(False) & pl.col("input_value").fill_null(False))
        .then(pl.lit("OpenInference raw request (input.value)"))
        .when(oi & ~pl.col("oi_out").fill_null(False) & pl.col("output_value").fill_null(False))
        .then(pl.lit("OpenInference raw response (output.value)"))
        .when(pl.col("g").is_null() & ~pl.col("oi_in").fill_null(False) & ~pl.col("oi_out").fill_null(False)
              & pl.col("input_value").fill_null(False) & (pl.col("oi_kind") == "LLM"))
        .then(pl.lit("OpenInference raw request (input.value)"))
    )
    t = t.with_columns(pl.Series("_ev", ev, pl.Boolean) if ev is not None else pl.lit(False).alias("_ev"))
    t = t.select("row", layout_why.alias("why"))
    for other in (per_key, dup):
        t = t.join(other.rename({"why": "w2"}), on="row", how="left").select(
            "row", pl.coalesce("why", "w2").alias("why"))
    return t


# --- the records -----------------------------------------------------------------------


def _python_value(v: dict | None) -> Any:
    if v is None:
        return None
    return A._value(v["type"], v["string_value"], v["int_value"], v["double_value"], v["bool_value"],
                    v["json_value"], v["bytes_value"])


def _per_value(col: pl.Series, fn: Callable[[Any], Any], dtype: pl.DataType) -> pl.Series:
    """`fn` of each value of `col`, computed once per distinct value."""
    uniq = col.unique(maintain_order=True)
    lut = pl.DataFrame({"k": uniq, "v": pl.Series([fn(x) for x in uniq.to_list()], dtype=dtype)})
    return col.to_frame("k").join(lut, on="k", how="left", maintain_order="left", nulls_equal=True)["v"]


def _records(meta: pl.DataFrame, feats: pl.DataFrame, vals: pl.DataFrame,
             fast: pl.Series) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The record columns of the rows in `fast`, and `_why` for those that turn out to
    need Python after all (JSON the fixed shape could not decode); and their messages,
    one per line (`row, side, role, content, name, tool_calls, tool_call_id`), inputs in
    order then each row's output."""
    base = meta.with_row_index("row")
    if fast.len() < meta.height:  # (fast: distinct rows; all of them, most often: nothing to filter)
        vals = vals.filter(pl.col("row").is_in(fast.implode()))
        base = base.filter(pl.col("row").is_in(fast.implode()))
    df = base.join(feats.select("row", "has_content_key", "capture_off_key", "token_key", "response_ids"), on="row",
                   how="left")
    msgs, why, flat = _messages(vals)
    df = df.join(msgs, on="row", how="left").join(why, on="row", how="left")
    for ks, which, what, prefix in ((_TEXT_KEYS, "_text_key", "text", ""), (_KEY_SETS["_any_type"], "_any_type", "value", "v:")):
        sub = vals.select("row", "key", what, which).filter(which)
        wide = sub.pivot(on="key", index="row", values=what, aggregate_function=None) if sub.height else None
        missing = [k for k in ks if wide is None or k not in wide.columns]
        if wide is not None:
            df = df.join(wide.rename({k: prefix + k for k in wide.columns if k != "row"}), on="row", how="left")
        df = df.with_columns([pl.lit(None, vals.schema[what]).alias(prefix + k) for k in missing])

    def first(*ks: str) -> pl.Expr:
        return pl.coalesce([pl.col(k) for k in ks]) if len(ks) > 1 else pl.col(ks[0])

    df = df.with_columns(
        first(*MODEL_KEYS[:4]).alias("model"), first(*PROVIDER_KEYS).alias("provider"),
        first("gen_ai.response.id").alias("response_id"), first(PROMPT_KEYS[0]).alias("prompt_name"),
        first(PROMPT_KEYS[1]).alias("prompt_version"), first("openinference.span.kind").alias("oi_kind"),
        first("gen_ai.response.model", "llm.response.model").alias("_resp"),
        first("gen_ai.request.model", "llm.model_name").alias("_req"),
        first("gen_ai.request.model", "llm.request.model").alias("_req_only"),
        first("llm.model_name").alias("_llm_model"), first("llm.invocation_parameters").alias("_params"))
    for name, ks, fn, dtype in (("temperature", TEMPERATURE_KEYS, C._float, pl.Float64),
                                ("input_tokens", INPUT_TOKEN_KEYS, C._int, pl.Int64),
                                ("output_tokens", OUTPUT_TOKEN_KEYS, C._int, pl.Int64),
                                ("_attr_finish", FINISH_KEYS[:2], normalize_finish_reason, pl.String),
                                ("_genai_finish", FINISH_KEYS[:1], normalize_finish_reason, pl.String),
                                ("_oi_finish", FINISH_KEYS[2:], normalize_finish_reason, pl.String)):
        got = df.select(first(*["v:" + k for k in ks])).to_series()
        df = df.with_columns(_per_value(got, lambda v, fn=fn: fn(_python_value(v)), dtype).alias(name))
    lp = df.select("row", pl.col("v:logprobs.content").alias("value")).filter(pl.col("value").is_not_null())
    lp = lp.with_columns(pl.Series("completion_logprobs", [C._logprobs(_python_value(v)) for v in lp["value"].to_list()],
                                   pl.List(pl.Float64)))
    df = df.join(lp.select("row", "completion_logprobs"), on="row", how="left")
    df = df.join(_tools(vals), on="row", how="left")
    ov = df.filter((pl.col("layout") == "openinference") & pl.col("_oi_finish").is_null()
                   & pl.col("output.value").is_not_null()).select("row", pl.col("output.value").alias("text"))
    ov = ov.with_columns(pl.Series("_ov_finish", [_output_value_finish(x) for x in ov["text"].to_list()], pl.String))
    df = df.join(ov.select("row", "_ov_finish"), on="row", how="left")
    return _finish(df), flat


def _output_value_finish(out: str | None) -> str | None:
    """`read_openinference`'s last resort: a framework's own result object."""
    if not isinstance(out, str) or '"finish_reason"' not in out:
        return None
    try:
        return normalize_finish_reason(json.loads(out).get("finish_reason"))
    except (json.JSONDecodeError, AttributeError):
        return None


def _finish(df: pl.DataFrame) -> pl.DataFrame:
    """The fields `read_record` derives from the call: model names, convention,
    finish reason, flags."""
    scope = pl.col("scope_name")
    unknown = scope.is_in(sorted(C.UNKNOWN_MODEL_SCOPES)).fill_null(False)
    by_request = scope.is_in(sorted(C.REQUEST_MODEL_SCOPES)).fill_null(False)
    params_model = _per_value(df["_params"], _params_model, pl.String)
    generation = _per_value(df.select(pl.struct("scope_schema_url", "resource_schema_url")).to_series(),
                            lambda r: C.events_generation(r or {}), pl.Boolean)
    df = df.with_columns(generation.alias("_events_generation"))
    pv = _per_value(df.select(pl.struct("_resp", "_req")).to_series(),
                    lambda s: C.policy_version(s["_resp"], s["_req"]) if s else None, pl.String)
    df = df.with_columns(params_model.alias("_params_model"), pv.alias("policy_version"))
    req = pl.coalesce(pl.col("_req_only"), pl.when(by_request).then(pl.col("_llm_model")))
    req = pl.when(req.is_null() & pl.col("_params").str.contains('"model"', literal=True)).then(
        pl.col("_params_model")).otherwise(req)
    resp = pl.coalesce(pl.col("_resp"), pl.when(~by_request).then(pl.col("_llm_model")))
    req, resp = (pl.when(x == "").then(None).otherwise(x) for x in (req, resp))
    layout = pl.col("layout")
    # a call: a layout read, or token ids alone (Agent Lightning's spans without content)
    is_call = layout.is_not_null() | pl.col("token_key").fill_null(False)
    convention = (
        pl.when(layout == "openllmetry_legacy").then(
            pl.when(pl.col("response_ids").fill_null(False)).then(pl.lit("agentlightning")).otherwise(layout))
        .when(layout.is_not_null()).then(layout)
        .when(is_call).then(pl.lit("agentlightning"))
        .when(pl.col("gen_ai_operation_name").is_not_null() & (pl.col("gen_ai_operation_name") != ""))
        .then(pl.when(pl.col("_events_generation")).then(pl.lit("otel_genai_events_legacy")).otherwise(pl.lit("otel_genai")))
        .when(pl.col("oi_kind").is_not_null() & (pl.col("oi_kind") != "")).then(pl.lit("openinference"))
        .otherwise(pl.lit("unknown"))
    )
    has_output = pl.col("_out_calls").is_not_null()
    out_content, out_calls = pl.col("_out_content"), pl.col("_out_calls")
    no_out = ~has_output | ((out_content.fill_null("") == "") & (out_calls == 0)) | (
        out_content.fill_null("") == C._REDACTED)
    no_in = ~pl.col("_in_has").fill_null(False)
    no_content_expected = pl.col("capture_off_key").fill_null(False) & ~pl.col("has_content_key").fill_null(False)
    layout_flag = (pl.when(~is_call & ~no_content_expected).then(pl.lit("unknown_layout"))
                   .when(no_out & no_in).then(pl.lit("content_missing")))
    call_finish = (pl.when(layout == "openinference").then(pl.coalesce("_oi_finish", "_ov_finish"))
                   .when(layout == "otel_genai").then(pl.coalesce("_genai_finish", "_call_finish"))  # `read_genai`
                   .when(layout.is_not_null()).then(pl.col("_call_finish")))
    finish = pl.coalesce(call_finish, pl.col("_attr_finish"))
    has_out = has_output & ((out_calls > 0) | (out_content.fill_null("") != ""))
    inferred = finish.is_null() & has_out.fill_null(False)
    finish = pl.when(inferred).then(
        pl.when(out_calls > 0).then(pl.lit("tool_call")).otherwise(pl.lit("stop"))
    ).otherwise(finish)
    problems = (pl.when(layout == "otel_genai").then(pl.col("problems_g")).when(layout == "openinference")
                .then(pl.col("problems_o")).when(layout == "openllmetry_legacy").then(pl.col("problems_l")))
    flags = pl.concat_list(
        problems.fill_null(pl.lit([], pl.List(pl.String))),
        pl.when(layout_flag.is_not_null()).then(pl.concat_list(layout_flag)).otherwise(pl.lit([], pl.List(pl.String))),
        pl.when(inferred).then(pl.lit(["finish_reason_inferred"])).otherwise(pl.lit([], pl.List(pl.String))),
    )
    return df.with_columns(
        pl.when(unknown).then(None).otherwise(req).alias("request_model"),
        pl.when(unknown).then(None).otherwise(resp).alias("response_model"),
        convention.alias("convention"),
        finish.alias("finish_reason"),
        flags.alias("flags"),
        pl.col("dropped_attributes_count").fill_null(0).cast(pl.Boolean).alias("truncated"),
        pl.when(layout == "otel_genai").then(pl.col("tools_g")).when(layout == "openinference").then(pl.col("tools_o"))
        .when(layout == "openllmetry_legacy").then(pl.col("tools_l")).alias("tools"),
        pl.lit(False).alias("input_is_delta"),
    )


def _params_model(params: str | None) -> str | None:
    if params is None or '"model"' not in params:
        return None
    try:
        m = json.loads(params).get("model")
    except (json.JSONDecodeError, AttributeError):
        return None
    return m if isinstance(m, str) and m else None


# --- messages --------------------------------------------------------------------------

_TOOL_CALL = pl.Struct({"id": pl.String, "name": pl.String, "arguments": pl.String})
_MESSAGE = pl.Struct({"role": pl.String, "content": pl.String, "name": pl.String, "tool_calls": pl.List(_TOOL_CALL),
                      "tool_call_id": pl.String})
_MESSAGE_LIST = pl.List(_MESSAGE)
#: One message of the flat form: (row, side, order) -> its fields; side 0 input, 1 output.
_FLAT = {"row": pl.UInt32, "side": pl.Int8, "o1": pl.Int64, "o2": pl.Int64, "role": pl.String, "content": pl.String,
         "name": pl.String, "tool_calls": pl.List(_TOOL_CALL), "tool_call_id": pl.String}


def _messages(vals: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Per row: `layout`, `input_messages`, `output_message`, `_call_finish` (the
    finish reason the layout's messages carry), `_problems`; and (row, _why) for rows
    the fixed JSON shape could not read."""
    genai_rows = vals.select("row", "_genai").filter("_genai").select("row").unique()
    idx = vals.select("row", "head", "g", "rest", "text").filter(pl.col("head").is_not_null())
    idx = idx.filter(~pl.col("row").is_in(genai_rows["row"].implode()))
    oi_rows = idx.filter(pl.col("head").is_in(["llm.input_messages", "llm.output_messages"])).select("row").unique()
    legacy = idx.filter(~pl.col("row").is_in(oi_rows["row"].implode())
                        & pl.col("head").is_in(["gen_ai.prompt", "gen_ai.completion"]))
    oi = idx.filter(pl.col("row").is_in(oi_rows["row"].implode()) & pl.col("head").is_in(
        ["llm.input_messages", "llm.output_messages"]))
    flat_g, extra_g, why = _genai(vals)
    flat_o, extra_o = _flattened(oi, "llm.output_messages", "message.", "message.tool_calls.",
                                 ("tool_call.id", "tool_call.function.name", "tool_call.function.arguments"),
                                 "openinference")
    flat_l, extra_l = _flattened(legacy, "gen_ai.completion", "", "tool_calls.", ("id", "name", "arguments"),
                                 "openllmetry_legacy")
    flat = pl.concat([flat_g, flat_o, flat_l])
    msg = pl.struct(pl.when(pl.col("role") == "developer").then(pl.lit("system")).otherwise(pl.col("role")).alias("role"),
                    "content", "name", "tool_calls", "tool_call_id").alias("m")
    flat = flat.sort("row", "side", "o1", "o2").select("row", "side", msg).unnest("m")
    calls = pl.col("tool_calls").list.len()
    ins = flat.filter(pl.col("side") == 0).group_by("row").agg(
        ((pl.col("content").is_not_null() & (pl.col("content") != C._REDACTED)) | (calls > 0)).any().alias("_in_has"))
    outs = flat.filter(pl.col("side") == 1).group_by("row", maintain_order=True).agg(
        pl.col("content").first().alias("_out_content"), calls.first().alias("_out_calls"))
    extra = pl.concat([extra_g, extra_o, extra_l], how="diagonal_relaxed")
    for c in ("layout", "_call_finish"):
        if c not in extra.columns:
            extra = extra.with_columns(pl.lit(None, pl.String).alias(c))
    out = extra.join(ins, on="row", how="left").join(outs, on="row", how="left")
    return out, why, flat.filter(pl.col("side") == 0).vstack(
        flat.filter(pl.col("side") == 1).unique(["row"], keep="first", maintain_order=True))


def _flattened(idx: pl.DataFrame, out_head: str, pre: str, calls_pre: str, call_fields: tuple[str, str, str],
               layout: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """OpenInference's and OpenLLMetry's indexed messages, `conventions._oi_message` and
    `_ollm_message` as expressions."""
    if idx.height == 0:
        return pl.DataFrame(schema=_FLAT), pl.DataFrame(schema={"row": pl.UInt32, "layout": pl.String})
    rest = pl.col("rest")
    idx = idx.with_columns((pl.col("head") == out_head).cast(pl.Int8).alias("side"))
    k = ["row", "side", "g"]

    def field(name: str) -> pl.Expr:
        return pl.col("text").filter(rest == name).last().alias(name)

    fields = idx.group_by(k).agg(field(pre + "role"), field(pre + "content"), field(pre + "name"),
                                 field(pre + "tool_call_id"), field("finish_reason"))
    call_re = "^" + re.escape(calls_pre) + r"([0-9]+)\.(.+)$"
    calls = idx.filter(rest.str.contains(call_re)).with_columns(
        rest.str.extract(call_re, 1).cast(pl.Int64).alias("k"), rest.str.extract(call_re, 2).alias("f"))
    calls = calls.group_by(k + ["k"]).agg(
        *[pl.col("text").filter(pl.col("f") == f).last().alias(n) for f, n in zip(call_fields, ("id", "name", "arguments"))])
    calls = calls.sort(k + ["k"]).group_by(k, maintain_order=True).agg(
        pl.struct("id", "name", pl.col("arguments").fill_null("{}")).alias("tool_calls"))
    fields = fields.join(calls, on=k, how="left")
    if pre:  # OpenInference: ordered content parts when there is no plain content
        part_re = r"^message\.contents\.([0-9]+)\.(.+)$"
        parts = idx.filter(rest.str.contains(part_re)).with_columns(
            rest.str.extract(part_re, 1).cast(pl.Int64).alias("j"), rest.str.extract(part_re, 2).alias("f"))
        parts = parts.group_by(k + ["j"]).agg(
            pl.col("text").filter(pl.col("f") == "message_content.type").last().alias("t"),
            pl.col("text").filter(pl.col("f") == "message_content.text").last().alias("x"))
        texts = parts.filter((pl.col("t").fill_null("text") == "text") & pl.col("x").is_not_null()).sort(
            k + ["j"]).group_by(k, maintain_order=True).agg(pl.col("x").str.join("").alias("_parts_text"))
        fields = fields.join(texts, on=k, how="left").with_columns(
            pl.coalesce(pl.col(pre + "content"), pl.col("_parts_text")).alias(pre + "content"))
    flat = fields.select(
        "row", "side", pl.col("g").alias("o1"), pl.lit(0, pl.Int64).alias("o2"),
        pl.col(pre + "role").fill_null("").alias("role"), pl.col(pre + "content").alias("content"),
        pl.col(pre + "name").alias("name"), pl.col("tool_calls").fill_null(_EMPTY_CALLS),
        pl.col(pre + "tool_call_id").alias("tool_call_id"))
    first_out = fields.filter(pl.col("side") == 1).sort("row", "g").group_by("row", maintain_order=True).agg(
        pl.col("finish_reason").first())
    rows = idx.select("row").unique().with_columns(pl.lit(layout).alias("layout"))
    if not pre:  # OpenLLMetry: the first completion's finish reason
        rows = rows.join(first_out, on="row", how="left", maintain_order="left")
        rows = rows.with_columns(_per_value(rows["finish_reason"], normalize_finish_reason, pl.String)
                                 .alias("_call_finish")).drop("finish_reason")
    return flat.cast(_FLAT), rows


def _genai(vals: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """GenAI JSON messages (`from_genai_messages`, `read_genai`) decoded with one fixed
    shape; rows it cannot vouch for come back in the third frame, for Python."""
    empty_why = pl.DataFrame(schema={"row": pl.UInt32, "_why": pl.String})
    g = vals.select("row", "key", "text", "_genai").filter("_genai")
    if g.height == 0:
        return pl.DataFrame(schema=_FLAT), pl.DataFrame(schema={"row": pl.UInt32, "layout": pl.String}), empty_why
    rows = g.select("row").unique()
    decoded, bad = _decode(g.select("row", "key", "text"))
    why = bad.select("row", pl.lit("GenAI messages the fixed shape cannot read").alias("_why")).unique("row")
    m = (decoded.with_columns(pl.col("doc").list.eval(pl.element().struct.field("finish_reason")).list.first().alias("fr"))
         .with_columns(pl.int_ranges(pl.col("doc").list.len()).alias("g")).explode("doc", "g")
         .filter(pl.col("doc").is_not_null()).unnest("doc"))
    # shapes Python reads its own way: OpenAI-style or part-less messages, printed client objects
    m = m.with_columns(pl.col("parts").list.eval(pl.element().struct.field("type").is_in(list(TEXT_PARTS))).list.sum()
                       .alias("_nt"),
                       pl.col("parts").list.eval(pl.element().struct.field("type") == "tool_call").list.sum().alias("_nc"),
                       pl.col("parts").list.eval(pl.element().struct.field("type") == "tool_call_response").list.sum()
                       .alias("_nr"))
    first_text = pl.col("parts").list.eval(pl.element().filter(pl.element().struct.field("type") == "text")
                                           .struct.field("content")).list.first()
    odd = m.filter(
        pl.col("role").is_null() | pl.col("parts").is_null()
        | ((pl.col("role") == "assistant") & (pl.col("_nc") == 0) & (pl.col("_nt") == 1)
           & first_text.fill_null("").str.starts_with("{'") & first_text.fill_null("").str.contains("'tool_calls': ", literal=True))
        | ((pl.col("role") == "tool") & (pl.col("_nr") > 0) & (pl.col("_nt") > 0))
    ).select("row", pl.lit("GenAI messages Python reads its own way").alias("_why")).unique("row")
    why = pl.concat([why, odd]).unique("row", keep="first")
    m = m.filter(~pl.col("row").is_in(why["row"].implode()))
    side = (pl.col("key") == "gen_ai.output.messages").cast(pl.Int8).alias("side")
    m = m.with_columns(side)
    parts = (m.select("row", "side", "g", pl.col("parts"), pl.int_ranges(pl.col("parts").list.len()).alias("j"))
             .explode("parts", "j").filter(pl.col("parts").is_not_null()).unnest("parts"))
    texts = parts.filter(pl.col("type").is_in(list(TEXT_PARTS))).sort("row", "side", "g", "j").group_by(
        ["row", "side", "g"], maintain_order=True).agg(pl.col("content").fill_null("").str.join("").alias("content"))
    calls = parts.filter(pl.col("type") == "tool_call").sort("row", "side", "g", "j").group_by(
        ["row", "side", "g"], maintain_order=True).agg(
        pl.struct("id", "name", pl.col("arguments").fill_null("{}")).alias("tool_calls"))
    resp = parts.filter(pl.col("type") == "tool_call_response").select(
        "row", "side", pl.col("g").alias("o1"), (pl.col("j") + 1).alias("o2"), pl.lit("tool").alias("role"),
        pl.coalesce("response", "result").alias("content"), pl.lit(None, pl.String).alias("name"),
        _EMPTY_CALLS.alias("tool_calls"), pl.col("id").alias("tool_call_id"))
    # the message at its first text or tool call, among its tool results (`from_genai_message`)
    place = parts.filter(pl.col("type").is_in([*TEXT_PARTS, "tool_call"])).group_by(["row", "side", "g"]).agg(
        (pl.col("j").min() + 1).cast(pl.Int64).alias("o2"))
    main = (m.select("row", "side", "g", "role", "name", "_nt", "_nc", "_nr")
            .join(texts, on=["row", "side", "g"], how="left").join(calls, on=["row", "side", "g"], how="left")
            .join(place, on=["row", "side", "g"], how="left")
            .filter((pl.col("_nt") > 0) | (pl.col("_nc") > 0) | (pl.col("_nr") == 0))
            .select("row", "side", pl.col("g").alias("o1"), pl.col("o2").fill_null(0), "role", "content", "name",
                    pl.col("tool_calls").fill_null(_EMPTY_CALLS), pl.lit(None, pl.String).alias("tool_call_id")))
    flat = pl.concat([main.cast(_FLAT), resp.cast(_FLAT)])
    # the system instructions, once: unless a system message already says the same
    sys_text = vals.select("row", "key", "value").filter(pl.col("key") == "gen_ai.system_instructions").select(
        "row", "value")
    sysm = sys_text.with_columns(_per_value(sys_text["value"], _system, pl.Struct(
        {"present": pl.Boolean, "content": pl.String, "error": pl.Boolean})).alias("s")).unnest("s")
    why = pl.concat([why, sysm.filter(pl.col("error")).select(
        "row", pl.lit("system instructions Python reads its own way").alias("_why"))]).unique("row", keep="first")
    sysm = sysm.filter(pl.col("present") & ~pl.col("error"))
    said = flat.filter((pl.col("side") == 0) & (pl.col("role").is_in(["system", "developer"]))).join(
        sysm.select("row", pl.col("content").alias("sc")), on="row").filter(
        pl.col("content").eq_missing(pl.col("sc"))).select("row").unique()
    add = sysm.filter(~pl.col("row").is_in(said["row"].implode()) & pl.col("row").is_in(rows["row"].implode())).select(
        "row", pl.lit(0, pl.Int8).alias("side"), pl.lit(-1, pl.Int64).alias("o1"), pl.lit(0, pl.Int64).alias("o2"),
        pl.lit("system").alias("role"), "content", pl.lit(None, pl.String).alias("name"), _EMPTY_CALLS.alias("tool_calls"),
        pl.lit(None, pl.String).alias("tool_call_id"))
    flat = pl.concat([flat, add.cast(_FLAT)]).filter(~pl.col("row").is_in(why["row"].implode()))
    first_fr = decoded.filter(pl.col("key") == "gen_ai.output.messages").select(
        "row", pl.col("doc").list.first().struct.field("finish_reason").alias("fr"))
    extra = rows.with_columns(pl.lit("otel_genai").alias("layout")).join(first_fr, on="row", how="left")
    extra = extra.with_columns(_per_value(extra["fr"], normalize_finish_reason, pl.String).alias("_call_finish")).drop("fr")
    return flat, extra, why


def _system(v: dict | None) -> dict:
    """`from_system_instructions` of one value: whether it gives a message, its text."""
    try:
        s = from_system_instructions(_python_value(v))
    except MessageError:
        return {"present": False, "content": None, "error": True}
    return {"present": s is not None, "content": s["content"] if s else None, "error": False}


def _decode(texts: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """`texts` (row, key, text) decoded as GenAI messages: (row, key, doc), and the
    rows whose text does not decode to that shape (bad JSON, another shape). Polars
    refuses a whole column for one bad value, so a failing batch is halved until the
    bad values are found."""
    good, bad = [], []

    def go(t: pl.DataFrame) -> None:
        try:
            good.append(t.with_columns(pl.col("text").str.json_decode(_MESSAGES).alias("doc")).drop("text"))
        except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError, pl.exceptions.SchemaError):
            if t.height == 1:
                bad.append(t.select("row"))
                return
            half = t.height // 2
            go(t.slice(0, half))
            go(t.slice(half))

    go(texts)
    empty_doc = pl.DataFrame(schema={"row": pl.UInt32, "key": pl.String, "doc": _MESSAGES})
    empty_bad = pl.DataFrame(schema={"row": pl.UInt32})
    return pl.concat(good) if good else empty_doc, pl.concat(bad) if bad else empty_bad


def _tools(vals: pl.DataFrame) -> pl.DataFrame:
    """(row, tools, _problems): `normalize_tools` of each layout's tool definitions, as
    the JSON text a record holds, read once per distinct set."""
    key = pl.col("key")
    genai = vals.select("row", "key", "text").filter(key == "gen_ai.tool.definitions").select(
        "row", (pl.lit("g:") + pl.col("text")).alias("tk"))
    idx = vals.select("row", "head", "g", "rest", "text").filter(pl.col("head").is_in(["llm.tools", "llm.request.functions"])).select(
        "row", "head", pl.col("g").alias("i"), "rest", "text")
    out = pl.DataFrame(schema={"row": pl.UInt32})
    for suffix, part in (("g", genai),
                         ("o", _items(idx.filter(pl.col("head") == "llm.tools"))),
                         ("l", _items(idx.filter(pl.col("head") == "llm.request.functions")))):
        if part.height == 0:
            continue
        got = part.with_columns(_per_value(part["tk"], _tools_of, pl.Struct(
            {"tools": pl.String, "problems": pl.List(pl.String)})).alias("t")).unnest("t")
        out = out.join(got.select("row", pl.col("tools").alias("tools_" + suffix),
                                  pl.col("problems").alias("problems_" + suffix)), on="row", how="full", coalesce=True)
    for suffix in "gol":
        if "tools_" + suffix not in out.columns:
            out = out.with_columns(pl.lit(None, pl.String).alias("tools_" + suffix),
                                   pl.lit(None, pl.List(pl.String)).alias("problems_" + suffix))
    return out


def _items(idx: pl.DataFrame) -> pl.DataFrame:
    """(row, tk): one row's indexed tool attributes as one text, the key `_tools_of` reads."""
    return idx.sort("row", "head", "i", "rest").group_by("row", maintain_order=True).agg(
        (pl.lit("i:") + pl.struct("head", "i", "rest", "text").struct.json_encode().str.join("\n")).alias("tk"))


def _tools_of(tk: str) -> dict:
    """The tools JSON and the flags of one row's definitions (`_tools`' key, read back)."""
    call = Call("x")
    kind, tk = tk[:2], tk[2:]
    if kind == "g:":  # GenAI: one attribute
        text = tk
        try:
            doc = json.loads(text)
            call.tools = doc if isinstance(doc, list) else [doc]
        except json.JSONDecodeError as e:
            call.problems.append(f"tool definitions: {e}")
    else:
        groups: dict[tuple[str, int], dict[str, Any]] = {}
        for line in tk.split("\n"):
            item = json.loads(line)
            groups.setdefault((item["head"], item["i"]), {})[item["rest"]] = item["text"]
        for (head, _), d in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            if head == "llm.tools":
                schema = d.get("tool.json_schema")
                try:
                    call.tools.append(json.loads(schema) if isinstance(schema, str) else schema)
                except json.JSONDecodeError as e:
                    call.problems.append(f"tool schema: {e}")
            else:
                params = d.get("parameters")
                try:
                    params = json.loads(params) if isinstance(params, str) else params
                except json.JSONDecodeError:
                    call.problems.append(f"function {d.get('name')!r}: parameters are not JSON")
                call.tools.append({"type": "function", "name": d.get("name"), "description": d.get("description"),
                                   "parameters": params})
    tools = C.normalize_tools(call.tools)
    return {"tools": json.dumps(tools, ensure_ascii=False, separators=(",", ":")) if tools else None,
            "problems": ["invalid_content:" + p.split(":", 1)[0] for p in call.problems]}


# --- back to Python --------------------------------------------------------------------

RECORD_FIELDS = ("trace_id", "span_id", "start_ns", "end_ns", "service_name", "scope", "model", "request_model",
                 "response_model", "provider", "policy_version", "temperature", "input_messages", "output_message",
                 "tools", "finish_reason", "completion_logprobs", "input_tokens", "output_tokens", "response_id",
                 "convention", "truncated", "flags", "prompt_name", "prompt_version", "input_is_delta")


_SCALARS = tuple(f for f in RECORD_FIELDS if f not in ("input_messages", "output_message"))


def _to_records(frame: pl.DataFrame, flat: pl.DataFrame) -> list[dict]:
    """The records as `read_record` returns them, a column at a time to Python: the
    messages from their flat columns (nested columns convert several times slower),
    tool calls only where there are some. The cyclic garbage collector is held off
    meanwhile: these objects hold no cycles, and its passes over every object the
    bucket holds, each few hundred new containers, cost more than making them."""
    was = gc.isenabled()
    gc.disable()
    try:
        return _python_records(frame, flat)
    finally:
        if was:
            gc.enable()


def _python_records(frame: pl.DataFrame, flat: pl.DataFrame) -> list[dict]:
    frame = frame.rename({"scope_name": "scope"})
    cols = [frame[c].to_list() for c in _SCALARS]
    out: dict[int, dict] = {}
    for i, values in zip(frame["row"].to_list(), zip(*cols)):
        rec = dict(zip(_SCALARS, values))
        rec["input_messages"], rec["output_message"], rec["_call"] = [], None, i
        out[i] = rec
    n_calls = flat["tool_calls"].list.len()
    calls: list = [[] for _ in range(flat.height)]
    has = (n_calls > 0).arg_true()
    if has.len():
        for j, c in zip(has.to_list(), flat["tool_calls"].gather(has).to_list()):
            calls[j] = c
    for r, side, role, content, name, tcs, tcid in zip(flat["row"].to_list(), flat["side"].to_list(),
                                                       flat["role"].to_list(), flat["content"].to_list(),
                                                       flat["name"].to_list(), calls, flat["tool_call_id"].to_list()):
        m = {"role": role, "content": content, "name": name, "tool_calls": tcs, "tool_call_id": tcid}
        rec = out[r]
        if side == 0:
            rec["input_messages"].append(m)
        else:
            rec["output_message"] = m
    return [out[k] for k in frame["row"].to_list()]
