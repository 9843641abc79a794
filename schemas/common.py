"""Arrow types shared by every Nightshift dataset.

OTLP attributes are typed (`AnyValue`), and users query them from Polars, so an
attribute is a `{key, value}` struct whose value keeps its OTLP type in `type` and
its payload in the one matching column. Arrays and key-value lists are kept as
plain JSON in `json_value` (bytes inside them as base64, non-finite doubles as the
strings "NaN"/"Infinity"/"-Infinity", like proto3 JSON): easy to `str.json_decode`,
and nothing is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:  # imported by `attr` when called: the collector's flusher writes these schemas without Polars
    import polars as pl

#: Bumped on any change to a column's name, type or meaning. Written into every
#: Parquet file's metadata under `nightshift.schema_version`.
SCHEMA_VERSION = "1"

METADATA_NAME = b"nightshift.schema"
METADATA_VERSION = b"nightshift.schema_version"

TIMESTAMP = pa.timestamp("ns", tz="UTC")

#: The value types an attribute can have, as found in `value.type`.
VALUE_TYPES = ("string", "int", "double", "bool", "bytes", "array", "kvlist", "empty")

ANY_VALUE = pa.struct(
    [
        pa.field("type", pa.string()),
        pa.field("string_value", pa.string()),
        pa.field("int_value", pa.int64()),
        pa.field("double_value", pa.float64()),
        pa.field("bool_value", pa.bool_()),
        pa.field("bytes_value", pa.binary()),
        pa.field("json_value", pa.string()),
    ]
)

ATTRIBUTE = pa.struct([pa.field("key", pa.string()), pa.field("value", ANY_VALUE)])
ATTRIBUTES = pa.list_(ATTRIBUTE)


def with_metadata(schema: pa.Schema, name: str) -> pa.Schema:
    return schema.with_metadata({METADATA_NAME: name.encode(), METADATA_VERSION: SCHEMA_VERSION.encode()})


_VALUE_FIELD = {
    "string": "string_value",
    "int": "int_value",
    "double": "double_value",
    "bool": "bool_value",
    "bytes": "bytes_value",
    "array": "json_value",
    "kvlist": "json_value",
}


def attr(key: str, type: str = "string", column: str = "attributes") -> pl.Expr:
    """A Polars expression for one attribute's value, null where it is absent.

    `pl.scan_parquet(...).select(attr("gen_ai.usage.input_tokens", "int"))`.
    Arrays and kvlists come back as their JSON text.
    """
    import polars as pl

    field = _VALUE_FIELD[type]
    return (
        pl.col(column)
        .list.eval(
            pl.element().filter(pl.element().struct.field("key") == key).struct.field("value").struct.field(field)
        )
        .list.first()
        .alias(key)
    )
