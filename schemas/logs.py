"""The `logs` dataset: one row per OTLP log record.

GenAI message content often arrives as log events (`gen_ai.user.message`,
`gen_ai.choice`, `gen_ai.client.inference.operation.details`), joined to their
span by `trace_id` and `span_id`. Log records have no id of their own, so
`record_id` is a hash of the record's content: a resent record keeps its id and
is stored once.
"""

from __future__ import annotations

import pyarrow as pa

from .common import ANY_VALUE, ATTRIBUTES, SCHEMA_VERSION, TIMESTAMP, with_metadata

NAME = "logs"
#: The versions of this dataset a reader of this Nightshift reads (`layout.check`).
READABLE = (SCHEMA_VERSION,)
#: Columns each version added, by version: a file of an older version lacks them.
ADDED: dict[str, tuple[str, ...]] = {}

SCHEMA = with_metadata(
    pa.schema(
        [
            pa.field("record_id", pa.string(), nullable=False),  # 32 hex, content hash
            pa.field("time", TIMESTAMP),  # null when the producer left it 0
            pa.field("observed_time", TIMESTAMP),
            pa.field("severity_number", pa.int32()),
            pa.field("severity_text", pa.string()),
            pa.field("event_name", pa.string()),
            pa.field("body", ANY_VALUE),
            pa.field("attributes", ATTRIBUTES),
            pa.field("dropped_attributes_count", pa.uint32()),
            pa.field("flags", pa.uint32()),
            pa.field("trace_id", pa.string()),  # null when not correlated
            pa.field("span_id", pa.string()),
            pa.field("service_name", pa.string()),
            pa.field("resource_attributes", ATTRIBUTES),
            pa.field("resource_dropped_attributes_count", pa.uint32()),
            pa.field("resource_schema_url", pa.string()),
            pa.field("scope_name", pa.string()),
            pa.field("scope_version", pa.string()),
            pa.field("scope_attributes", ATTRIBUTES),
            pa.field("scope_dropped_attributes_count", pa.uint32()),
            pa.field("scope_schema_url", pa.string()),
            pa.field("received_time", TIMESTAMP),
        ]
    ),
    NAME,
)

KEY = ("record_id",)

#: What each reader cannot do without (`layout.check` names any a file lacks).
READERS: dict[str, tuple[str, ...]] = {
    "nightshift build": ("record_id", "time", "observed_time", "event_name", "body", "attributes", "trace_id",
                         "span_id"),
}
