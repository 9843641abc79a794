"""The watch for prompt canaries: a prompt candidate on a share of one agent's
conversations is judged exactly as an adapter canary is (judge/watch.py): the
same mSPRT on trajectory rewards, the same `min_trajectories` and the same
`canary.max_hours` for expiry, so "better" and "worse" mean one thing whatever
changed, the weights or the prompt. One difference: a prompt is promoted only when
shown better, never for being no worse than the margin (`prompt_action`).

The two arms come from the lake. The route marks the candidate's answers with the
id the trial gave it (`marked_as`, the trial's `version_id`, sent with the route),
and the build turns the mark into the transition's `prompt_seen`
(transform/attribution.py): a trajectory is in the candidate's arm when the agent's
first call in it carries exactly that id, so another agent's trial, or a promoted
prompt on another of this agent's prompts, never counts here. Trials recorded
before the route was given the id (no `marked_as`) are read as they were then
(`arms`). A trajectory is in the serving arm when the model saw the agent's own
prompt, the one the route matches (its system id, per-request data folded, as
`prompts.versions.assign` names every call's version), over the same hours (from
the candidate's first call on, by the agents' clock). The route leaves the serving
arm's answers unmarked on purpose: a mark sets `prompt_seen`, and a row with one is
kept out of export, and of training unless the trainer is given the prompt it was
answered under (trainer/select.py's seen_prompts, transform/export.py), as answered
to a prompt its row does not hold, which the serving arm's rows are not. A trajectory's reward is its
outcome over every agent's calls, what `nightshift versions` and `nightshift
prompts` count.

A promoted prompt is looked at too: when the route says the agent now sends a
different prompt of its own (`seen.changed` on the prompt route), the promotion
no longer applies; the route has stopped rewriting by then, and the record and
the report say so (publish/prompt_canary.py `retire`).
"""

from __future__ import annotations

import datetime as dt
import logging

import polars as pl

from nightshift.prompts import lake
from nightshift.prompts.versions import assign
from nightshift.publish import prompt_canary as trials
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient, RouteError, prompt_name
from nightshift.schemas.layout import LayoutError

from . import gatelog
from .watch import Verdict, WatchSettings, canary_action, judge

log = logging.getLogger("nightshift.judge.prompt_watch")


def arms(rows: pl.DataFrame, outcomes: pl.DataFrame, trial: dict) -> tuple[list[float], list[float]]:
    """(serving arm's rewards, candidate arm's rewards) of one trial, from one agent's
    calls (`prompts.lake.calls` with `prompt_seen`) and the trajectories' outcomes
    (`prompts.lake.trajectory_outcomes`)."""
    rows, _, versions = assign(rows)
    own = {vid for vid, v in versions.items() if v.system_hash == trial["match"]}
    own.add(trial.get("parent_version_id") or "")
    firsts = (rows.filter(pl.col("version").is_not_null()).sort("trajectory_id", "step")
              .group_by("trajectory_id", maintain_order=True)
              .agg(pl.col("version").first(), pl.col("prompt_seen").first().alias("seen"),
                   pl.col("start_time").min().alias("start"))
              .join(outcomes.select("trajectory_id", "reward"), on="trajectory_id", how="left"))
    started = dt.datetime.fromisoformat(trial["time"].replace("Z", "+00:00"))
    cand = firsts.filter(pl.col("seen") == (trial.get("marked_as") or trial["version_id"]))
    if cand.is_empty() and not trial.get("marked_as"):
        # A trial recorded before the route was given the id to mark with (no `marked_as`): its
        # route marked the candidate's text with the REQUEST's tools, and the lake knows an agent
        # whose spans record no tools (openai-v2) without them, so no mark is the candidate's
        # version_id. Read as then: from the trial's start on, a mark on this agent's trajectories
        # is this trial's candidate (sound while the agent has no other marked prompt: a promoted
        # one on another of its prompts would count here too, which `marked_as` trials cannot)
        cand = firsts.filter(pl.col("seen").is_not_null() & (pl.col("start") >= started))
    first = cand["start"].min()
    if first is None:
        first = started
    base = firsts.filter(pl.col("seen").is_null() & pl.col("version").is_in(sorted(own))
                         & (pl.col("start") >= first))
    return base["reward"].drop_nulls().to_list(), cand["reward"].drop_nulls().to_list()


def _record(checkpoints: str, v: Verdict, w: WatchSettings, trial: dict, action: str, hours: float) -> None:
    """The decision in `gate-log.jsonl` beside the adapter canaries', when the job has
    a checkpoints folder (the report reads both)."""
    if not checkpoints:
        return
    gatelog.append(checkpoints, {
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": "watch", "prompt": True,
        "agent": trial["agent"], "candidate": v.candidate, "baseline": v.baseline, "decision": v.decision,
        "diff": v.diff, "low": v.low, "high": v.high, "p_value": v.p_value, "n_candidate": v.n_candidate,
        "n_baseline": v.n_baseline, "alpha": w.alpha, "why": v.why, "action": action, "canary": True,
        "hours": round(hours, 2)})


def _client(c: CanarySettings, trial: dict) -> RouteClient:
    return RouteClient(c.route_url or trial.get("route") or "", c.route_token)


def watch_prompts(data: str, store: str, watching: WatchSettings | None = None, canary: CanarySettings | None = None,
                  *, checkpoints: str = "", act: bool = True, now: dt.datetime | None = None,
                  storage_options: dict | None = None) -> tuple[list[Verdict], list[str]]:
    """Judge every prompt canary running from `store` (the candidates' store) and
    act: stop, expire or promote it through the route; then retire promotions
    whose agent changed its own prompt. Returns the verdicts and the report's lines.
    A route that cannot be reached is said, and that trial waits for the next look."""
    w, c = watching or WatchSettings(), canary or CanarySettings()
    now = now or dt.datetime.now(dt.timezone.utc)
    entries = trials.read(store, storage_options)
    verdicts: list[Verdict] = []
    out: list[str] = []
    for trial in trials.running(entries):
        v, lines = _judge_trial(data, store, trial, w, c, act, now, checkpoints, storage_options)
        out += lines
        if v is not None:
            verdicts.append(v)
    for promoted in trials.applied(trials.read(store, storage_options)):
        out += _still_applies(store, promoted, c, act, storage_options)
    return verdicts, out


def prompt_action(v: Verdict, hours: float, w: WatchSettings, c: CanarySettings) -> str | None:
    """The adapter canary's decision (`watch.canary_action`), but a prompt is promoted
    only when shown better, not when shown no worse than the margin: an adapter
    that is as good is worth serving (it learned from newer traffic), a prompt
    edit that is as good is churn in what the team reads and maintains, and an
    identical candidate (A/A) must never be promoted (issue 27). Undecided until
    `max_hours`, it expires and the agent keeps its own prompt."""
    action = canary_action(v, hours, w, c)
    if action == "promote" and v.decision != "better":
        return "expire" if hours >= c.max_hours else None
    return action


def _judge_trial(data: str, store: str, trial: dict, w: WatchSettings, c: CanarySettings, act: bool,
                 now: dt.datetime, checkpoints: str, storage_options: dict | None) -> tuple[Verdict | None, list[str]]:
    agent, cand, base = trial["agent"], trial.get("version") or trial["candidate"], f"{trial['agent']}'s own prompt"
    started = dt.datetime.fromisoformat(trial["time"].replace("Z", "+00:00"))
    hours = (now - started).total_seconds() / 3600
    try:
        rows = lake.calls(data, "", storage_options, agent=agent)  # with `prompt_seen`
        outcomes = lake.trajectory_outcomes(data, rows["trajectory_id"].unique().to_list(), storage_options)
    except (lake.NoTransitions, LayoutError) as e:  # nothing built yet, or files this version cannot read
        return None, [f"watch: nothing to judge prompt canary {cand} of {agent} by: {e}"]
    baseline, candidate = arms(rows, outcomes, trial)
    v = judge(baseline, candidate, alpha=w.alpha, tau=w.tau, min_trajectories=w.min_trajectories,
              names=(base, f"prompt {cand}"))
    share = 100 * float(trial.get("share") or 0)
    out = [f"watch: prompt canary {cand} of {agent} ({share:.0f} % of its conversations, {hours:.1f} h) against "
           f"{base}: {v.decision}: {v.why}"]
    log.warning("watch: prompt canary %s of %s after %.1f h: %s (%s)", cand, agent, hours, v.decision, v.why)
    action = prompt_action(v, hours, w, c)
    if action == "expire":
        v.why = f"undecided after {hours:.1f} h (canary.max_hours {c.max_hours:g}): {v.why}; {base} keeps every " \
                "conversation"
    if action is None:
        return v, out
    if not act:
        return v, out + [f"  would {action} the prompt canary (dry run)"]
    client = _client(c, trial)
    try:
        if action == "promote":
            system = _system_of(trial, storage_options)
            out += trials.promote(store, trial, client, system, v.why, storage_options)
        else:
            out += trials.stop(store, trial, client, v.why, "stopped" if action == "stop" else "expired",
                               storage_options)
    except trials.TrialError as e:
        return v, out + [f"  not done: {e}; the next watch tries again"]
    v.action = {"stop": "canary stopped", "expire": "canary expired", "promote": "promoted"}[action]
    _record(checkpoints, v, w, trial, v.action, hours)
    return v, out


def _system_of(trial: dict, storage_options: dict | None) -> str:
    """The candidate's text, from its stored manifest (the route checks it against its id)."""
    from nightshift.prompts import store as cands

    folder = str(trial.get("path") or "")
    root, _, version = folder.rstrip("/").rpartition("/")
    got = cands.read(root, version, storage_options) if root and version else None
    if got is None:
        raise trials.TrialError(f"prompt candidate {trial.get('version')} of {trial['agent']!r}: its folder "
                                f"{folder or '(none recorded)'} holds no readable manifest, so it cannot be promoted")
    return got.system


def _still_applies(store: str, promoted: dict, c: CanarySettings, act: bool,
                   storage_options: dict | None) -> list[str]:
    """Retire a promotion once the route saw the agent send a new prompt of its own."""
    name = prompt_name(promoted["match"])
    try:
        seen = (_client(c, promoted).routes().get("prompts") or {})
    except RouteError as e:
        return [f"prompt {promoted.get('version')} of {promoted['agent']}: the route could not be asked ({e})"]
    if name not in seen:
        return [f"prompt {promoted.get('version')} of {promoted['agent']}: the route no longer has {name} (deleted "
                "by hand?); the record keeps it as promoted"]
    changed = (seen[name] or {}).get("changed")
    if not changed:
        return [f"prompt {promoted.get('version')} of {promoted['agent']} still applied by the route "
                f"(prompt {promoted['match']})"]
    if not act:
        return [f"prompt {promoted.get('version')} of {promoted['agent']}: the agent now sends prompt {changed}; "
                "would retire it (dry run)"]
    return trials.retire(store, promoted, changed, storage_options)
