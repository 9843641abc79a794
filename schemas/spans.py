"""The `spans` dataset: one row per OTLP span, every field kept.

Written by the collector under `<data>/spans/date=YYYY-MM-DD/` (UTC date of the
span's start; of its arrival when the start is zero). The `date` column comes
from the hive partition, not the files.
"""

from __future__ import annotations

import pyarrow as pa

from .common import ATTRIBUTES, SCHEMA_VERSION, TIMESTAMP, with_metadata

NAME = "spans"
#: The versions of this dataset a reader of this Nightshift reads (`layout.check`).
READABLE = (SCHEMA_VERSION,)
#: Columns each version added, by version: a file of an older version lacks them.
ADDED: dict[str, tuple[str, ...]] = {}

#: Span kinds by their OTLP enum value.
KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
#: Status codes by their OTLP enum value.
STATUS_CODES = ("unset", "ok", "error")

#: GenAI attributes promoted to their own columns because people filter on them.
#: column -> attribute keys, first present wins (old and new convention names).
PROMOTED = {
    "gen_ai_operation_name": ("gen_ai.operation.name",),
    "gen_ai_provider_name": ("gen_ai.provider.name", "gen_ai.system"),
    "gen_ai_request_model": ("gen_ai.request.model",),
    "gen_ai_response_model": ("gen_ai.response.model",),
    "gen_ai_agent_name": ("gen_ai.agent.name",),
    "gen_ai_conversation_id": ("gen_ai.conversation.id",),
}

EVENT = pa.struct(
    [
        pa.field("time", TIMESTAMP),
        pa.field("name", pa.string()),
        pa.field("attributes", ATTRIBUTES),
        pa.field("dropped_attributes_count", pa.uint32()),
    ]
)

LINK = pa.struct(
    [
        pa.field("trace_id", pa.string()),
        pa.field("span_id", pa.string()),
        pa.field("trace_state", pa.string()),
        pa.field("flags", pa.uint32()),
        pa.field("attributes", ATTRIBUTES),
        pa.field("dropped_attributes_count", pa.uint32()),
    ]
)

SCHEMA = with_metadata(
    pa.schema(
        [
            pa.field("trace_id", pa.string(), nullable=False),  # 32 lowercase hex
            pa.field("span_id", pa.string(), nullable=False),  # 16 lowercase hex
            pa.field("parent_span_id", pa.string()),  # null for a root span
            pa.field("trace_state", pa.string()),
            pa.field("flags", pa.uint32()),
            pa.field("name", pa.string()),
            pa.field("kind", pa.string()),  # one of KINDS
            pa.field("start_time", TIMESTAMP),
            pa.field("end_time", TIMESTAMP),
            pa.field("status_code", pa.string()),  # one of STATUS_CODES
            pa.field("status_message", pa.string()),
            pa.field("service_name", pa.string()),  # resource `service.name`
            *[pa.field(col, pa.string()) for col in PROMOTED],
            pa.field("attributes", ATTRIBUTES),
            pa.field("dropped_attributes_count", pa.uint32()),
            pa.field("events", pa.list_(EVENT)),
            pa.field("dropped_events_count", pa.uint32()),
            pa.field("links", pa.list_(LINK)),
            pa.field("dropped_links_count", pa.uint32()),
            pa.field("resource_attributes", ATTRIBUTES),
            pa.field("resource_dropped_attributes_count", pa.uint32()),
            pa.field("resource_schema_url", pa.string()),
            pa.field("scope_name", pa.string()),
            pa.field("scope_version", pa.string()),
            pa.field("scope_attributes", ATTRIBUTES),
            pa.field("scope_dropped_attributes_count", pa.uint32()),
            pa.field("scope_schema_url", pa.string()),
            pa.field("received_time", TIMESTAMP),  # when the collector acknowledged it
        ]
    ),
    NAME,
)

KEY = ("trace_id", "span_id")

#: What each reader cannot do without (`layout.check` names any a file lacks). The
#: build's columns were found by dropping each from a real file: any of these gone
#: and it stopped on a Polars ColumnNotFoundError.
READERS: dict[str, tuple[str, ...]] = {
    "nightshift build": ("trace_id", "span_id", "parent_span_id", "name", "start_time", "end_time", "received_time",
                         "service_name", "gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_agent_name",
                         "gen_ai_conversation_id", "scope_name", "attributes", "dropped_attributes_count"),
    "nightshift prompts": ("trace_id", "span_id", "name", "status_code", "status_message", "gen_ai_operation_name",
                           "gen_ai_conversation_id", "attributes"),
}
#: Read besides when a file has them (the build goes without: no events, no links, no schema URL).
OPTIONAL: dict[str, tuple[str, ...]] = {
    "nightshift build": ("events", "links", "scope_schema_url", "resource_schema_url"),
}
