"""Which version answers a request for a stable name: a weighted choice that is
sticky per conversation, so every call of one trajectory is made by one version
and its reward can be put down to that version.

The conversation's key, the first of:
  1. the `X-Nightshift-Route-Key` header (an agent that knows its conversation id);
  2. the trace id of the W3C `traceparent` header: the trajectory's id in Nightshift's
     default `trajectory: trace` mode, sent by every instrumented HTTP client;
  3. a hash of the request's `user` field, first system (or developer) message and
     first user message: the same on every call of a conversation, whose history
     only grows (the Responses API's `instructions` and `input` alike).
A request with none of them (no messages) is chosen for at random.

The key, salted with the candidate's name, hashes to a point in [0, 1); below the
share goes to the candidate. Raising the share keeps every conversation already
on the candidate there; a new candidate draws a fresh set of conversations.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from .table import Route

KEY_HEADER = "X-Nightshift-Route-Key"
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    try:
        return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:  # parsed, but nested too deeply to write back from here: the same for every call
        return "\x00deep"


def conversation_key(body: dict) -> str:
    """The `user` field and the first system and first user message, or "" when the
    request has no messages to tell its conversation by."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        messages = body.get("input") if isinstance(body.get("input"), list) else []
    system, user = body.get("instructions"), None
    for m in messages:
        if not isinstance(m, dict):
            continue
        role = m.get("role")
        if system is None and role in ("system", "developer"):
            system = m.get("content")
        elif user is None and role == "user":
            user = m.get("content")
        if system is not None and user is not None:
            break
    if user is None and isinstance(body.get("input"), str):
        user = body["input"]
    if user is None and isinstance(body.get("prompt"), str):
        user = body["prompt"]  # the legacy completions API: sticky only through a header or traceparent
    if system is None and user is None:
        return ""
    parts = [_text(body.get("user") or ""), _text(system or ""), _text(user or "")]
    # surrogatepass: JSON's "\ud800" is a lone surrogate in Python, and still a key
    return hashlib.blake2b("\x1f".join(parts).encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def sticky_key(headers, body: dict) -> tuple[str, str]:
    """(kind, key): kind is `header`, `trace`, `conversation` or `random`."""
    explicit = headers.get(KEY_HEADER)
    if explicit:
        return "header", explicit
    tp = headers.get("traceparent")
    if tp:
        m = _TRACEPARENT.fullmatch(tp.strip().lower())
        if m and m.group(1) != _ZERO_TRACE:
            return "trace", m.group(1)
    conv = conversation_key(body)
    if conv:
        return "conversation", conv
    return "random", os.urandom(8).hex()


def point(key: str, salt: str) -> float:
    """The key's place in [0, 1), independent for each salt."""
    # surrogatepass: a header's bytes that are not UTF-8 reach here as lone surrogates (aiohttp's
    # surrogateescape); they are still a conversation's key
    d = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8, person=b"ns-route",
                        salt=hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()).digest()
    return int.from_bytes(d, "big") / 2.0**64


def choose(route: Route, key: str) -> tuple[str, str, float]:
    """(versioned name, arm: `serving` or `candidate`, the key's point)."""
    if not route.candidate or route.share <= 0:
        return route.serving, "serving", -1.0
    x = point(key, route.candidate)
    return (route.candidate, "candidate", x) if x < route.share else (route.serving, "serving", x)
