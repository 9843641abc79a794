"""The watch: is the version now serving worse in production than the one before it?

Rewards arrive a few at a time, night after night, and the question is asked each
time: a fixed-sample test asked repeatedly raises false alarms far above its
nominal rate. The watch uses the mixture sequential probability ratio test
(mSPRT; Johari, Pekelis and Walsh, "Always valid inference", 2017) on the
difference of the two versions' mean trajectory rewards: with a normal mixture
N(0, tau^2) over the difference and the estimate's variance v = s_a^2/n_a +
s_b^2/n_b,

    Lambda = sqrt(v / (v + tau^2)) * exp(d^2 tau^2 / (2 v (v + tau^2)))

and H0 (no difference) is rejected once Lambda >= 1/alpha. Its p-value
min(1, 1/Lambda) is valid however often it is looked at, so the nightly job can
check after every build and the chance of ever rolling back a version that is as
good as its predecessor stays below alpha. Why this and not a confidence
sequence for bounded rewards: rewards here are any real numbers (graded judges,
costs), and the normal mixture needs only a variance; for 0/1 rewards it is
conservative, never anti-conservative, at the sample sizes the watch waits for.
No decision is taken on fewer than `min_trajectories` per version.

The same Lambda, read the other way, gives an always-valid confidence sequence
for the difference: every delta with Lambda(d - delta) < 1/alpha,

    d +- sqrt(2 v (v + tau^2) / tau^2 * (log(1/alpha) + log((v + tau^2) / v) / 2))

which "worse" (the whole sequence below 0) and "better" (above) are the two
sides of, and which the report prints beside each decision.

Two comparisons, one test:
- a canary (publish/canary.py): the candidate against the serving version over
  the same hours, since both serve side by side from the canary's start:
  worse stops it; better promotes it, and so does a confidence sequence whose
  lower end is above -`margin` (shown no worse than that: non-inferiority, as
  valid at this look as at any); a canary still undecided after
  `canary.max_hours` expires (the serving version keeps everything). A point
  estimate "within the margin" is not enough: at 80 trajectories a side, a
  canary 8 points worse looked within 2 points of the serving one 8 times in
  20 (tests/test_watch.py);
- otherwise the serving version against the one it replaced: worse rolls it back.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
from dataclasses import dataclass

import fsspec
import polars as pl

from nightshift.publish import canary as canaries
from nightshift.publish import registry
from nightshift.publish.publish import rollback
from nightshift.publish.recover import reconcile
from nightshift.route.client import RouteClient
from nightshift.trainer.checkpoint import MANIFEST

from . import gatelog
from .versions import BASE, NoTransitions, calls, trajectory_rewards
from .watch_settings import WatchSettings

log = logging.getLogger("nightshift.judge.watch")


@dataclass
class Verdict:
    decision: str  # "worse", "better", "wait" (not enough evidence yet), "too_few"
    candidate: str
    baseline: str
    n_candidate: int
    n_baseline: int
    diff: float | None  # candidate mean - baseline mean
    p_value: float  # always-valid
    why: str
    low: float | None = None  # the always-valid confidence sequence of `diff` at 1 - alpha
    high: float | None = None
    action: str = ""  # what the watch did about it: "rolled back", "canary stopped", "promoted", ...


def msprt(a: list[float], b: list[float], tau: float = 0.1) -> tuple[float, float, float]:
    """(mean(b) - mean(a), the mixture likelihood ratio Lambda, the variance v of
    that difference) of samples `a`, `b`."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / max(na - 1, 1)
    vb = sum((x - mb) ** 2 for x in b) / max(nb - 1, 1)
    v = max(va / na + vb / nb, 1e-12)
    d = mb - ma
    t2 = tau * tau
    log_lam = 0.5 * math.log(v / (v + t2)) + d * d * t2 / (2 * v * (v + t2))
    return d, math.exp(min(log_lam, 700.0)), v


def radius(v: float, tau: float, alpha: float) -> float:
    """Half the width of the always-valid confidence sequence (module docstring)."""
    t2 = tau * tau
    return math.sqrt(2 * v * (v + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((v + t2) / v)))


def judge(baseline: list[float], candidate: list[float], *, alpha: float = 0.01, tau: float = 0.1,
          min_trajectories: int = 30, names: tuple[str, str] = ("baseline", "candidate")) -> Verdict:
    """Compare the candidate's rewards with the baseline's (any order of arrival)."""
    base, cand = names
    if len(baseline) < min_trajectories or len(candidate) < min_trajectories:
        return Verdict("too_few", cand, base, len(candidate), len(baseline), None, 1.0,
                       f"{len(candidate)} and {len(baseline)} rated trajectories; {min_trajectories} each needed")
    d, lam, v = msprt(baseline, candidate, tau)
    p = min(1.0, 1.0 / lam)
    r = radius(v, tau, alpha)
    band = f"[{d - r:+.3f}, {d + r:+.3f}]"
    if lam >= 1.0 / alpha:
        decision = "worse" if d < 0 else "better"
        why = (f"{cand} {'below' if d < 0 else 'above'} {base} by {abs(d):.3f} (always-valid p {p:.4f} < {alpha}; "
               f"difference within {band})")
    else:
        decision = "wait"
        why = f"difference {d:+.3f} within {band}, always-valid p {p:.3f} (>= {alpha}): not yet decided"
    return Verdict(decision, cand, base, len(candidate), len(baseline), d, p, why, d - r, d + r)


def rewards_of(trajectories: pl.DataFrame, version: str, since: dt.datetime | None = None) -> list[float]:
    """The rated trajectories' rewards of one version (`versions.trajectory_rewards`),
    those that started at `since` or later when given."""
    mine = trajectories.filter((pl.col("version") == version) & pl.col("reward").is_not_null())
    if since is not None:
        mine = mine.filter(pl.col("start") >= since)
    return mine["reward"].to_list()


def serving_and_before(entries: list[dict], endpoint: str, name: str) -> tuple[dict | None, dict | None]:
    """The publication serving `name` on `endpoint`, and the one it replaced (a
    different version), from the registry's entries; canaries are not publications here."""
    mine = [e for e in registry.lane(entries, endpoint, name) if e.get("role") not in registry.CANARY_ROLES]
    if not mine:
        return None, None
    now = mine[-1]
    before = next((e for e in reversed(mine[:-1]) if e.get("version") != now.get("version")), None)
    return now, before


def _record(checkpoints: str, v: Verdict, alpha: float, action: str, **extra) -> None:
    v.action = action
    gatelog.append(checkpoints, {
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": "watch",
        "candidate": v.candidate, "baseline": v.baseline, "decision": v.decision, "diff": v.diff, "low": v.low,
        "high": v.high, "p_value": v.p_value, "n_candidate": v.n_candidate, "n_baseline": v.n_baseline,
        "alpha": alpha, "why": v.why, "action": action, **extra})


def _exists(checkpoint: str) -> bool:
    try:
        fs, path = fsspec.core.url_to_fs(f"{checkpoint.rstrip('/')}/{MANIFEST}")
        return bool(checkpoint) and fs.exists(path)
    except Exception:  # noqa: BLE001 - a store that cannot be asked: try the promotion, which says why it fails
        return True


def _time(text: str) -> dt.datetime:
    t = dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def watch(data: str, checkpoints: str, settings, watching: WatchSettings | None = None,
          canary: canaries.CanarySettings | None = None, *, act: bool = True,
          now: dt.datetime | None = None, **publish_kw) -> tuple[Verdict | None, list[str]]:
    """Judge what production has said since the last look, and act on it: stop or
    promote a running canary, or roll back a serving version worse than the one
    before it (the verified publish path). Every decision is recorded in
    `<checkpoints>/gate-log.jsonl`. `settings`: a `PublishSettings`.

    The registry is read whole first: one it cannot use is refused
    (`registry.RegistryError`), since every decision here could move the server.
    A change an earlier run left pending is finished or undone before the look
    (a dry run only says so)."""
    w = watching or WatchSettings()
    c = canary or canaries.CanarySettings()
    doc = registry.load(checkpoints)
    pre: list[str] = []
    if doc.pending is not None and act:
        pre = reconcile(checkpoints, api_key=settings.api_key, timeout=settings.timeout, retries=settings.retries,
                        route=RouteClient(c.route_url, c.route_token) if c.route_url else None)
        doc = registry.load(checkpoints)
    elif doc.pending is not None:
        pre = [f"{registry.path_of(checkpoints)} records an interrupted change ({doc.pending.get('op')}) as pending: "
               "the next watch without --dry-run, publish or rollback finishes or undoes it"]
    entries = doc.entries
    trial = registry.canary(entries, settings.vllm_url, settings.name)
    if trial is not None:
        v, out = _watch_canary(data, checkpoints, settings, w, c, trial, act, now or dt.datetime.now(dt.timezone.utc),
                               publish_kw, entries)
        return v, pre + out
    v, out = _watch_serving(data, checkpoints, settings, w, entries, act, publish_kw)
    return v, pre + out


def _watch_serving(data: str, checkpoints: str, settings, w: WatchSettings, entries: list[dict], act: bool,
                   publish_kw: dict) -> tuple[Verdict | None, list[str]]:
    now_entry, before = serving_and_before(entries, settings.vllm_url, settings.name)
    if now_entry is None:
        return None, [f"nothing to compare: {settings.name!r} on {settings.vllm_url} has no publication "
                      f"(see {checkpoints}/published.json)"]
    # the first version replaced the base model: judged against the base's calls
    cand, base = now_entry["version"], before["version"] if before else BASE
    try:
        trajectories = trajectory_rewards(calls(data))
    except NoTransitions as e:
        return None, [f"watch: nothing to judge {cand} by: {e}"]
    v = judge(rewards_of(trajectories, base), rewards_of(trajectories, cand), alpha=w.alpha, tau=w.tau,
              min_trajectories=w.min_trajectories, names=(base, cand))
    out = [f"watch: {cand} (serving) against {base}: {v.decision}: {v.why}"]
    log.warning("watch: %s against %s: %s (%s)", cand, base, v.decision, v.why)
    rolled = None
    if v.decision == "worse" and before is None:
        # a LoRA server has no adapter that is the base: the stable name cannot go back to it
        out.append(f"  {cand} stays: the base model cannot be served under the stable name; a first version "
                   "is best judged as a canary (nightly.canary.share) before it takes all traffic")
        if act:
            _record(checkpoints, v, w.alpha, rolled_back_to=None, action="kept: nothing published before it")
        return v, out
    if v.decision == "worse" and act:
        kw = {**settings.kwargs(), **publish_kw}
        kw.pop("mode")
        res = rollback(checkpoints, settings.vllm_url, **kw)
        rolled = res.version
        out += [f"rolled back: {cand} -> {rolled}"] + ["  " + x for x in res.lines()]
    if act and v.decision in ("worse", "better"):  # a dry run says what it would do, and records nothing
        _record(checkpoints, v, w.alpha, rolled_back_to=rolled, action="rolled back" if rolled else "kept")
    elif not act and v.decision == "worse":
        out.append(f"  would roll {cand} back (dry run)")
    return v, out


def canary_action(v: Verdict, hours: float, w: WatchSettings, c: canaries.CanarySettings) -> str | None:
    """What a look at a canary decides: "stop" (worse), "promote" (better, or not
    worse by more than `w.margin`: the confidence sequence's lower end above
    -margin, as valid at this look as at any), "expire" (undecided after
    `c.max_hours`: the serving version keeps everything, and the candidate is not
    held against anyone), or None (keep watching)."""
    if v.decision == "worse":
        return "stop"
    if v.decision == "better" or v.decision == "wait" and v.low is not None and v.low >= -w.margin:
        return "promote"
    if hours >= c.max_hours:
        return "expire"
    return None


def _watch_canary(data: str, checkpoints: str, settings, w: WatchSettings, c: canaries.CanarySettings, trial: dict,
                  act: bool, now: dt.datetime, publish_kw: dict,
                  entries: list[dict]) -> tuple[Verdict | None, list[str]]:
    cand, base = trial["version"], trial.get("serving") or BASE
    started = _time(trial["time"])
    hours = (now - started).total_seconds() / 3600
    serving = registry.serving(entries, settings.vllm_url, settings.name)
    if serving is not None and serving.get("version") == cand and _time(serving["time"]) >= started:
        # promoted by a release that recorded the publication apart from the canary's end: close it as promoted
        v = Verdict("better", cand, base, 0, 0, None, 1.0, f"{cand} already serves: its canary is closed")
        return v, canaries.promote(trial, checkpoints, settings, c, v.why, **publish_kw) if act else [v.why]
    try:
        trajectories = trajectory_rewards(calls(data))
    except NoTransitions as e:
        return None, [f"watch: nothing to judge canary {cand} by: {e}"]
    # side by side over the same hours: the serving arm's trajectories from the canary's first call on, by
    # the agents' own clock (the one both arms' calls are stamped with), not this machine's, which may be skewed
    first = trajectories.filter(pl.col("version") == cand)["start"].min()
    v = judge(rewards_of(trajectories, base, first if first is not None else started), rewards_of(trajectories, cand),
              alpha=w.alpha, tau=w.tau, min_trajectories=w.min_trajectories, names=(base, cand))
    share = 100 * float(trial.get("share") or 0)
    out = [f"watch: canary {cand} ({share:.0f} % of conversations, {hours:.1f} h) against {base}: {v.decision}: {v.why}"]
    log.warning("watch: canary %s against %s after %.1f h: %s (%s)", cand, base, hours, v.decision, v.why)
    action = canary_action(v, hours, w, c)
    if action == "promote" and v.decision == "wait":
        v.why = (f"not worse than {base} by more than the margin {w.margin:g}: the difference {v.diff:+.3f} lies in "
                 f"[{v.low:+.3f}, {v.high:+.3f}] at confidence {1 - w.alpha:g}")
    elif action == "expire":
        v.why = (f"undecided after {hours:.1f} h (canary.max_hours {c.max_hours:g}): {v.why}; {base} keeps every "
                 "conversation")
    if action is None:
        return v, out
    if act and action == "promote" and not _exists(trial.get("checkpoint", "")):
        action, v.why = "expire", f"{v.why}; but its folder {trial.get('checkpoint')} is gone: it cannot be promoted"
        out.append(f"  {cand}'s checkpoint folder was deleted: the canary is ended instead of promoted")
    if act:
        if action == "promote":
            out += canaries.promote(trial, checkpoints, settings, c, v.why, **publish_kw)
        else:
            out += canaries.stop(trial, checkpoints, settings, c, v.why, outcome="stopped" if action == "stop"
                                 else "expired")
        _record(checkpoints, v, w.alpha, canary=True, action={"stop": "canary stopped", "expire": "canary expired",
                                                               "promote": "promoted"}[action],
                rolled_back_to=base if action == "stop" else None, hours=round(hours, 2))
    else:
        out.append(f"  would {action} the canary (dry run)")
    return v, out
