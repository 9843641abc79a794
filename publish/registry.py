"""`published.json` beside the checkpoints: every publication, in order (version,
adapter name, path the server loaded, endpoint, time, mode, what it rolled back).
The last serving entry for an endpoint and name is what is serving. Rewritten
whole and atomically (`storage.write_atomic`: temporary file, fsync, rename,
folder fsync; one PUT on an object store).

A change to the server is bracketed here (publish/change.py): `begin` records
it as `pending` before the server is touched, `commit` appends its entries and
clears it once the server has verified the change, `abort` clears it once the
change is undone. A process killed in between leaves `pending` behind, and the
next command that changes anything finishes or undoes it first
(publish/recover.py), so the registry never names a version the agents are not
getting for longer than that.

Canaries (publish/canary.py) are entries too, with a `role`: `canary` when a
version starts taking a share of the conversations beside the serving one,
`canary_end` when that ends (`outcome`: `promoted`, `stopped` or `expired`, and
why). They never count as what serves: a promotion is a serving entry of its own.

Reading: `read` (and `load`) refuse a file with any problem, with one sentence
naming the file and the problem (`RegistryError`); `read_lenient`, for readers
that only report, keeps the entries that pass (publish/registry_check.py) and
says what it skipped.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass

import fsspec

from nightshift.storage import write_atomic

from .registry_check import document_problem, entry_problem, pending_problem

REGISTRY = "published.json"
CANARY_ROLES = ("canary", "canary_end")
BASE = "base"  # what serves when no version does: the base model (a canary's `serving`, the versions table's row)


class RegistryError(ValueError):
    """`published.json` cannot be used: the message names the file and what is wrong."""


@dataclass
class Document:
    entries: list[dict]
    pending: dict | None = None


def path_of(checkpoints: str) -> str:
    return f"{checkpoints.rstrip('/')}/{REGISTRY}"


def _parse(raw: bytes, where: str) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RegistryError(f"{where} is not UTF-8 text (byte {e.start} cannot be decoded)") from None
    if not text.strip():
        raise RegistryError(f"{where} is empty")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RegistryError(f"{where} is not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise RegistryError(f"{where} is not a registry (JSON nested too deeply to read)") from None


def _raw(checkpoints: str, storage_options: dict | None) -> bytes | None:
    fs, path = fsspec.core.url_to_fs(path_of(checkpoints), **(storage_options or {}))
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise RegistryError(f"{path_of(checkpoints)} is a folder, not a file") from None
    except OSError as e:
        raise RegistryError(f"{path_of(checkpoints)} cannot be read ({e.strerror or e})") from None


def load(checkpoints: str, storage_options: dict | None = None) -> Document:
    """The whole registry, every entry checked; `RegistryError` on any problem. A
    missing file is an empty registry."""
    where = path_of(checkpoints)
    raw = _raw(checkpoints, storage_options)
    if raw is None:
        return Document([])
    doc = _parse(raw, where)
    why = document_problem(doc)
    if why:
        raise RegistryError(f"{where} {why}")
    history = doc["history"]
    for i, e in enumerate(history, 1):
        why = entry_problem(e)
        if why:
            raise RegistryError(f"{where}: entry {i} of {len(history)} {why}")
    return Document(list(history), doc.get("pending"))


def read(checkpoints: str, storage_options: dict | None = None) -> list[dict]:
    """Every entry, in order; `RegistryError` when the file cannot be used whole."""
    return load(checkpoints, storage_options).entries


def read_lenient(checkpoints: str, storage_options: dict | None = None) -> tuple[list[dict], list[str]]:
    """For readers that only report: the entries that can be used, and one line
    per problem (a whole file unusable: no entries and why; entries skipped:
    how many and the first reasons)."""
    where = path_of(checkpoints)
    try:
        raw = _raw(checkpoints, storage_options)
        if raw is None:
            return [], []
        doc = _parse(raw, where)
    except RegistryError as e:
        return [], [f"{e}: read as if empty"]
    if not isinstance(doc, dict) or not isinstance(doc.get("history"), list):
        return [], [f"{where} {document_problem(doc) or 'has no history'}: read as if empty"]
    good, bad = [], []
    for i, e in enumerate(doc["history"], 1):
        why = entry_problem(e)
        if why:
            bad.append(f"entry {i} {why}")
        else:
            good.append(e)
    notes = []
    if bad:
        notes.append(f"{where}: {len(bad)} of {len(doc['history'])} entries skipped ({'; '.join(bad[:3])}"
                     f"{'; ...' if len(bad) > 3 else ''})")
    pending = doc.get("pending")
    if pending is not None:
        op = pending.get("op") if isinstance(pending, dict) else None
        notes.append(f"{where} records an interrupted change ({op or 'unreadable'}) as pending: the next publish, "
                     "rollback or watch finishes or undoes it")
    return good, notes


def _write(checkpoints: str, doc: Document, storage_options: dict | None) -> None:
    body: dict = {"current": doc.entries[-1] if doc.entries else None, "history": doc.entries}
    if doc.pending is not None:
        body["pending"] = doc.pending
    write_atomic(path_of(checkpoints), json.dumps(body, indent=2, sort_keys=True), storage_options)


def _stamped(entry: dict) -> dict:
    """The entry timed now unless it says when; one the readers would refuse is never written."""
    entry = {**entry, "time": entry.get("time") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    why = entry_problem(entry)
    if why:
        raise RegistryError(f"not recording an entry that {why}: {entry}")
    return entry


def append(checkpoints: str, entry: dict, storage_options: dict | None = None) -> dict:
    """Add one entry (timed now unless it says when), leaving any pending change
    as it is."""
    doc = load(checkpoints, storage_options)
    entry = _stamped(entry)
    doc.entries.append(entry)
    _write(checkpoints, doc, storage_options)
    return entry


def begin(checkpoints: str, change: dict, storage_options: dict | None = None) -> None:
    """Record `change` as pending, before the server is touched."""
    why = pending_problem(change)
    if why:
        raise RegistryError(f"not recording a pending change that {why}: {change}")
    doc = load(checkpoints, storage_options)
    if doc.pending is not None:
        raise RegistryError(f"{path_of(checkpoints)} already records a pending change ({doc.pending.get('op')}); "
                            "it must be finished or undone first")
    doc.pending = change
    _write(checkpoints, doc, storage_options)


def commit(checkpoints: str, entries: list[dict], storage_options: dict | None = None) -> list[dict]:
    """Append the pending change's entries and clear it, in one write."""
    doc = load(checkpoints, storage_options)
    added = [_stamped(e) for e in entries]
    doc.entries += added
    doc.pending = None
    _write(checkpoints, doc, storage_options)
    return added


def abort(checkpoints: str, storage_options: dict | None = None) -> None:
    """Clear the pending change: it was undone, or never reached the server."""
    doc = load(checkpoints, storage_options)
    if doc.pending is not None:
        doc.pending = None
        _write(checkpoints, doc, storage_options)


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
