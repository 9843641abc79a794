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
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from dataclasses import dataclass

import polars as pl

from . import registry
from .publish import rollback
from .versions import calls, trajectory_rewards

log = logging.getLogger("nightshift.publish.watch")


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


def msprt(a: list[float], b: list[float], tau: float = 0.1) -> tuple[float, float]:
    """(mean(b) - mean(a), the mixture likelihood ratio Lambda) of samples `a`, `b`."""
    na, nb = len(a), len(b)
    ma, mb = sum(a) / na, sum(b) / nb
    va = sum((x - ma) ** 2 for x in a) / max(na - 1, 1)
    vb = sum((x - mb) ** 2 for x in b) / max(nb - 1, 1)
    v = max(va / na + vb / nb, 1e-12)
    d = mb - ma
    t2 = tau * tau
    log_lam = 0.5 * math.log(v / (v + t2)) + d * d * t2 / (2 * v * (v + t2))
    return d, math.exp(min(log_lam, 700.0))


def judge(baseline: list[float], candidate: list[float], *, alpha: float = 0.01, tau: float = 0.1,
          min_trajectories: int = 30, names: tuple[str, str] = ("baseline", "candidate")) -> Verdict:
    """Compare the candidate's rewards with the baseline's (any order of arrival)."""
    base, cand = names
    if len(baseline) < min_trajectories or len(candidate) < min_trajectories:
        return Verdict("too_few", cand, base, len(candidate), len(baseline), None, 1.0,
                       f"{len(candidate)} and {len(baseline)} rated trajectories; {min_trajectories} each needed")
    d, lam = msprt(baseline, candidate, tau)
    p = min(1.0, 1.0 / lam)
    if lam >= 1.0 / alpha:
        decision = "worse" if d < 0 else "better"
        why = f"{cand} {'below' if d < 0 else 'above'} {base} by {abs(d):.3f} (always-valid p {p:.4f} < {alpha})"
    else:
        decision = "wait"
        why = f"difference {d:+.3f}, always-valid p {p:.3f} (>= {alpha}): not yet decided"
    return Verdict(decision, cand, base, len(candidate), len(baseline), d, p, why)


def rewards_of(trajectories: pl.DataFrame, version: str) -> list[float]:
    """The rated trajectories' rewards of one version (`versions.trajectory_rewards`)."""
    return trajectories.filter((pl.col("version") == version) & pl.col("reward").is_not_null())["reward"].to_list()


def serving_and_before(checkpoints: str, endpoint: str, name: str,
                       storage_options: dict | None = None) -> tuple[dict | None, dict | None]:
    """The publication serving `name` on `endpoint`, and the one it replaced (a
    different version), from the registry."""
    mine = [e for e in registry.read(checkpoints, storage_options)
            if e.get("endpoint") == endpoint.rstrip("/") and str(e.get("name", "")).startswith(f"{name}@")]
    if not mine:
        return None, None
    now = mine[-1]
    before = next((e for e in reversed(mine[:-1]) if e.get("version") != now.get("version")), None)
    return now, before


def watch(data: str, checkpoints: str, settings, *, alpha: float = 0.01, tau: float = 0.1,
          min_trajectories: int = 30, act: bool = True) -> tuple[Verdict | None, list[str]]:
    """Judge the serving version against the one before it; roll it back when it is
    worse (the verified publish path), and record the decision in
    `<checkpoints>/gate-log.jsonl`. `settings`: a `PublishSettings`."""
    now, before = serving_and_before(checkpoints, settings.vllm_url, settings.name)
    if now is None or before is None:
        return None, [f"nothing to compare: {settings.name!r} on {settings.vllm_url} has "
                      f"{'no publication' if now is None else 'one version only'} (see {checkpoints}/published.json)"]
    cand, base = now["version"], before["version"]
    trajectories = trajectory_rewards(calls(data))
    v = judge(rewards_of(trajectories, base), rewards_of(trajectories, cand), alpha=alpha, tau=tau,
              min_trajectories=min_trajectories, names=(base, cand))
    out = [f"watch: {cand} (serving) against {base}: {v.decision}: {v.why}"]
    log.warning("watch: %s against %s: %s (%s)", cand, base, v.decision, v.why)
    rolled = None
    if v.decision == "worse" and act:
        kw = settings.kwargs()
        kw.pop("mode")
        res = rollback(checkpoints, settings.vllm_url, **kw)
        rolled = res.version
        out += [f"rolled back: {cand} -> {rolled}"] + ["  " + x for x in res.lines()]
    if v.decision in ("worse", "better") or rolled:
        entry = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "kind": "watch",
                 "candidate": cand, "baseline": base, "decision": v.decision, "diff": v.diff, "p_value": v.p_value,
                 "n_candidate": v.n_candidate, "n_baseline": v.n_baseline, "alpha": alpha,
                 "rolled_back_to": rolled, "why": v.why}
        with open(f"{checkpoints.rstrip('/')}/gate-log.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
    return v, out
