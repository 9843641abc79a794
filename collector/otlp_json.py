"""OTLP/JSON, which is proto3 JSON with deviations (OTLP spec, "JSON Protobuf Encoding").

Ids are hex strings, not base64; enums are integers; 64-bit integers may be
strings; unknown fields are ignored. `json_format` alone gets the ids wrong, so
ids are converted here, and each span or log record is parsed on its own so that
one badly typed record is rejected alone (partial success), not its whole batch.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span

# A value that decodes to one byte: the validator then rejects the record for a
# wrong-length id, with a message, instead of the whole request failing here.
_BAD_ID = base64.b64encode(b"\x00").decode()


class JsonDecodeError(ValueError):
    """The body is not JSON, or not an OTLP/JSON request at all."""


@dataclass
class Decoded:
    message: Message
    #: Records dropped while decoding (badly typed), and why.
    rejected: int = 0
    error: str = ""


def _hex_to_b64(value: Any) -> Any:
    if not isinstance(value, str) or value == "":
        return value
    try:
        return base64.b64encode(binascii.unhexlify(value)).decode()
    except (binascii.Error, ValueError):
        return _BAD_ID


def _get(d: dict, camel: str, snake: str) -> Any:
    return d.get(camel, d.get(snake))


def _ids_to_b64(record: dict, keys: tuple[str, ...]) -> dict:
    out = dict(record)
    for k in keys:
        if k in out:
            out[k] = _hex_to_b64(out[k])
    return out


#: A JSON escape of a UTF-16 surrogate (`\ud800`): rare, and only then are keys checked.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _keys_without_surrogates(pairs: list[tuple[str, Any]]) -> dict:
    """A lone surrogate in a key makes protobuf's field lookup fail with a
    SystemError; such a key is no field name anyway, so it is made harmless (and
    then ignored as unknown, as OTLP/JSON ignores unknown fields)."""
    return {k.encode("utf-8", "replace").decode("utf-8"): v for k, v in pairs}


def _load(body: bytes | str) -> dict:
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    hook = _keys_without_surrogates if _SURROGATE_ESCAPE.search(raw) else None
    try:
        doc = json.loads(body, object_pairs_hook=hook)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise JsonDecodeError(f"body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise JsonDecodeError("an OTLP/JSON request must be a JSON object")
    return doc


def _parse(d: Any, msg: Message) -> Message:
    if not isinstance(d, dict):
        raise json_format.ParseError(f"expected an object, got {type(d).__name__}")
    try:
        json_format.ParseDict(d, msg, ignore_unknown_fields=True, max_recursion_depth=64)
    except json_format.ParseError:
        raise
    except (OverflowError, ValueError, TypeError) as e:
        # json_format lets some bad values through as other errors: `"severityNumber":
        # Infinity` (Python's JSON reads the bare literal) is an OverflowError in int().
        raise json_format.ParseError(f"{type(e).__name__}: {e}") from None
    return msg


def _list(d: dict, camel: str, snake: str) -> list:
    v = _get(d, camel, snake)
    if v is None:
        return []
    if not isinstance(v, list):
        raise JsonDecodeError(f"`{camel}` must be an array")
    return v


def _decode_groups(doc: dict, *, top: tuple[str, str], scoped: tuple[str, str], items: tuple[str, str],
                   item_type: type[Message], id_keys: tuple[str, ...], out_groups: Any, what: str) -> tuple[int, str]:
    rejected, first_error = 0, ""
    for rg in _list(doc, *top):
        if not isinstance(rg, dict):
            raise JsonDecodeError(f"`{top[0]}` entries must be objects")
        group = out_groups.add()
        try:
            if "resource" in rg:
                _parse(rg["resource"], group.resource)
            group.schema_url = str(_get(rg, "schemaUrl", "schema_url") or "")
        except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
            n = sum(len(_list(s, *items)) for s in _list(rg, *scoped) if isinstance(s, dict))
            rejected += n
            first_error = first_error or f"invalid resource: {e}"
            del out_groups[-1]
            continue
        for sg in _list(rg, *scoped):
            if not isinstance(sg, dict):
                raise JsonDecodeError(f"`{scoped[0]}` entries must be objects")
            scope_group = getattr(group, scoped[1]).add()
            recs = _list(sg, *items)
            try:
                if "scope" in sg:
                    _parse(sg["scope"], scope_group.scope)
                scope_group.schema_url = str(_get(sg, "schemaUrl", "schema_url") or "")
            except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
                rejected += len(recs)
                first_error = first_error or f"invalid scope: {e}"
                continue
            container = getattr(scope_group, items[1])
            for rec in recs:
                try:
                    if not isinstance(rec, dict):
                        raise json_format.ParseError(f"{what} must be an object")
                    rec = _ids_to_b64(rec, id_keys + tuple(_snake(k) for k in id_keys))
                    if item_type is Span:
                        links = _get(rec, "links", "links")
                        if isinstance(links, list):
                            rec["links"] = [
                                _ids_to_b64(l, ("traceId", "spanId", "trace_id", "span_id")) if isinstance(l, dict) else l
                                for l in links
                            ]
                    parsed = _parse(rec, item_type())
                except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
                    rejected += 1
                    first_error = first_error or f"invalid {what}: {e}"
                    continue
                container.append(parsed)
    return rejected, first_error


def _snake(camel: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in camel)


def decode_traces(body: bytes | str) -> Decoded:
    doc = _load(body)
    req = ExportTraceServiceRequest()
    rejected, err = _decode_groups(
        doc, top=("resourceSpans", "resource_spans"), scoped=("scopeSpans", "scope_spans"),
        items=("spans", "spans"), item_type=Span, id_keys=("traceId", "spanId", "parentSpanId"),
        out_groups=req.resource_spans, what="span",
    )
    return Decoded(req, rejected, err)


def decode_logs(body: bytes | str) -> Decoded:
    doc = _load(body)
    req = ExportLogsServiceRequest()
    rejected, err = _decode_groups(
        doc, top=("resourceLogs", "resource_logs"), scoped=("scopeLogs", "scope_logs"),
        items=("logRecords", "log_records"), item_type=LogRecord, id_keys=("traceId", "spanId"),
        out_groups=req.resource_logs, what="log record",
    )
    return Decoded(req, rejected, err)


def decode_metrics(body: bytes | str) -> Decoded:
    doc = _load(body)
    req = ExportMetricsServiceRequest()
    try:
        json_format.ParseDict(doc, req, ignore_unknown_fields=True, max_recursion_depth=64)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as e:
        raise JsonDecodeError(f"invalid OTLP/JSON metrics: {e}") from None
    return Decoded(req)


DECODERS = {"traces": decode_traces, "logs": decode_logs, "metrics": decode_metrics}

_ID_KEYS = {"traceId", "spanId", "parentSpanId"}


def _b64_ids_to_hex(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: (base64.b64decode(v).hex() if k in _ID_KEYS and isinstance(v, str) else _b64_ids_to_hex(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_b64_ids_to_hex(v) for v in node]
    return node


def encode(message: Message) -> bytes:
    """A message as OTLP/JSON (hex ids, integer enums, lowerCamelCase)."""
    d = json_format.MessageToDict(message, use_integers_for_enums=True)
    return json.dumps(_b64_ids_to_hex(d), separators=(",", ":")).encode()


__all__ = ["Decoded", "JsonDecodeError", "DECODERS", "decode_logs", "decode_metrics", "decode_traces", "encode"]
