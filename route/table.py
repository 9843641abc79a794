"""The route table: for each stable name the agents ask for, the version serving
it, an optional candidate and the candidate's share of conversations. Checked on
the way in (a bad change is refused whole, with every problem named) and kept in
one JSON file, rewritten atomically and fsync'd before a change is acknowledged,
read back at start."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nightshift.storage import write_atomic

FIELDS = ("serving", "candidate", "share")
FORMAT = 1


class TableError(ValueError):
    """A change that cannot be made; the message names what is wrong."""


@dataclass(frozen=True)
class Route:
    serving: str
    candidate: str | None = None
    share: float = 0.0
    updated: float = 0.0  # unix seconds of the change

    def public(self, name: str) -> dict:
        return {"name": name, **asdict(self)}

    def describe(self) -> str:
        if not self.candidate:
            return f"all to {self.serving}"
        return f"{self.serving}, candidate {self.candidate} at {100 * self.share:g} %"


def _name_problem(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        return "the stable name is empty"
    if len(name) > 256 or any(ord(c) < 32 for c in name):
        return f"the stable name {name[:40]!r} is longer than 256 characters or holds control characters"
    return ""


def parse(name: str, body: object) -> Route:
    """A route from a PUT body `{"serving", "candidate", "share"}`, or TableError
    naming every problem (unknown fields are refused, not ignored)."""
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
                route = parse(name, {k: r.get(k) for k in FIELDS} if isinstance(r, dict) else r)
            except TableError as e:
                raise TableError(f"{self.path}: route {name!r}: {e}") from None
            updated = r.get("updated") or 0.0
            if isinstance(updated, bool) or not isinstance(updated, (int, float)):
                raise TableError(f"{self.path}: route {name!r}: updated must be unix seconds, got {updated!r}")
            routes[name] = Route(route.serving, route.candidate, route.share, float(updated))
        self.routes = routes
        return self

    def get(self, name: str) -> Route | None:
        return self.routes.get(name)

    def put(self, name: str, route: Route) -> Route | None:
        """Set `name`'s route; the route it replaced (None if new)."""
        with self._lock:
            before = self.routes.get(name)
            self._write({**self.routes, name: route})
            self.routes = {**self.routes, name: route}
            return before

    def delete(self, name: str) -> Route | None:
        with self._lock:
            before = self.routes.get(name)
            if before is not None:
                rest = {k: v for k, v in self.routes.items() if k != name}
                self._write(rest)
                self.routes = rest
            return before

    def public(self) -> list[dict]:
        return [r.public(n) for n, r in sorted(self.routes.items())]

    def _write(self, routes: dict[str, Route]) -> None:
        doc = {"format": FORMAT, "routes": {n: asdict(r) for n, r in sorted(routes.items())}}
        write_atomic(self.path, json.dumps(doc, indent=1) + "\n")
