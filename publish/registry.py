"""`published.json` beside the checkpoints: every publication, in order (version,
adapter name, path the server loaded, endpoint, time, mode, what it rolled back).
The last serving entry for an endpoint and name is what is serving. Rewritten
whole and atomically (temporary file, fsync, rename; one PUT on an object store),
and only after the server has verified the new version, so it never claims a
version the agents are not getting.

Canaries (publish/canary.py) are entries too, with a `role`: `canary` when a
version starts taking a share of the conversations beside the serving one,
`canary_end` when that ends (`outcome`: `promoted` or `stopped`, and why). They
never count as what serves: a promotion is a serving entry of its own.
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


CANARY_ROLES = ("canary", "canary_end")


def current(checkpoints: str, endpoint: str | None = None, name: str | None = None,
            storage_options: dict | None = None) -> dict | None:
    """The serving entry: the last one for this endpoint and name (any, when None)."""
    return last(read(checkpoints, storage_options), endpoint, name)


def last(entries: list[dict], endpoint: str | None = None, name: str | None = None) -> dict | None:
    """`current` over entries already read."""
    for e in reversed(entries):
        if (e.get("role") not in CANARY_ROLES and (endpoint is None or e.get("endpoint") == endpoint.rstrip("/"))
                and (name is None or e.get("name") == name)):
            return e
    return None


def lane(entries: list[dict], endpoint: str, name: str) -> list[dict]:
    """The entries of one endpoint and adapter name (`name@vNNNN`, or a full-weights
    publication there), in order: one agent's history of versions."""
    endpoint = endpoint.rstrip("/")
    return [e for e in entries if e.get("endpoint") == endpoint
            and (str(e.get("name", "")).startswith(f"{name}@") or e.get("mode") == "full")]


def serving(entries: list[dict], endpoint: str, name: str) -> dict | None:
    """What serves `name` on `endpoint`: its last publication that is not a canary's."""
    return next((e for e in reversed(lane(entries, endpoint, name)) if e.get("role") not in CANARY_ROLES), None)


def canary(entries: list[dict], endpoint: str, name: str) -> dict | None:
    """The canary running for `name` on `endpoint`, if one is: its `canary` entry with
    no `canary_end` after it."""
    last = next((e for e in reversed(lane(entries, endpoint, name)) if e.get("role") in CANARY_ROLES), None)
    return last if last is not None and last["role"] == "canary" else None


def judged_worse(entries: list[dict], endpoint: str, name: str) -> set[str]:
    """Versions production judged worse: rolled back, or a canary stopped. Nothing
    goes back to them (a rollback skips them) and nothing trains from them."""
    mine = lane(entries, endpoint, name)
    return ({str(e["rollback_of"]) for e in mine if e.get("rollback_of")}
            | {str(e["version"]) for e in mine if e.get("role") == "canary_end" and e.get("outcome") == "stopped"})


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
