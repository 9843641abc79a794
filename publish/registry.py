"""`published.json` beside the checkpoints: every publication, in order (version,
adapter name, path the server loaded, endpoint, time, mode, what it rolled back).
The last entry for an endpoint and name is what is serving. Rewritten whole and
atomically (temporary file, fsync, rename; one PUT on an object store), and only
after the server has verified the new version, so it never claims a version the
agents are not getting.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem

REGISTRY = "published.json"


def _path(checkpoints: str) -> str:
    return f"{checkpoints.rstrip('/')}/{REGISTRY}"


def read(checkpoints: str, storage_options: dict | None = None) -> list[dict]:
    fs, path = fsspec.core.url_to_fs(_path(checkpoints), **(storage_options or {}))
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        doc = json.load(f)
    return list(doc.get("history", []))


def current(checkpoints: str, endpoint: str | None = None, name: str | None = None,
            storage_options: dict | None = None) -> dict | None:
    """The serving entry: the last one for this endpoint and name (any, when None)."""
    for e in reversed(read(checkpoints, storage_options)):
        if (endpoint is None or e.get("endpoint") == endpoint.rstrip("/")) and (name is None or e.get("name") == name):
            return e
    return None


def append(checkpoints: str, entry: dict, storage_options: dict | None = None) -> dict:
    entry = {**entry, "time": entry.get("time") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    history = read(checkpoints, storage_options) + [entry]
    body = json.dumps({"current": entry, "history": history}, indent=2, sort_keys=True)
    fs, path = fsspec.core.url_to_fs(_path(checkpoints), **(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        fs.pipe(path, body.encode())
    return entry
