"""Transitions in the chat formats trainers read, to Parquet or JSON lines.

The transitions dataset keeps each message as the wire had it, flat: a tool call is
`{id, name, arguments}` with the arguments as the model's JSON text. TRL, chat
templates and OpenAI's fine-tuning files want OpenAI's nested form, `{"id",
"type": "function", "function": {"name", "arguments"}}`; templates `tojson` the
arguments, so they want a mapping, while OpenAI's files want the text. Two shapes:

- `messages`: `{"messages": [...prompt, completion], "tools": [...]}`, what TRL's
  SFTTrainer and OpenAI's chat fine-tuning take;
- `prompt_completion`: `{"prompt": [...], "completion": [assistant], "tools"}`, TRL's
  conversational prompt-completion type (the loss on the completion only);

each with the row's ids, agent, model, reward, return, advantage and weight beside.

Messages are stored as JSON (Parquet: Arrow's canonical `arrow.json` type, which
Hugging Face `datasets` decodes to exactly the dicts written). As struct columns,
Arrow would give every tool call the union of every call's argument keys, null
filled, and a chat template would render `"unit": null` into arguments the model
never wrote. The messages are the ones `trainer/render.py` renders (a test holds
the two to the same output).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import layout
from nightshift.storage import fsync

from .export_formats import ARGUMENTS, FORMATS

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
#: The row's columns kept beside the messages, for filtering and weighting.
META = {"transition_id": pa.string(), "trajectory_id": pa.string(), "step": pa.int32(), "agent_name": pa.string(),
        "model": pa.string(), "reward": pa.float64(), "return": pa.float64(), "advantage": pa.float64(),
        "weight": pa.float64()}
_READ = list(META) + ["input_messages", "output_message", "tools", "flags", "prompt_seen"]


class ExportError(ValueError):
    """Arguments or an output that cannot work (one sentence)."""


class NothingToExport(ExportError):
    """No transitions to read: the build has not run (or not for these dates)."""


@dataclass
class ExportStats:
    rows: int = 0  # transitions read
    written: int = 0
    no_content: int = 0  # left out: recorded without messages (content capture was off)
    unrated: int = 0  # left out by `rewarded_only`
    not_selected: int = 0  # left out by the agent regex
    prompt_trial: int = 0  # left out: answered to a route's candidate prompt, not the recorded one (prompt_seen)
    files: list[str] = field(default_factory=list)  # the transitions files read


def tool_arguments(text: Any, how: str) -> Any:
    """`object`: the arguments as a mapping, what chat templates `tojson` (text that
    is not a JSON object stays text, as the model wrote it); `text`: JSON text."""
    if how == "text":
        return text if isinstance(text, str) else json.dumps(text if text is not None else {}, ensure_ascii=False)
    if not isinstance(text, str):
        return text if text is not None else {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def chat_message(m: dict, arguments: str = "object") -> dict:
    """One transitions message as an OpenAI / Hugging Face chat message."""
    out: dict[str, Any] = {"role": m.get("role") or "user", "content": m.get("content") or ""}
    if m.get("name"):
        out["name"] = m["name"]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": tc.get("id") or f"call_{i}", "type": "function",
             "function": {"name": tc.get("name") or "", "arguments": tool_arguments(tc.get("arguments"), arguments)}}
            for i, tc in enumerate(m["tool_calls"])]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def tools_of(row: dict) -> list[dict] | None:
    """The tools offered, already in OpenAI's nested form (the build normalizes them)."""
    try:
        tools = json.loads(row["tools"]) if row.get("tools") else None
    except json.JSONDecodeError:
        return None
    return tools if isinstance(tools, list) and tools else None


def example(row: dict, fmt: str = "messages", arguments: str = "object") -> dict:
    """One transition as a training example of `fmt`, with its metadata."""
    prompt = [chat_message(m, arguments) for m in row.get("input_messages") or []]
    completion = chat_message(row["output_message"], arguments)
    completion["role"] = "assistant"
    out: dict[str, Any] = ({"messages": prompt + [completion]} if fmt == "messages"
                           else {"prompt": prompt, "completion": [completion]})
    out["tools"] = tools_of(row)
    out.update({k: row.get(k) for k in META})
    return out


def _has_content(row: dict) -> bool:
    out = row.get("output_message")
    return bool(out) and "content_missing" not in (row.get("flags") or []) and bool(out.get("content") or out.get("tool_calls"))


def _rows(fs, root: str, since: str, until: str, stats: ExportStats) -> Iterator[dict]:
    base = layout.folder(root, layout.TRANSITIONS)
    if not fs.exists(base):
        raise NothingToExport(f"no transitions under {base}: run `nightshift build` first")
    for entry in sorted(fs.ls(base, detail=True), key=lambda e: e["name"]):
        name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
        day = layout.partition_date(name)
        if entry["type"] != "directory" or day is None:
            continue
        if (since and day < since) or (until and day > until):
            continue
        for f in sorted(x["name"] for x in fs.ls(entry["name"], detail=True)
                        if x["type"] == "file" and x["name"].endswith(layout.SUFFIX)):
            stats.files.append(f)
            try:
                with fs.open(f, "rb") as fh:
                    pf = pq.ParquetFile(fh)
                    schema = pf.schema_arrow
                    # a newer version, or no messages: one sentence (exit 2), not "0 exported, no content"
                    layout.check(layout.shown(fs, f), schema, layout.TRANSITIONS, "nightshift export")
                    cols = [c for c in _READ if c in set(schema.names)]
                    for batch in pf.iter_batches(batch_size=2048, columns=cols):
                        yield from batch.to_pylist()
            except (pa.ArrowException, OSError) as e:
                raise ExportError(f"{f} is not a readable transitions file ({e}); rebuild with `nightshift build`") from None


def _schema(fmt: str) -> pa.Schema:
    cols = ["messages"] if fmt == "messages" else ["prompt", "completion"]
    return pa.schema([pa.field(c, pa.json_()) for c in cols] + [pa.field("tools", pa.json_())]
                     + [pa.field(k, t) for k, t in META.items()])


def _table(examples: list[dict], schema: pa.Schema) -> pa.Table:
    arrays = []
    for f in schema:
        values = [e[f.name] for e in examples]
        if f.type == pa.json_():
            text = [None if v is None else json.dumps(v, ensure_ascii=False) for v in values]
            arrays.append(pa.array(text, pa.string()).cast(pa.json_()))
        else:
            arrays.append(pa.array(values, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def export(data: str, out: str, fmt: str = "messages", arguments: str = "object", *, rewarded_only: bool = False,
           agents: str = "", since: str = "", until: str = "", storage_options: dict | None = None) -> ExportStats:
    """Write the transitions under `data` to `out` (.parquet, or .jsonl / .json for
    JSON lines), replacing it whole once complete. Rows recorded without messages are
    left out and counted."""
    if fmt not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if arguments not in ARGUMENTS:
        raise ExportError(f"arguments must be one of {', '.join(ARGUMENTS)}, got {arguments!r}")
    kind = SUFFIXES.get(os.path.splitext(out)[1].lower())
    if kind is None:
        raise ExportError(f"the output file must end in .parquet, .jsonl or .json, got {out!r}")
    for what, day in (("--since", since), ("--until", until)):
        if day:
            try:
                dt.date.fromisoformat(day)
            except ValueError:
                raise ExportError(f"{what} must be a date YYYY-MM-DD, got {day!r}") from None
    try:
        pick = re.compile(agents) if agents else None
    except re.error as e:
        raise ExportError(f"--agents is not a regular expression: {e}") from None
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise ExportError(f"no folder {folder} to write {os.path.basename(out)} into")
    fs, root = fsspec.core.url_to_fs(data, **(storage_options or {}))
    stats = ExportStats()
    schema = _schema(fmt)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            writer = pq.ParquetWriter(fh, schema) if kind == "parquet" else None
            batch: list[dict] = []
            for row in _rows(fs, root.rstrip("/"), since, until, stats):
                stats.rows += 1
                if pick and not pick.search(row.get("agent_name") or ""):
                    stats.not_selected += 1
                    continue
                if not _has_content(row):
                    stats.no_content += 1
                    continue
                if row.get("prompt_seen"):  # the answer was written to the route's candidate prompt
                    stats.prompt_trial += 1
                    continue
                if rewarded_only and row.get("reward") is None:
                    stats.unrated += 1
                    continue
                ex = example(row, fmt, arguments)
                stats.written += 1
                if writer is None:
                    fh.write(json.dumps(ex, ensure_ascii=False).encode() + b"\n")
                else:
                    batch.append(ex)
                    if len(batch) >= 2048:
                        writer.write_table(_table(batch, schema))
                        batch = []
            if writer is not None:
                if batch:
                    writer.write_table(_table(batch, schema))
                writer.close()
            fh.flush()
            os.fsync(fh.fileno())
        if not stats.files:
            raise NothingToExport(f"no transitions files under {layout.folder(root, layout.TRANSITIONS)}"
                              + (" in the dates given" if since or until else "") + ": run `nightshift build` first")
        os.replace(tmp, out)
        fsync(folder)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return stats
