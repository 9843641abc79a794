"""Rewards, from wherever they are: span attributes, feedback posted later, and
user reward functions.

Every reward found becomes an `Observation`; `outcome` then picks the one that is
the trajectory's result (by source preference, then the latest). Bad values (NaN,
text) are counted and skipped, never raised: one broken emitter must not stop a
nightly build.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

log = logging.getLogger("nightshift.transform.rewards")

_AGL = re.compile(r"^agentlightning\.reward\.(\d+)\.(name|value)$")
_OI = re.compile(r"^(annotations|evaluations)\.(\d+)\.(annotation|evaluation)\.(name|score)$")
AGL_SPAN_NAMES = ("agentlightning.annotation", "agentlightning.reward")

#: Attribute-key prefixes that mark a span as carrying a reward (checked in Polars).
CARRIER_PREFIXES = ("agentlightning.reward", "annotations.", "evaluations.")
CARRIER_KEYS = ("reward", "agentops.task.output", "agentops.entity.output")


@dataclass
class Observation:
    name: str
    value: float
    source: str  # span | feedback | function
    detail: str  # e.g. "span:agentlightning", "feedback:user_rating"
    time_ns: int = 0  # when it happened (span start, feedback arrival); orders "latest"
    span_id: str | None = None  # the call it is about, when known
    primary: bool = False


def finite(value: Any) -> float | None:
    """The value as a finite float, or None (bools count as 1/0)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        v = float(value)
    elif isinstance(value, str):
        try:
            v = float(value)
        except ValueError:
            return None
    else:
        return None
    return v if math.isfinite(v) else None


def from_span(span_name: str, attrs: Mapping[str, Any], user_keys: tuple[str, ...] = ()) -> tuple[list[tuple[str, float, str, bool]], int]:
    """`(name, value, detail, primary)` for each reward on one span, and how many
    reward attributes were unusable (not a finite number)."""
    found: list[tuple[str, float, str, bool]] = []
    bad = 0
    agl: dict[int, dict[str, Any]] = {}
    oi: dict[tuple[str, int], dict[str, Any]] = {}
    for key, value in attrs.items():
        m = _AGL.match(key)
        if m:
            agl.setdefault(int(m.group(1)), {})[m.group(2)] = value
            continue
        m = _OI.match(key)
        if m:
            oi.setdefault((m.group(1), int(m.group(2))), {})[m.group(4)] = value
    for i in sorted(agl):
        v = finite(agl[i].get("value"))
        if v is None:
            bad += 1
            continue
        found.append((str(agl[i].get("name") or "primary"), v, "span:agentlightning", i == min(agl)))
    if span_name in AGL_SPAN_NAMES and "reward" in attrs:  # Agent Lightning 0.2's reward span
        v = finite(attrs["reward"])
        if v is None:
            bad += 1
        else:
            found.append(("primary", v, "span:agentlightning", True))
    for key in ("agentops.task.output", "agentops.entity.output"):  # AgentOps' @reward outputs
        doc = attrs.get(key)
        if isinstance(doc, str) and '"reward"' in doc:
            import json

            try:
                doc = json.loads(doc)
            except json.JSONDecodeError:
                continue
        if isinstance(doc, dict) and doc.get("type") == "reward":
            v = finite(doc.get("value"))
            if v is None:
                bad += 1
            else:
                found.append(("primary", v, "span:agentops", True))
    for (kind, _i), d in sorted(oi.items()):
        v = finite(d.get("score"))
        if v is None:
            bad += 1
            continue
        found.append((str(d.get("name") or kind), v, f"span:openinference_{kind}", False))
    for key in user_keys:
        if key in attrs:
            v = finite(attrs[key])
            if v is None:
                bad += 1
            else:
                found.append((key, v, f"span:{key}", False))
    return found, bad


def outcome(observations: list[Observation], name: str, prefer: list[str]) -> Observation | None:
    """The trajectory's result. With a chosen `name`: the preferred source's latest
    observation of that name. Without one: the most preferred source that has any
    (feedback posted later corrects what a span said), and within it the primary
    observation (else the first name seen), its latest."""
    if not observations:
        return None
    for source in prefer:
        pool = [o for o in observations if o.source == source]
        if name:
            pool = [o for o in pool if o.name == name]
        elif pool:
            prim = [o for o in pool if o.primary]
            if prim:
                pool = prim
            else:  # no primary marked: the first name seen in time order
                first = min(pool, key=lambda o: o.time_ns).name
                pool = [o for o in pool if o.name == first]
        if pool:
            return max(pool, key=lambda o: o.time_ns)
    return None


# --- user reward functions ------------------------------------------------------------


@dataclass
class Trajectory:
    """What a reward function receives. `steps` are the calls in order, each a dict
    with `input_messages`, `output_message`, `tools`, `agent_name`, `model`, `span_id`,
    ...; `rewards` are the observations found so far (spans, feedback)."""

    trajectory_id: str
    trace_ids: list[str]
    conversation_id: str | None
    service_name: str | None
    steps: list[dict]
    rewards: list[Observation] = field(default_factory=list)


def load_function(spec: str) -> Callable[[Trajectory], Any]:
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {spec!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable")
    return fn


def call_function(spec: str, fn: Callable[[Trajectory], Any], traj: Trajectory, time_ns: int) -> tuple[list[Observation], str | None]:
    """Observations from one user function on one trajectory, or an error text (the
    trajectory is marked, the build goes on)."""
    try:
        result = fn(traj)
    except Exception as e:  # user code: anything can happen
        return [], f"{type(e).__name__}: {e}"
    if result is None:
        return [], None
    items = result.items() if isinstance(result, dict) else [(spec.partition(":")[2], result)]
    out: list[Observation] = []
    for i, (name, value) in enumerate(items):
        v = finite(value)
        if v is None:
            return [], f"returned a non-finite or non-numeric value for {name!r}: {value!r}"
        out.append(Observation(str(name), v, "function", f"function:{spec}", time_ns, None, primary=i == 0))
    return out, None
