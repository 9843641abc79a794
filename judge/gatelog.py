"""`gate-log.jsonl` beside the checkpoints: every decision the gate and the watch
took, one JSON object a line, appended and never rewritten (a decision once
logged is history). The nightly job's `runs.jsonl` is written and read the same
way (`append_line`, `read_lines`).

Appending is not atomic: a process killed mid-line leaves a torn last line. So
the writer starts a fresh line when the file does not end with one (the next
decision is never glued to the torn one), and the reader skips and counts what
it cannot read (a torn line, invalid UTF-8, JSON that is not an object) rather
than failing the report that reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LOG = "gate-log.jsonl"


def append(folder: str | Path, entry: dict) -> None:
    append_line(Path(folder) / LOG, entry)


def read(folder: str | Path) -> tuple[list[dict], int]:
    """The decisions that can be read, in order, and how many lines could not."""
    return read_lines(Path(folder) / LOG)


def append_line(path: Path, entry: dict) -> None:
    """One JSON line at the end of `path` (also the nightly job's `runs.jsonl`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(entry, default=str).encode() + b"\n"
    with open(path, "a+b") as f:
        if f.seek(0, os.SEEK_END) > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = b"\n" + line
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> tuple[list[dict], int]:
    """The objects of a JSON-lines file that can be read, and how many lines could not."""
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return [], 0
    except OSError:
        return [], 1
    out, bad = [], 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            e = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            bad += 1
            continue
        if isinstance(e, dict):
            out.append(e)
        else:
            bad += 1
    return out, bad
