"""The `feedback` dataset: rewards that arrive after the trajectory, one row per label.

Written by the collector's `POST /v1/feedback` (made durable in the WAL exactly
like spans) and by `nightshift feedback FILE`, under
`<data>/feedback/date=YYYY-MM-DD/` (UTC date of arrival). `nightshift build`
joins it to trajectories by `trace_id`, or by `conversation_id` for labels given
to a whole conversation; `span_id`, when set, gives the reward to that one call.
"""

from __future__ import annotations

import pyarrow as pa

from .common import SCHEMA_VERSION, TIMESTAMP, with_metadata

NAME = "feedback"
#: The versions of this dataset a reader of this Nightshift reads (`layout.check`).
READABLE = (SCHEMA_VERSION,)
#: Columns each version added, by version: a file of an older version lacks them.
ADDED: dict[str, tuple[str, ...]] = {}

SCHEMA = with_metadata(
    pa.schema(
        [
            pa.field("feedback_id", pa.string(), nullable=False),  # the client's `id`, else a content hash
            pa.field("trace_id", pa.string()),  # 32 lowercase hex; this or conversation_id is set
            pa.field("conversation_id", pa.string()),
            pa.field("span_id", pa.string()),  # 16 lowercase hex: the call the label is about
            pa.field("name", pa.string(), nullable=False),  # e.g. "user_rating", "task_success"
            pa.field("value", pa.float64(), nullable=False),  # finite; booleans as 1.0 / 0.0
            pa.field("comment", pa.string()),
            pa.field("time", TIMESTAMP),  # when the label was given, if the client said
            pa.field("source", pa.string()),  # "http", or "file:<name>" for `nightshift feedback`
            pa.field("received_time", TIMESTAMP, nullable=False),
        ]
    ),
    NAME,
)

KEY = ("feedback_id",)

#: What each reader cannot do without (`layout.check` names any a file lacks).
READERS: dict[str, tuple[str, ...]] = {
    "nightshift build": ("feedback_id", "trace_id", "conversation_id", "span_id", "name", "value", "received_time"),
    "nightshift prompts": ("trace_id", "conversation_id", "name", "value", "comment"),
}
