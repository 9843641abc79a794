"""The route table: for each stable name the agents ask for, the version serving
it, an optional candidate and the candidate's share of conversations. Checked on
the way in (a bad change is refused whole, with every problem named) and kept in
one JSON file, rewritten atomically and fsync'd before a change is acknowledged,
read back at start.

A prompt route (`kind: prompt`, named `prompt:<match>`) is the same choice made for
a system prompt instead of a model: requests whose leading system messages, with
per-request data folded (`schemas.prompt_template`), hash to `match`
(`schemas.prompt_identity.system_id`) get the candidate's text in their place for
`share` of the conversations. The candidate's text travels in the PUT and is
checked against its id here: the proxy may run where the candidate store is not,
and a text that is not the candidate it claims would be served under its name.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nightshift.schemas.prompt_identity import ID_LENGTH, system_id
from nightshift.storage import write_atomic

FIELDS = ("serving", "candidate", "share")
PROMPT_FIELDS = ("kind", "agent", "model", "match_system", "candidate", "system", "share", "version")
PROMPT_PREFIX = "prompt:"
MAX_PROMPT_CHARS = 256 * 1024  # a system prompt past this is not one a proposer wrote
FORMAT = 1
_ID = re.compile(r"[0-9a-f]{%d}" % ID_LENGTH)


class TableError(ValueError):
    """A change that cannot be made; the message names what is wrong."""


@dataclass(frozen=True)
class Route:
    serving: str
    candidate: str | None = None
    share: float = 0.0
    updated: float = 0.0  # unix seconds of the change
    # a prompt route's: `serving` is the matched system id (the agent's own prompt), `candidate`
    # the candidate's system id, `system` its text(s), `match_system` the agent's prompt as a
    # template (its alignment slots are how the proxy recognises renderings of it)
    kind: str = "model"
    agent: str = ""
    model: str = ""
    match_system: tuple[str, ...] = ()
    system: tuple[str, ...] = ()
    # the prompt version id the route applies (the trial's `version_id`): what a rewritten answer is
    # marked with; "" for a route PUT without one, whose marks the proxy computes (`PromptRouter.version`)
    version: str = ""

    def public(self, name: str) -> dict:
        d = asdict(self)
        if self.kind == "model":
            d = {k: d[k] for k in (*FIELDS, "updated")}
        else:
            d = {"kind": self.kind, "match": self.serving, **{k: d[k] for k in PROMPT_FIELDS[1:]}, "updated": self.updated}
            d["match_system"], d["system"] = list(self.match_system), list(self.system)
        return {"name": name, **d}

    def stored(self) -> dict:
        """What the table's file keeps."""
        d = asdict(self)
        if self.kind == "model":
            return {k: d[k] for k in (*FIELDS, "updated")}
        return {**{k: d[k] for k in (*PROMPT_FIELDS, "updated")}, "match_system": list(self.match_system),
                "system": list(self.system)}

    def describe(self) -> str:
        if self.kind == "prompt":
            who = f"agent {self.agent}'s " if self.agent else ""
            return f"{who}prompt {self.serving}, candidate {self.candidate} at {100 * self.share:g} %"
        if not self.candidate:
            return f"all to {self.serving}"
        return f"{self.serving}, candidate {self.candidate} at {100 * self.share:g} %"


def _name_problem(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        return "the stable name is empty"
    if len(name) > 256 or any(ord(c) < 32 for c in name):
        return f"the stable name {name[:40]!r} is longer than 256 characters or holds control characters"
    return ""


def _texts(value: object, what: str, problems: list[str]) -> tuple[str, ...]:
    """A list of texts (or one text) as a tuple, or a problem."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        problems.append(f"{what} must be a text or a non-empty list of texts, got {str(value)[:60]!r}")
        return ()
    if sum(map(len, texts)) > MAX_PROMPT_CHARS:
        problems.append(f"{what} is longer than {MAX_PROMPT_CHARS:,} characters")
    return tuple(texts)


def parse_prompt(name: str, body: dict) -> Route:
    """A prompt route from a PUT body {"kind": "prompt", "candidate", "system", "share",
    and optionally "agent", "model", "match_system", "version"} for the name `prompt:<match>`."""
    problems = []
    match = name[len(PROMPT_PREFIX):] if name.startswith(PROMPT_PREFIX) else ""
    if not _ID.fullmatch(match):
        problems.append(f"a prompt route is named {PROMPT_PREFIX}<the {ID_LENGTH}-hex system id of the agent's prompt>"
                        f", got {name[:60]!r}")
    unknown = sorted(set(body) - set(PROMPT_FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(PROMPT_FIELDS)})")
    agent, model = body.get("agent") or "", body.get("model") or ""
    for what, v in (("agent", agent), ("model", model)):
        if not isinstance(v, str) or len(v) > 256 or any(ord(c) < 32 for c in v):
            problems.append(f"{what} must be a name (at most 256 characters, no control characters), got {v!r}")
    candidate = body.get("candidate")
    if not isinstance(candidate, str) or not _ID.fullmatch(candidate):
        problems.append(f"candidate must be the candidate's {ID_LENGTH}-hex system id (its manifest's "
                        f"candidate.system_hash), got {candidate!r}")
    elif candidate == match:
        problems.append(f"candidate and the matched prompt are both {match}")
    system = _texts(body.get("system"), "system (the candidate's text)", problems)
    if system and isinstance(candidate, str) and _ID.fullmatch(candidate) and system_id(list(system)) != candidate:
        problems.append(f"the candidate's text hashes to {system_id(list(system))}, not to its id {candidate}: send "
                        "the text stored with that candidate")
    if system and not all(t.strip() for t in system):
        problems.append("system holds an empty text: a candidate prompt says something")
    templ: tuple[str, ...] = ()
    if body.get("match_system") is not None:
        templ = _texts(body.get("match_system"), "match_system (the agent's prompt, as `nightshift prompts` lists "
                       "it)", problems)
        if templ and match and system_id(list(templ)) != match:
            problems.append(f"match_system hashes to {system_id(list(templ))}, not to the route's {match}")
    share = body.get("share")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) \
            or not 0.0 <= share <= 1.0:
        problems.append(f"share must be a number in [0, 1] (the candidate's share of conversations), got {share!r}")
    version = body.get("version") or ""
    if not isinstance(version, str) or (version and not _ID.fullmatch(version)):
        problems.append(f"version must be the {ID_LENGTH}-hex id of the prompt version the trial judges (its "
                        f"manifest's candidate.version_id), got {str(version)[:40]!r}")
    if problems:
        raise TableError("; ".join(problems))
    return Route(match, candidate, float(share), time.time(), "prompt", agent, model, templ, system, version)


def parse(name: str, body: object) -> Route:
    """A route from a PUT body `{"serving", "candidate", "share"}` (or a prompt route's,
    `{"kind": "prompt", ...}`), or TableError naming every problem (unknown fields
    are refused, not ignored)."""
    if isinstance(body, dict) and body.get("kind", "model") != "model":
        if body.get("kind") != "prompt":
            raise TableError(f"kind must be model or prompt, got {body.get('kind')!r}")
        return parse_prompt(name, body)
    if isinstance(body, dict) and name.startswith(PROMPT_PREFIX):
        raise TableError(f"{name[:60]!r} names a prompt route: send \"kind\": \"prompt\" with its candidate")
    body = {k: v for k, v in body.items() if k != "kind"} if isinstance(body, dict) else body
    problems = [p for p in [_name_problem(name)] if p]
    if not isinstance(body, dict):
        raise TableError(f"the body must be a JSON object with {', '.join(FIELDS)}, got {type(body).__name__}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        problems.append(f"unknown field(s) {', '.join(map(repr, unknown))} (known: {', '.join(FIELDS)})")
    serving, candidate, share = body.get("serving"), body.get("candidate"), body.get("share")
    if not isinstance(serving, str) or not serving.strip():
        problems.append(f"serving must be a model name the upstream serves, got {serving!r}")
    if candidate is not None and (not isinstance(candidate, str) or not candidate.strip()):
        problems.append(f"candidate must be a model name or null, got {candidate!r}")
    if candidate is not None and candidate == serving:
        problems.append(f"candidate and serving are both {serving!r}")
    if share is None:
        if candidate is not None:
            problems.append("share is missing: the candidate's share of conversations, a number in [0, 1]")
        share = 0.0
    elif isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) \
            or not 0.0 <= share <= 1.0:
        problems.append(f"share must be a number in [0, 1], got {share!r}")
    elif candidate is None and share != 0:
        problems.append(f"share {share!r} without a candidate: give the candidate, or share 0")
    if problems:
        raise TableError("; ".join(problems))
    return Route(serving, candidate, float(share), time.time())


class RouteTable:
    """The routes in memory, mirrored in `path`. Reads are plain dict lookups (the
    request path); `put` and `delete` write the file first, then change memory, so
    what a 200 acknowledged survives a crash and a failed write changes nothing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.routes: dict[str, Route] = {}
        self.prompts: dict[str, Route] = {}  # prompt routes by the system id they match: the request path's index
        self._lock = threading.Lock()  # changes are written from worker threads, one at a time

    def load(self) -> "RouteTable":
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return self
        except (OSError, ValueError, RecursionError) as e:
            raise TableError(f"cannot read the route table {self.path}: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("routes"), dict):
            raise TableError(f"{self.path} is not a route table (format {FORMAT})")
        routes = {}
        for name, r in doc["routes"].items():
            try:
                keys = PROMPT_FIELDS if isinstance(r, dict) and r.get("kind") == "prompt" else FIELDS
                route = parse(name, {k: r.get(k) for k in keys if k in r} if isinstance(r, dict) else r)
            except TableError as e:
                raise TableError(f"{self.path}: route {name!r}: {e}") from None
            updated = r.get("updated") or 0.0
            if isinstance(updated, bool) or not isinstance(updated, (int, float)):
                raise TableError(f"{self.path}: route {name!r}: updated must be unix seconds, got {updated!r}")
            routes[name] = replace(route, updated=float(updated))
        self._set(routes)
        return self

    def _set(self, routes: dict[str, Route]) -> None:
        self.prompts = {r.serving: r for r in routes.values() if r.kind == "prompt"}
        self.routes = routes

    def get(self, name: str) -> Route | None:
        """A stable name's model route (a model named like a prompt route is not one)."""
        r = self.routes.get(name)
        return r if r is not None and r.kind == "model" else None

    def entry(self, name: str) -> Route | None:
        """Any route by its name, model or prompt: what the control API reads and deletes."""
        return self.routes.get(name)

    def put(self, name: str, route: Route) -> Route | None:
        """Set `name`'s route; the route it replaced (None if new)."""
        with self._lock:
            before = self.routes.get(name)
            self._write({**self.routes, name: route})
            self._set({**self.routes, name: route})
            return before

    def delete(self, name: str) -> Route | None:
        with self._lock:
            before = self.routes.get(name)
            if before is not None:
                rest = {k: v for k, v in self.routes.items() if k != name}
                self._write(rest)
                self._set(rest)
            return before

    def public(self) -> list[dict]:
        return [r.public(n) for n, r in sorted(self.routes.items())]

    def _write(self, routes: dict[str, Route]) -> None:
        doc = {"format": FORMAT, "routes": {n: r.stored() for n, r in sorted(routes.items())}}
        write_atomic(self.path, json.dumps(doc, indent=1) + "\n")
