"""`nightshift feedback FILE`: labels from CSV, Parquet or JSON lines, checked by
the same rules as `POST /v1/feedback` (`feedback.normalize`).

Every file is read and checked before anything is written, so a run either
stores what it reports or nothing: a missing or unknown column refuses the run
(`FeedbackFileError`), and so does any bad row unless `skip_bad` (`BadRows`, with
every bad row listed by its line or row number in the file). A file's batch id
is the sha256 of its bytes, so loading the same file twice adds nothing; ids
already stored anywhere in the dataset are not written again either.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import feedback as feedback_schema
from nightshift.schemas import layout

from .datasets import DatasetStore, part_name
from .feedback import DEFAULT_NAME, FIELDS, FieldError, normalize
from .feedback_table import write_feedback

PARQUET_MAGIC = b"PAR1"


class FeedbackFileError(ValueError):
    """A file that cannot be read as labels at all (missing or unknown columns,
    unreadable): the run writes nothing."""


class BadRows(ValueError):
    """Rows that break the rules, each listed as `file: line 3: value: why`."""

    def __init__(self, problems: list[str]):
        super().__init__(f"{len(problems)} bad row(s)")
        self.problems = problems


@dataclass
class LabelFile:
    path: str
    batch_id: str
    records: list[dict] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)


@dataclass
class LoadStats:
    files: int = 0
    written: int = 0
    duplicates: int = 0
    skipped: int = 0
    skipped_rows: list[str] = field(default_factory=list)


def _format(path: str, data: bytes) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".parquet", ".pq") or data.startswith(PARQUET_MAGIC):
        return "parquet"
    if ext in (".jsonl", ".ndjson", ".json") or data.lstrip()[:1] == b"{":
        return "jsonl"
    return "csv"


def _csv_cell(column: str, text: str):
    """CSV has only text: numbers and booleans are read back the way JSON would
    have carried them, so both paths share one set of rules. Anything else stays
    text, for `normalize` to refuse with the cell quoted."""
    if column == "value":
        if text.strip().lower() in ("true", "false"):
            return text.strip().lower() == "true"
    if column in ("value", "time"):
        try:
            return float(text)
        except ValueError:
            return text
    return text


def _csv_rows(data: bytes) -> tuple[list[str], Iterator[tuple[str, dict | str]]]:
    text = data.decode("utf-8-sig")  # Excel writes a BOM
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None) or []
    columns = [h.strip() for h in header]

    def rows() -> Iterator[tuple[str, dict | str]]:
        end = reader.line_num
        for cells in reader:
            start, end = end + 1, reader.line_num
            if not cells or all(not c.strip() for c in cells):
                continue
            where = f"line {start}"
            if len(cells) > len(columns):
                yield where, f"{len(cells)} fields, the header has {len(columns)}"
                continue
            # An empty cell is an absent field, as if the key were left out of a JSON object.
            yield where, {col: _csv_cell(col, cell) for col, cell in zip(columns, cells) if cell != ""}

    return columns, rows()


def _jsonl_rows(data: bytes) -> tuple[list[str], Iterator[tuple[str, dict | str]]]:
    parsed: list[tuple[str, dict | str]] = []
    columns: list[str] = []
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        where = f"line {i + 1}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            parsed.append((where, f"not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict):
            parsed.append((where, "not a JSON object (JSON lines: one object per line)"))
            continue
        columns += [k for k in obj if k not in columns]
        parsed.append((where, obj))
    return columns, iter(parsed)


def _parquet_rows(data: bytes) -> tuple[list[str], Iterator[tuple[str, dict | str]]]:
    table = pq.read_table(io.BytesIO(data))
    for i, f in enumerate(table.schema):
        if pa.types.is_timestamp(f.type):  # a zone-less timestamp is read as UTC
            col = table.column(i).cast(pa.timestamp("us", tz=f.type.tz or "UTC"))
            table = table.set_column(i, f.name, col)

    def rows() -> Iterator[tuple[str, dict | str]]:
        for n, row in enumerate(table.to_pylist()):
            if hasattr(row.get("time"), "isoformat"):
                row["time"] = row["time"].isoformat()
            yield f"row {n + 1}", row

    return table.column_names, rows()


READERS = {"csv": _csv_rows, "jsonl": _jsonl_rows, "parquet": _parquet_rows}


def _check_columns(name: str, columns: list[str]) -> None:
    problems = []
    missing = [c for c in ("value",) if c not in columns]
    if "trace_id" not in columns and "conversation_id" not in columns:
        missing.append("trace_id or conversation_id")
    if missing:
        problems.append(f"missing required column(s): {', '.join(missing)}")
    unknown = [c for c in columns if c not in FIELDS]
    if unknown:
        problems.append(f"unknown column(s): {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    if problems:
        found = ", ".join(columns) or "none"
        raise FeedbackFileError(f"{name}: {'; '.join(problems)}; columns found: {found}")


def read_labels(path: str, default_name: str = DEFAULT_NAME, redact: Callable[[str], str] | None = None) -> LabelFile:
    """One file's labels, each row normalized or listed as bad. Raises
    FeedbackFileError when the file as a whole cannot be used."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise FeedbackFileError(f"{path}: cannot read: {e.strerror}") from None
    digest = hashlib.sha256(data)
    if default_name != DEFAULT_NAME:  # the same rows under another --name are other labels
        digest.update(b"\0name=" + default_name.encode())
    out = LabelFile(path, digest.hexdigest())
    fmt = _format(path, data)
    try:
        columns, rows = READERS[fmt](data)
    except (UnicodeDecodeError, csv.Error, pa.ArrowException) as e:
        raise FeedbackFileError(f"{path}: not readable as {fmt}: {e}") from None
    _check_columns(path, columns)
    try:
        for where, row in rows:
            if isinstance(row, str):
                out.bad.append(f"{path}: {where}: {row}")
                continue
            try:
                out.records.append(normalize(row, default_name, redact))
            except FieldError as e:
                out.bad.append(f"{path}: {where}: {e}")
    except csv.Error as e:
        raise FeedbackFileError(f"{path}: not readable as csv: {e}") from None
    return out


def _stored(store: DatasetStore) -> tuple[set[str], set[str]]:
    """(feedback ids, part file names) already in the dataset, every partition:
    labels are few, and a label reloaded on another day must still count once."""
    ids: set[str] = set()
    names: set[str] = set()
    for p in store.fs.glob(f"{layout.partition_folder(store.root, feedback_schema.NAME, '*')}/*{layout.SUFFIX}"):
        names.add(os.path.basename(p))
        with store.fs.open(p, "rb") as f:
            ids.update(pq.ParquetFile(f).read(columns=["feedback_id"]).column(0).to_pylist())
    return ids, names


def load(paths: list[str], store: DatasetStore, default_name: str = DEFAULT_NAME, skip_bad: bool = False,
         redact: Callable[[str], str] | None = None) -> LoadStats:
    """Checks every file, then writes them: `source` is `file:<basename>`,
    `received_time` now. Raises FeedbackFileError or BadRows with nothing written."""
    files = [read_labels(p, default_name, redact) for p in paths]
    bad = [b for f in files for b in f.bad]
    if bad and not skip_bad:
        raise BadRows(bad)
    stats = LoadStats(skipped=len(bad), skipped_rows=bad)
    ids, names = _stored(store)
    received = time.time_ns()
    for f in files:
        stats.files += 1
        if part_name(f.batch_id) in names:  # this very file was loaded before
            stats.duplicates += len(f.records)
            continue
        fresh = [r for r in f.records if r["feedback_id"] not in ids]
        stats.duplicates += len(f.records) - len(fresh)
        if not fresh:
            continue
        w = write_feedback(store, f.batch_id, fresh, received, f"file:{os.path.basename(f.path)}")
        stats.written += w.rows
        stats.duplicates += w.duplicates
        ids.update(r["feedback_id"] for r in fresh)
        names.add(part_name(f.batch_id))
    return stats
