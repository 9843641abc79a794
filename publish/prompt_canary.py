"""A prompt candidate in front of a share of one agent's conversations, then ended:
stopped, expired, or promoted to all of them; and a promoted prompt retired when
the agent changes its own.

The routing proxy does the work (its prompt routes, `route/prompt.py`): a route
named `prompt:<match>` rewrites the system prompt of a sticky share of the
requests whose prompt has the id `match` (the agent's own, per-request data
folded). This module only moves that route and keeps the record of what was
tried, in `<store>/trials.json` beside the candidates (`prompts/store.py`),
written whole and atomically like `published.json`: an agent on a hosted model
has no checkpoints folder, and the candidates' store is the one place every
prompt trial's evidence already lives.

The record is a list of entries, in order, one `agent` each:
- `canary`: a candidate started on a share (`match`, `candidate` its system id,
  `version_id` the prompt version the model sees, `version` its vNNNN, `share`;
  `marked_as`, the id the route marks the candidate's answers with: `version_id`,
  sent with the route, so the watch finds the arm by the trial's own id. An entry
  without it is from before the route was given the id, and its marks are read as
  they were then, judge/prompt_watch.py `arms`);
- `canary_end`: that trial ended, `outcome` `promoted`, `stopped` or `expired`,
  with why (a promoted prompt stays on the route at share 1.0);
- `retired`: a promoted prompt no longer applies, because the agent's own prompt
  changed (`changed_to`: the new prompt's id the route saw); the route stops
  rewriting by itself, since the new prompt no longer matches.

Each change is written ahead (`pending`, beside the list), then the route moves,
then the entry is appended and the pending change cleared, in one write: a route
that refuses leaves the record as it was, and the error says why. A process killed
between the steps (failpoints `prompt_start.pending`, `prompt_start.routed`, and
the same for `prompt_stop` and `prompt_promote`) leaves the pending change, which
the next command finishes or undoes before anything else (`reconcile`, the same
rules as an adapter's change in publish/recover.py), so the route serves no
prompt the record does not name. Which trial goes on and which ends is the
judge's call (judge/prompt_watch.py), never this module's.
"""

from __future__ import annotations

import datetime as dt
import json
import logging

import fsspec

from nightshift.route.client import RouteClient, RouteError, prompt_name
from nightshift.schemas.prompt_identity import system_id
from nightshift.storage import write_atomic

from .failpoints import hit

log = logging.getLogger("nightshift.publish.prompt_canary")

TRIALS = "trials.json"
ROLES = ("canary", "canary_end", "retired")
OUTCOMES = ("promoted", "stopped", "expired")
OPS = ("start", "stop", "promote")
#: what an entry must hold, and as what
NEEDS = {"agent": str, "role": str, "match": str, "candidate": str, "time": str}


class TrialError(RuntimeError):
    """The trials record cannot be used, or the route refused: one sentence naming which."""


def path_of(store: str) -> str:
    return f"{store.rstrip('/')}/{TRIALS}"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def entry_problem(e) -> str | None:
    """Why one entry cannot be used (None: it can)."""
    if not isinstance(e, dict):
        return "is not an object"
    for key, tp in NEEDS.items():
        if not isinstance(e.get(key), tp) or not e.get(key):
            return f"has no {key!r} text"
    if e["role"] not in ROLES:
        return f"has role {e['role'][:40]!r} (known: {', '.join(ROLES)})"
    if e["role"] == "canary_end" and e.get("outcome") not in OUTCOMES:
        return f"ends a trial with outcome {str(e.get('outcome'))[:40]!r} (known: {', '.join(OUTCOMES)})"
    return None


def read(store: str, storage_options: dict | None = None) -> list[dict]:
    """Every entry, in order ([] when no trial was ever started). A record with any
    problem is refused whole (TrialError): guessing which trial runs could end the
    wrong one or start a second on one agent."""
    return _load(store, storage_options)[0]


def pending(store: str, storage_options: dict | None = None) -> dict | None:
    """The change written ahead and not yet finished: a process was killed in it
    (or is making it now), and `reconcile` settles it."""
    return _load(store, storage_options)[1]


def _load(store: str, storage_options: dict | None) -> tuple[list[dict], dict | None]:
    path = path_of(store)
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as fh:
            raw = fh.read()
    except FileNotFoundError:
        return [], None
    except OSError as e:
        raise TrialError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise TrialError(f"{path} is not JSON: move it aside (no prompt trial runs while it is unreadable)") from None
    entries = doc.get("trials") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise TrialError(f"{path} holds no 'trials' list")
    for i, e in enumerate(entries):
        why = entry_problem(e)
        if why:
            raise TrialError(f"{path}: trial entry {i} {why}")
    ahead = doc.get("pending")
    if ahead is not None and not (isinstance(ahead, dict) and ahead.get("op") in OPS
                                  and entry_problem(ahead.get("entry")) is None):
        raise TrialError(f"{path}: its pending change is not one this version wrote (op start, stop or promote "
                         "with a whole entry): move the file aside only after checking the route by hand")
    return entries, ahead


def _write(store: str, entries: list[dict], ahead: dict | None, storage_options: dict | None) -> None:
    doc: dict = {"trials": entries}
    if ahead is not None:
        doc["pending"] = ahead
    write_atomic(path_of(store), json.dumps(doc, indent=2, ensure_ascii=False), storage_options)


def append(store: str, entry: dict, storage_options: dict | None = None, *, done: bool = False) -> dict:
    """`entry` at the end of the record; `done`: it finishes the pending change,
    which goes in the same write (a change is never recorded twice nor lost)."""
    entries, ahead = _load(store, storage_options)
    entry = {**entry, "time": entry.get("time") or _now()}
    why = entry_problem(entry)
    if why:  # a bug here, not a user's input: never write a record the next reader refuses
        raise TrialError(f"refusing to record a trial entry that {why}")
    _write(store, entries + [entry], None if done else ahead, storage_options)
    return entry


def _ahead(store: str, op: str, entry: dict, storage_options: dict | None, **extra) -> dict:
    """Write the change ahead of moving the route; the entry it will append."""
    entries, ahead = _load(store, storage_options)
    if ahead is not None:  # reconcile runs first; two changes at once would be guessed at afterwards
        raise TrialError(f"{path_of(store)}: a {ahead['op']} of prompt candidate {ahead['entry'].get('version')} "
                         f"of {ahead['entry']['agent']!r} is still pending: run `nightshift watch` to settle it")
    entry = {**entry, "time": entry.get("time") or _now()}
    why = entry_problem(entry)
    if why:
        raise TrialError(f"refusing to record a trial entry that {why}")
    _write(store, entries, {"op": op, "entry": entry, "time": _now(), **extra}, storage_options)
    return entry


def _drop(store: str, storage_options: dict | None) -> None:
    """The pending change abandoned: the route refused it, or never took it."""
    entries, _ = _load(store, storage_options)
    _write(store, entries, None, storage_options)


def reconcile(store: str, token: str = "", storage_options: dict | None = None) -> list[str]:
    """Finish or undo the change a killed process left pending, so that the route and
    the record agree; returns what was done, in words ([] when nothing was pending).
    The rules of publish/recover.py: a start or a promotion the route shows whole
    is recorded, one it does not show is dropped (the route never served it: a
    promotion not taken is decided again by the next look); a stop is finished
    (production judged the candidate worse, or out of time). A route that cannot be
    reached leaves it pending (TrialError), and nothing else is attempted."""
    _, ahead = _load(store, storage_options)
    if ahead is None:
        return []
    op, entry = ahead["op"], ahead["entry"]
    what = f"the {op} of prompt candidate {entry.get('version')} of {entry['agent']!r}"
    client = RouteClient(str(entry.get("route") or ""), token)
    try:
        if op == "stop":
            client.delete(prompt_name(entry["match"]))
            append(store, entry, storage_options, done=True)
            line = f"repaired: {what} was interrupted; finished now and recorded in {TRIALS}"
        else:
            route = client.get(prompt_name(entry["match"])) or {}
            share = 1.0 if op == "promote" else float(entry.get("share") or 0)
            if route.get("candidate") == entry["candidate"] and float(route.get("share") or 0) == share:
                append(store, entry, storage_options, done=True)
                line = (f"repaired: {what} was interrupted after the route had taken it: recorded in {TRIALS} "
                        "now")
            else:
                _drop(store, storage_options)
                line = (f"repaired: {what} was interrupted before the route took it: dropped ("
                        + ("the trial goes on; the next look decides again" if op == "promote" else
                           "no conversation saw it") + ")")
    except RouteError as e:
        raise TrialError(f"{what} was interrupted and cannot be settled yet ({e}); it stays pending in "
                         f"{path_of(store)}, and the next watch or nightly run tries again") from None
    log.warning("%s", line)
    return [line]


def running(entries: list[dict], agent: str | None = None) -> list[dict]:
    """The trials started and not yet ended (one agent's, or every agent's)."""
    out: dict[tuple[str, str], dict] = {}
    for e in entries:
        if agent is not None and e["agent"] != agent:
            continue
        key = (e["agent"], e["match"])
        if e["role"] == "canary":
            out[key] = e
        elif e["role"] == "canary_end":
            out.pop(key, None)
    return list(out.values())


def applied(entries: list[dict], agent: str | None = None) -> list[dict]:
    """The promotions still applied by the route: a `canary_end` promoted, not
    followed by a retirement or a new trial on the same agent prompt."""
    out: dict[tuple[str, str], dict] = {}
    for e in entries:
        if agent is not None and e["agent"] != agent:
            continue
        key = (e["agent"], e["match"])
        if e["role"] == "canary_end" and e.get("outcome") == "promoted":
            out[key] = e
        elif e["role"] in ("retired", "canary"):
            out.pop(key, None)
    return list(out.values())


def start(store: str, candidate, client: RouteClient, share: float, *, agent: str, model: str = "",
          match: str = "", storage_options: dict | None = None) -> dict:
    """Put `candidate` (a `prompts.store.Candidate`) on `share` of `agent`'s
    conversations whose prompt is `match` (the system id of the prompt the agent
    sends; default: the candidate's parent, which is that prompt when the parent came
    from the lake, not when it is an earlier candidate from the beam), and record it.

    Refused when that agent already has a trial running (two at once could not be
    told apart), or a promoted prompt applied on that same prompt: the route holds
    one candidate per prompt, so a new trial would take the promoted one away from
    the conversations outside its share. A change an earlier process left pending
    is settled first (`reconcile`)."""
    reconcile(store, client.token, storage_options)
    entries = read(store, storage_options)
    busy = running(entries, agent)
    if busy:
        raise TrialError(f"agent {agent!r} already has prompt candidate {busy[0].get('version')} on trial since "
                         f"{busy[0]['time']}: one experiment per agent at a time")
    man = candidate.manifest
    try:
        match, cand = match or man["parent"]["system_hash"], man["candidate"]["system_hash"]
        system, version_id = man["candidate"]["system"], man["candidate"]["version_id"]
    except (KeyError, TypeError):
        raise TrialError(f"{candidate.path}: its manifest names no parent and candidate prompt (system_hash, "
                         "system, version_id)") from None
    match_system = _parent_texts(candidate, match, storage_options)
    kept = [p for p in applied(entries, agent) if p["match"] == match]
    if kept:
        raise TrialError(f"agent {agent!r}'s prompt {match} is replaced by promoted candidate {kept[0].get('version')} "
                         "on the route: put it in the agent's own code first (the route holds one candidate per "
                         "prompt, and a new trial would take the promoted one from the other conversations)")
    entry = _ahead(store, "start", {
        "role": "canary", "agent": agent, "match": match, "candidate": cand, "version_id": version_id,
        "parent_version_id": man["parent"].get("version_id"), "version": candidate.version, "path": candidate.path,
        "share": share, "route": client.url, "model": model or man.get("model") or "", "match_system": match_system,
        "marked_as": version_id}, storage_options)
    hit("prompt_start.pending")
    try:
        client.set_prompt(match, cand, system, share, agent=agent, model=model or man.get("model") or "",
                          match_system=match_system, version=version_id)
    except RouteError as e:
        _drop(store, storage_options)
        raise TrialError(f"the route at {client.url} refused prompt candidate {candidate.version} of {agent!r}: "
                         f"{e}") from None
    hit("prompt_start.routed")
    log.info("prompt canary: %s of %s on %.0f %% of its conversations", candidate.version, agent, 100 * share)
    return append(store, entry, storage_options, done=True)


def _parent_texts(candidate, match: str, storage_options: dict | None) -> list[str] | None:
    """The agent's prompt as the lake folded it (`parent/prompt.json`), when it is the
    prompt the trial matches: the route needs it to recognise the agent's requests
    when their per-request data was folded by alignment (`{{var_1}}`: a customer's
    name), which no pattern finds in one request alone. None when the parent is not
    that prompt (an earlier candidate of the beam) or its file cannot be read: the
    route then matches on the prompt id alone, as before."""
    try:
        fs, path = fsspec.core.url_to_fs(candidate.path, **(storage_options or {}))
        with fs.open(path.rstrip("/") + "/parent/prompt.json", "rb") as fh:
            texts = json.load(fh).get("system")
    except (OSError, ValueError, AttributeError):
        return None
    if not (isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)):
        return None
    return texts if system_id(texts) == match else None


def _ended(trial: dict, **extra) -> dict:
    keep = ("agent", "match", "candidate", "version_id", "parent_version_id", "version", "path", "route", "model",
            "match_system", "marked_as")
    return {**{k: trial.get(k) for k in keep}, "started": trial["time"], **extra}


def stop(store: str, trial: dict, client: RouteClient, why: str, outcome: str = "stopped",
         storage_options: dict | None = None) -> list[str]:
    """End a trial: the route's prompt route deleted (every conversation gets the
    agent's own prompt again), then the record."""
    entry = _ahead(store, "stop", _ended(trial, role="canary_end", outcome=outcome, why=why, route=client.url),
                   storage_options)
    hit("prompt_stop.pending")
    try:
        client.delete(prompt_name(trial["match"]))
    except RouteError as e:
        _drop(store, storage_options)
        raise TrialError(f"the route at {client.url} did not take prompt candidate {trial.get('version')} of "
                         f"{trial['agent']!r} off: {e}") from None
    hit("prompt_stop.routed")
    append(store, entry, storage_options, done=True)
    return [f"prompt canary {trial.get('version')} of {trial['agent']} {outcome}: {why}"]


def promote(store: str, trial: dict, client: RouteClient, system: str | list[str], why: str,
            storage_options: dict | None = None) -> list[str]:
    """The candidate for every conversation of the agent's prompt (share 1.0), kept
    there until the agent changes its own prompt; then the record."""
    entry = _ahead(store, "promote", _ended(trial, role="canary_end", outcome="promoted", why=why,
                                            route=client.url), storage_options)
    hit("prompt_promote.pending")
    try:
        client.set_prompt(trial["match"], trial["candidate"], system, 1.0, agent=trial["agent"],
                          model=trial.get("model") or "", match_system=trial.get("match_system"),
                          version=trial.get("version_id") or "")
    except RouteError as e:
        _drop(store, storage_options)
        raise TrialError(f"the route at {client.url} did not take prompt candidate {trial.get('version')} of "
                         f"{trial['agent']!r} to every conversation: {e}") from None
    hit("prompt_promote.routed")
    append(store, entry, storage_options, done=True)
    return [f"prompt canary {trial.get('version')} of {trial['agent']} promoted: {why}",
            f"  the route applies it to every conversation of prompt {trial['match']} until the agent changes "
            "its own prompt"]


def retire(store: str, promoted: dict, changed_to: str, storage_options: dict | None = None) -> list[str]:
    """Record that a promoted prompt no longer applies: the agent sends a new prompt
    of its own (`changed_to`), which the route does not rewrite."""
    why = (f"agent {promoted['agent']!r} now sends its own prompt {changed_to}, not {promoted['match']}: the route "
           f"no longer rewrites it, and promoted candidate {promoted.get('version')} no longer applies")
    append(store, _ended(promoted, role="retired", changed_to=changed_to, why=why), storage_options)
    return [f"prompt {promoted.get('version')} of {promoted['agent']} retired: {why}"]
