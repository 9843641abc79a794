"""`nightshift ingest`: what an OpenTelemetry Collector's `fileexporter` wrote.

Formats: OTLP/JSON, one `TracesData`/`LogsData` object per line (the default), and
4-byte big-endian length-prefixed protobuf (`format: proto`, or any format with
`compression: zstd`, whose frames are zstd-compressed). Rotated backups
(`name-<timestamp>.ext`) beside a named file are read too, oldest first. A
half-written last line or frame (the exporter was still writing) is skipped with a
warning. Records are validated and redacted exactly as on the network path and
land in the same datasets with the same deduplication: ingesting a file twice
changes nothing, and the second run counts its records as already stored (each
run writes under a batch id of its own, the hash of the file's bytes and a random
suffix, so the duplicate check sees the first run's file instead of skipping it
as the batch being rewritten).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Iterator

import zstandard
from google.protobuf.message import DecodeError
from opentelemetry.proto.logs.v1.logs_pb2 import LogsData
from opentelemetry.proto.trace.v1.trace_pb2 import TracesData
from tqdm import tqdm

from nightshift.schemas.layout import LOGS, SPANS

from . import otlp_json, validate
from .convert import LogBuilder, SpanBuilder
from .datasets import DatasetStore
from .redact import Redactor

log = logging.getLogger("nightshift.collector.ingest")

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CHUNK_RECORDS = 20_000
CHUNK_BYTES = 8 << 20  # spans are gathered as serialized requests, converted a chunk at a time


@dataclass
class IngestStats:
    files: int = 0
    spans: int = 0
    logs: int = 0
    duplicates: int = 0
    rejected: int = 0
    skipped_metrics: int = 0
    bad_records: int = 0
    notes: list[str] = field(default_factory=list)


def expand(paths: list[str]) -> list[str]:
    """Files to read, rotated backups first (oldest first), each once."""
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(f for f in glob.glob(os.path.join(p, "*")) if os.path.isfile(f))
        else:
            matches = sorted(glob.glob(p)) or [p]
            found = []
            for m in matches:
                stem, ext = os.path.splitext(m)
                found += sorted(f for f in glob.glob(glob.escape(stem) + "-*" + ext) if f != m)
                found.append(m)
        for f in found:
            if f not in out:
                out.append(f)
    return out


def _messages(data: bytes, name: str, stats: IngestStats) -> Iterator[tuple[str, object]]:
    """('traces'|'logs'|'metrics', message) for each record in a file."""
    if data.lstrip()[:1] in (b"{", b""):
        lines = data.split(b"\n")
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            last = i == len(lines) - 1 or all(not x.strip() for x in lines[i + 1 :])
            head = line.lstrip()[:40]
            try:
                if b"resourceMetrics" in head or b"resource_metrics" in head:
                    stats.skipped_metrics += 1
                    continue
                if b"resourceLogs" in line[:200] or b"resource_logs" in line[:200]:
                    d = otlp_json.decode_logs(line)
                    yield "logs", d
                else:
                    d = otlp_json.decode_traces(line)
                    yield "traces", d
            except otlp_json.JsonDecodeError as e:
                if last and not data.endswith(b"\n"):
                    stats.notes.append(f"{name}: last line is incomplete (still being written?); skipped")
                else:
                    stats.bad_records += 1
                    stats.notes.append(f"{name}: line {i + 1}: {e}")
        return
    pos = 0
    dctx = zstandard.ZstdDecompressor()
    while pos + 4 <= len(data):
        n = int.from_bytes(data[pos : pos + 4], "big")
        frame = data[pos + 4 : pos + 4 + n]
        if len(frame) < n:
            stats.notes.append(f"{name}: last frame is incomplete (still being written?); skipped")
            return
        pos += 4 + n
        try:
            if frame.startswith(ZSTD_MAGIC):
                frame = dctx.decompress(frame, max_output_size=256 << 20)
            if frame.lstrip()[:1] == b"{":  # json + zstd
                yield from _messages(frame + b"\n", name, stats)
                continue
            kind, msg = _sniff_proto(frame)
            yield kind, otlp_json.Decoded(msg)
        except (DecodeError, zstandard.ZstdError) as e:
            stats.bad_records += 1
            stats.notes.append(f"{name}: frame at byte {pos - 4 - n}: {e}")
    if pos < len(data):
        stats.notes.append(f"{name}: trailing {len(data) - pos} bytes (incomplete frame header); skipped")


def _sniff_proto(frame: bytes) -> tuple[str, object]:
    """TracesData and LogsData share field numbers; a span's first field is its
    16-byte trace id, a log record's a fixed64 time, so spans parsed from logs
    come out without ids."""
    try:
        traces = TracesData.FromString(frame)
        spans = [s for rs in traces.resource_spans for ss in rs.scope_spans for s in ss.spans]
        if spans and all(len(s.trace_id) == 16 for s in spans):
            return "traces", traces
    except DecodeError:
        pass  # log records' fields do not always parse as spans
    return "logs", LogsData.FromString(frame)


def ingest(paths: list[str], store: DatasetStore, redactor: Redactor, progress: bool = True) -> IngestStats:
    stats = IngestStats()
    files = expand(paths)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"no such file: {', '.join(missing)}")
    total = sum(os.path.getsize(f) for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="ingest", disable=not progress)
    for path in files:
        with open(path, "rb") as fh:
            data = fh.read()
        batch = f"ingest-{hashlib.sha256(data).hexdigest()[:24]}-{uuid.uuid4().hex[:8]}"
        spans_w, logs_w = store.writer(SPANS, batch), store.writer(LOGS, batch)
        sb, lb = SpanBuilder(), LogBuilder()
        received = int(os.path.getmtime(path) * 1e9)
        try:
            for kind, dec in _messages(data, path, stats):
                msg = dec.message
                stats.rejected += dec.rejected
                if kind == "traces":
                    _, rej, _ = validate.filter_traces(msg)
                    stats.rejected += rej
                    redactor.redact("traces", msg, msg.SerializeToString())
                    sb.add_request(msg, received)
                elif kind == "logs":
                    _, rej, _ = validate.filter_logs(msg)
                    stats.rejected += rej
                    redactor.redact("logs", msg, msg.SerializeToString())
                    lb.add_request(msg, received)
                if sb.nbytes >= CHUNK_BYTES:
                    spans_w.add(sb.table(), sb.dates)
                    sb = SpanBuilder()
                if len(lb) >= CHUNK_RECORDS:
                    logs_w.add(lb.table(), lb.dates)
                    lb = LogBuilder()
            if len(sb):
                spans_w.add(sb.table(), sb.dates)
            if len(lb):
                logs_w.add(lb.table(), lb.dates)
            s, lg = spans_w.commit(), logs_w.commit()
        except BaseException:
            spans_w.abort()
            logs_w.abort()
            raise
        stats.files += 1
        stats.spans += s.rows
        stats.logs += lg.rows
        stats.duplicates += s.duplicates + lg.duplicates
        bar.update(len(data))
    bar.close()
    return stats
