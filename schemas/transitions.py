"""The `transitions` dataset: one row per LLM call, a single-step RL sample.

State: the input messages and the tools offered; action: the output message and
its tool calls; reward: the trajectory's outcome, credit-assigned to this call.
Written by `nightshift build` under `<data>/transitions/date=YYYY-MM-DD/`. Column
names are a public contract: change them only with a new VERSION.

Versions: 1, the first; 2 adds `prompt_name` and `prompt_version` (nullable, at the
end); 3 adds `prompt_seen` (nullable, at the end); 4 adds `system_id` and `tools_id`
(nullable, at the end: `schemas.prompt_ids`). Files of an older version lack the
later columns: readers take them as null (Polars `scan_parquet(...,
missing_columns="insert")`, a pyarrow dataset, `nightshift train`).
"""

from __future__ import annotations

import pyarrow as pa

from .common import METADATA_VERSION, TIMESTAMP, with_metadata

NAME = "transitions"
#: This dataset's own version, in every file's metadata and every row's `schema_version`
#: (the other datasets are at `common.SCHEMA_VERSION`).
VERSION = "4"
#: The versions a reader of this Nightshift reads (`layout.check`): 1 too, its
#: missing columns taken as null.
READABLE = ("1", "2", "3", "4")
#: Columns each version added, by version: a file of an older version lacks them.
ADDED: dict[str, tuple[str, ...]] = {"2": ("prompt_name", "prompt_version"), "3": ("prompt_seen",),
                                     "4": ("system_id", "tools_id")}

TOOL_CALL = pa.struct(
    [
        pa.field("id", pa.string()),
        pa.field("name", pa.string()),
        pa.field("arguments", pa.string()),  # JSON text, as the model produced it
    ]
)

MESSAGE = pa.struct(
    [
        pa.field("role", pa.string()),  # system | user | assistant | tool | ...
        pa.field("content", pa.string()),  # text; null when the turn is only tool calls
        pa.field("name", pa.string()),
        pa.field("tool_calls", pa.list_(TOOL_CALL)),
        pa.field("tool_call_id", pa.string()),  # on role=tool: which call this answers
    ]
)

SCHEMA = with_metadata(
    pa.schema(
        [
            pa.field("transition_id", pa.string(), nullable=False),  # deterministic: hash of trace and span id
            pa.field("trace_id", pa.string(), nullable=False),
            pa.field("span_id", pa.string(), nullable=False),
            pa.field("trajectory_id", pa.string(), nullable=False),
            pa.field("group_id", pa.string()),
            pa.field("step", pa.int32()),  # 0-based position in the trajectory
            pa.field("num_steps", pa.int32()),
            pa.field("agent_name", pa.string()),
            pa.field("service_name", pa.string()),
            pa.field("model", pa.string()),
            pa.field("provider", pa.string()),
            pa.field("input_messages", pa.list_(MESSAGE)),
            pa.field("output_message", MESSAGE),
            pa.field("tools", pa.string()),  # JSON array of tool definitions
            pa.field("finish_reason", pa.string()),  # normalized: stop, length, tool_call, content_filter, error
            pa.field("prompt_token_ids", pa.list_(pa.int32())),
            pa.field("completion_token_ids", pa.list_(pa.int32())),
            pa.field("completion_logprobs", pa.list_(pa.float32())),
            pa.field("input_tokens", pa.int64()),
            pa.field("output_tokens", pa.int64()),
            pa.field("reward", pa.float64()),
            pa.field("reward_source", pa.string()),
            pa.field("return", pa.float64()),
            pa.field("advantage", pa.float64()),
            pa.field("start_time", TIMESTAMP),
            pa.field("end_time", TIMESTAMP),
            pa.field("convention", pa.string()),  # which instrumentation layout the row was read from
            pa.field("truncated", pa.bool_()),  # the span says attributes were dropped
            pa.field("weight", pa.float64()),  # 1/calls of its trajectory (or 1): each trajectory counts once
            pa.field("flags", pa.list_(pa.string())),  # why the row is suspect: content_missing, clock_skew, ...
            # which published version produced the call (`v0003`, from the `name@v0003` the
            # server answered with); null: the base model or a model never published
            pa.field("policy_version", pa.string()),
            pa.field("temperature", pa.float64()),  # the request's sampling temperature, when recorded
            # `model` is the name the server answered with where recorded, else the request's;
            # these two keep both: what the agent asked for (filter on this) and the dated answer
            pa.field("request_model", pa.string()),
            pa.field("response_model", pa.string()),
            pa.field("schema_version", pa.string()),
            # version 2: the GenAI convention's named prompt template (`gen_ai.prompt.name`,
            # `gen_ai.prompt.version`) the call was made from, when the agent used one
            pa.field("prompt_name", pa.string()),
            pa.field("prompt_version", pa.string()),
            # version 3: the id of the prompt version the model saw (schemas.prompt_identity), when
            # it is not the one in input_messages: `nightshift route` put a candidate in and marked
            # the answer's model `+p:<id>` (the mark is taken off `model` and `response_model`)
            pa.field("prompt_seen", pa.string()),
            # version 4: the ids of the prompt the call sent (schemas.prompt_ids): its leading system
            # texts' (`prompt_identity.system_id`, what the route matches on) and its tools'; null
            # for a call recorded without its messages
            pa.field("system_id", pa.string()),
            pa.field("tools_id", pa.string()),
        ]
    ),
    NAME,
)
SCHEMA = SCHEMA.with_metadata({**SCHEMA.metadata, METADATA_VERSION: VERSION.encode()})

KEY = ("transition_id",)

#: What each reader cannot do without (`layout.check` names any a file lacks); what
#: they read besides, when present, they fill (the trainer: `trainer.select.OPTIONAL`).
READERS: dict[str, tuple[str, ...]] = {
    "nightshift train": ("transition_id", "trajectory_id", "input_messages", "output_message", "reward"),
    "nightshift versions": ("trajectory_id", "step", "agent_name", "policy_version", "reward", "start_time",
                            "response_model", "model"),
    "the nightly report": ("reward",),
    "nightshift prompts": ("transition_id", "trajectory_id", "trace_id", "span_id", "step", "agent_name",
                           "service_name", "input_messages", "output_message", "tools", "flags", "finish_reason",
                           "response_model", "model", "reward", "start_time"),
    # without them a row is no example (a missing output_message read as "content capture was off")
    "nightshift export": ("input_messages", "output_message"),
    # an incremental build reads back the partitions it keeps, to pool their advantages
    "nightshift build": ("transition_id", "trajectory_id", "group_id", "return", "weight", "advantage"),
}
