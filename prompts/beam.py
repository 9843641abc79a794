"""The beam carried over nights: which prompts the next round edits.

Agent Lightning's APO keeps the best `beam_width` prompts by score on a validation
batch and edits each again. From production traces nothing scores a candidate
offline unless the user's screening command does, and editing an unscored edit
again only piles guesses on guesses. So the beam here is the agent's own current
prompt (the one with production evidence) plus the candidates that earned a place:
they passed screening (ranked by its `score`, when the command prints one), or a
later judge recorded a verdict on them (`set_score`: the canary's, from the stages
that put candidates in front of agents). Without either the beam is the agent's
prompt alone and each night proposes afresh from its newest failures.

When the agent's own prompt changes (a new deploy: its current version id is no
longer the beam's base) the beam starts again from the new prompt and says so:
candidates written for the old one edit text the agent no longer sends.

`<store>/<agent>/beam.json`, written whole.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field

import fsspec

from nightshift.storage import write_atomic

from .store import Candidate, agent_root

FILE = "beam.json"
LAKE = "lake"  # the entry for the agent's own prompt, as the lake shows it


@dataclass
class Entry:
    ref: str  # "lake" or a candidate's vNNNN
    version_id: str
    score: float | None = None
    why: str = ""


@dataclass
class Beam:
    agent: str
    base: str  # the agent's own prompt version the beam grew from
    entries: list[Entry] = field(default_factory=list)
    updated: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True, ensure_ascii=False)


def read(store: str, agent: str, storage_options: dict | None = None) -> tuple[Beam | None, str]:
    """The stored beam, or None; and a note when a file was there but unusable."""
    path = f"{agent_root(store, agent)}/{FILE}"
    fs, p = fsspec.core.url_to_fs(path, **(storage_options or {}))
    if not fs.exists(p):
        return None, ""
    try:
        with fs.open(p, "r") as f:
            doc = json.load(f)
        entries = [Entry(str(e["ref"]), str(e["version_id"]), e.get("score"), str(e.get("why") or ""))
                   for e in doc["entries"]]
        return Beam(str(doc["agent"]), str(doc["base"]), entries, str(doc.get("updated") or "")), ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} is unreadable ({type(e).__name__}): the beam starts again from the agent's prompt"


def start(beam: Beam | None, agent: str, current: str) -> tuple[Beam, str]:
    """The beam for tonight: the stored one, or a fresh one from the agent's current
    prompt when there is none or the agent's own prompt changed (said in the note)."""
    if beam is not None and beam.base == current:
        return beam, ""
    note = (f"the agent's own prompt changed ({beam.base} -> {current}): the beam starts again from it"
            if beam is not None else "")
    return Beam(agent, current, [Entry(LAKE, current, None, "the agent's own prompt")]), note


def update(beam: Beam, screened: list[Candidate], width: int) -> Beam:
    """The agent's own prompt, then the best `width - 1` candidates that passed
    screening (kept entries and tonight's together; by score, then newest)."""
    keep = [e for e in beam.entries if e.ref != LAKE]
    for c in screened:
        if c.screen and c.screen.get("passed"):
            keep.append(Entry(c.version, c.version_id, c.screen.get("score"), "passed screening"))
    seen, ranked = set(), []
    for e in sorted(keep, key=lambda e: (e.score is None, -(e.score or 0.0), -int(e.ref[1:]) if e.ref[1:].isdigit() else 0)):
        if e.version_id not in seen:
            seen.add(e.version_id)
            ranked.append(e)
    own = next((e for e in beam.entries if e.ref == LAKE), Entry(LAKE, beam.base, None, "the agent's own prompt"))
    return Beam(beam.agent, beam.base, [own] + ranked[: max(width - 1, 0)],
                dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))


def set_score(beam: Beam, ref: str, score: float | None, why: str) -> Beam:
    """Record a verdict on an entry of the beam (KeyError when `ref` is not one)."""
    for e in beam.entries:
        if e.ref == ref:
            e.score, e.why = score, why
            return beam
    raise KeyError(ref)


def write(store: str, beam: Beam, storage_options: dict | None = None) -> None:
    if not beam.updated:
        beam.updated = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    write_atomic(f"{agent_root(store, beam.agent)}/{FILE}", beam.to_json(), storage_options)
