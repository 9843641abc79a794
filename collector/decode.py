"""From request bytes to an OTLP message: decompression with a size cap, then
protobuf or OTLP/JSON by content type.

The size limit is applied after decompression and while decompressing, so a
small gzip bomb costs at most `limit` bytes of memory before it is refused.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import zstandard
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from . import otlp_json
from .errors import BadRequest, TooLarge, UnsupportedMediaType

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

REQUEST_TYPES: dict[str, type[Message]] = {
    "traces": ExportTraceServiceRequest,
    "logs": ExportLogsServiceRequest,
    "metrics": ExportMetricsServiceRequest,
}

_CHUNK = 1 << 20


def media_type(content_type: str | None) -> str:
    """`application/json; charset=utf-8` -> `application/json`; refuses the rest."""
    mt = (content_type or "").split(";", 1)[0].strip().lower()
    if mt in (PROTOBUF, JSON):
        return mt
    raise UnsupportedMediaType(
        f"unsupported Content-Type {content_type!r}: send {PROTOBUF} or {JSON}"
    )


def _inflate(make, body: bytes, limit: int, name: str) -> bytes:
    """zlib/gzip with bounded output; concatenated gzip members are all read."""
    out = bytearray()
    data = body
    try:
        while True:
            d = make()
            while True:
                chunk = d.decompress(data, _CHUNK)
                out += chunk
                if len(out) > limit:
                    raise TooLarge(f"request is over the {limit}-byte limit once decompressed ({name})")
                data = d.unconsumed_tail
                if not data and (not chunk or d.eof):
                    break
            if not d.eof:
                raise BadRequest(f"truncated {name} body")
            data = d.unused_data
            if not data.strip(b"\0"):  # trailing padding, or nothing: done
                break
    except zlib.error as e:
        raise BadRequest(f"invalid {name} body: {e}") from None
    return bytes(out)


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity", "none"):
        out = body
    elif enc in ("gzip", "x-gzip"):
        out = _inflate(lambda: zlib.decompressobj(wbits=31), body, limit, "gzip")
    elif enc == "deflate":
        # RFC 9110's deflate is zlib-wrapped; some clients send raw deflate.
        wbits = 15 if body[:1] and (body[0] & 0x0F) == 8 and int.from_bytes(body[:2], "big") % 31 == 0 else -15
        out = _inflate(lambda: zlib.decompressobj(wbits=wbits), body, limit, "deflate")
    elif enc == "zstd":
        out = _unzstd(body, limit)
    else:
        raise UnsupportedMediaType(f"unsupported Content-Encoding {encoding!r}: use gzip, deflate, zstd or none")
    if len(out) > limit:
        raise TooLarge(f"request is {len(out)} bytes, over the {limit}-byte limit")
    return out


def _unzstd(body: bytes, limit: int) -> bytes:
    """Bounded: output is read in chunks and refused past `limit`, so a tiny frame
    of a huge run of zeros costs at most `limit` bytes. Every frame is read, and a
    body that ends inside a frame is refused."""
    if not body:  # as with gzip and deflate: an empty body is not a compressed stream
        raise BadRequest("truncated zstd body (empty)")
    out = bytearray()
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body, read_across_frames=True)
        while True:
            chunk = reader.read(_CHUNK)
            if not chunk:
                break
            out += chunk
            if len(out) > limit:
                raise TooLarge(f"request is over the {limit}-byte limit once decompressed (zstd)")
        # Output is now known to be within the limit: check that every frame ended.
        data = body
        while data:
            d = zstandard.ZstdDecompressor().decompressobj()
            d.decompress(data)
            if not d.eof:
                raise BadRequest("truncated zstd body")
            data = d.unused_data
    except zstandard.ZstdError as e:
        raise BadRequest(f"invalid zstd body: {e}") from None
    return bytes(out)


@dataclass
class Parsed:
    message: Message
    rejected: int = 0  # records the JSON decoder already refused
    error: str = ""
    raw: bytes | None = None  # the protobuf bytes, when the body was protobuf


def parse(signal: str, body: bytes, media: str) -> Parsed:
    if media == PROTOBUF:
        msg = REQUEST_TYPES[signal]()
        try:
            msg.ParseFromString(body)
        except (DecodeError, RecursionError) as e:
            raise BadRequest(f"body is not a valid protobuf {msg.DESCRIPTOR.name}: {e}") from None
        return Parsed(msg, raw=body)
    try:
        d = otlp_json.DECODERS[signal](body)
    except otlp_json.JsonDecodeError as e:
        raise BadRequest(str(e)) from None
    return Parsed(d.message, d.rejected, d.error)
