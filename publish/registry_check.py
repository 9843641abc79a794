"""What a readable `published.json` holds, and one phrase for what is wrong with
one that does not.

Two kinds of callers use it. A command that changes the server (publish,
rollback, a canary's start, stop or promotion, the watch) refuses a registry with
any problem: guessing which version serves could roll back the wrong one. A
reader that only reports (`nightshift versions`, the nightly report) keeps the
entries that pass and counts the others. Both need the same rules, so they live
here, once.
"""

from __future__ import annotations

import datetime as dt
import math
import re

#: what a version may be called: a folder name beside the checkpoints, never a path
VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ROLES = (None, "canary", "canary_end")
OUTCOMES = ("promoted", "stopped", "expired")
MODES = ("lora", "full")
OPS = ("publish", "canary_start", "canary_stop", "canary_promote")
#: fields that, when present and not null, must be text
TEXT = ("path", "checkpoint", "rollback_of", "stable_name", "stable", "serving", "serving_name", "why", "route",
        "outcome", "role", "mode")


def kind(value) -> str:
    """How a JSON value reads in a sentence: 'a list', 'null', 'the number 3'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the text {value[:40]!r}" + ("..." if len(value) > 40 else "")
    return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def is_time(value) -> bool:
    if not isinstance(value, str):
        return False
    try:
        dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def entry_problem(e, need_time: bool = True) -> str | None:
    """Why one history entry cannot be used (None: it can). `need_time`: an entry
    still to be committed (in a pending change) gets its time when it commits."""
    if not isinstance(e, dict):
        return f"is {kind(e)}, not an object"
    for key in ("version", "name", "endpoint") + (("time",) if need_time else ()):
        value = e.get(key)
        if value is None:
            return f"has no {key!r}"
        if not isinstance(value, str) or not value:
            return f"has {key!r} {kind(value)}, not a non-empty text"
    if not VERSION.match(e["version"]):
        return f"has version {e['version'][:40]!r}, not a version folder's name"
    if e.get("time") is not None and not is_time(e["time"]):
        return f"has time {kind(e['time'])}, not an ISO 8601 time"
    for key in TEXT:
        if e.get(key) is not None and not isinstance(e[key], str):
            return f"has {key!r} {kind(e[key])}, not a text"
    role = e.get("role")
    if role not in ROLES:
        return f"has role {role!r} (known: canary, canary_end, or none for a publication)"
    if role == "canary_end":
        if e.get("outcome") not in OUTCOMES:
            return f"ends a canary with outcome {e.get('outcome')!r} (known: {', '.join(OUTCOMES)})"
        return None
    if e.get("mode") not in MODES:
        return f"has mode {e.get('mode')!r}, not lora or full"
    if role == "canary":
        for key in ("serving", "serving_name"):
            if not e.get(key):
                return f"starts a canary without {key!r}"
        share = e.get("share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not math.isfinite(share) or not 0 <= share <= 1):
            return f"has share {kind(share)}, not a number from 0 to 1"
    return None


def pending_problem(p) -> str | None:
    """Why a recorded pending change cannot be finished or undone (None: it can)."""
    if not isinstance(p, dict):
        return f"is {kind(p)}, not an object"
    if p.get("op") not in OPS:
        return f"has op {p.get('op')!r} (known: {', '.join(OPS)})"
    for key in ("lora_name", "path", "stable_name", "mode", "unload"):
        if p.get(key) is not None and not isinstance(p[key], str):
            return f"has {key!r} {kind(p[key])}, not a text"
    needs = ("endpoint", "unload") if p["op"] == "canary_stop" else ("endpoint", "lora_name", "path")
    for key in needs:
        if not p.get(key):
            return f"has no {key!r}"
    if p.get("mode", "lora") not in MODES:
        return f"has mode {p.get('mode')!r}, not lora or full"
    if p["op"] != "publish" and p.get("route") is None:
        return f"moves no route, which a {p['op']} does"
    entries = p.get("entries")
    if not isinstance(entries, list) or not entries:
        return "has no entries to record"
    for i, e in enumerate(entries, 1):
        why = entry_problem(e, need_time=False)
        if why:
            return f"entry {i} to record {why}"
    before = p.get("before") or {}
    if not isinstance(before, dict) or any(not isinstance(k, str) or v is not None and not isinstance(v, str)
                                           for k, v in before.items()):
        return "has 'before' that is not an object of adapter names and paths"
    route = p.get("route")
    if route is not None:
        if not isinstance(route, dict) or not isinstance(route.get("url"), str) or not isinstance(
                route.get("stable"), str):
            return "has a 'route' without its proxy url and stable name"
        for key in ("before", "want"):
            if route.get(key) is not None and not isinstance(route[key], dict):
                return f"has route {key!r} {kind(route[key])}, not an object"
    return None


def document_problem(doc) -> str | None:
    """Why the whole document is unusable (None: its history is a list and any
    pending change is well formed; entries are checked one by one)."""
    if not isinstance(doc, dict):
        return f"holds {kind(doc)}, not an object with a 'history' list"
    if "history" not in doc:
        return "has no 'history' list"
    if not isinstance(doc["history"], list):
        return f"has 'history' {kind(doc['history'])}, not a list"
    if doc.get("pending") is not None:
        why = pending_problem(doc["pending"])
        if why:
            return f"records a pending change that {why}"
    return None
