"""Credit assignment (a trajectory's outcome spread over the calls that led to it)
and advantages (each call's return against a baseline).

identical  every call gets the outcome R (LightningRL's default).
discounted call t of T gets gamma**(T-1-t) * R: later calls more responsible.
last       only the last call gets R; the others carry no signal (null).
per_step   intermediate rewards go to the call that preceded them, R to the
           last call; each call's return is the discounted reward-to-go.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import polars as pl


@dataclass
class Credit:
    reward: float | None
    source: str | None
    ret: float | None


def assign(num_steps: int, outcome: float | None, outcome_source: str | None,
           step_rewards: dict[int, list[tuple[float, str]]], strategy: str, gamma: float) -> list[Credit]:
    """One `Credit` per step. `step_rewards`: intermediate rewards by the step they
    follow (only `per_step` uses them)."""
    T = num_steps
    if strategy == "per_step":
        rewards: list[float | None] = []
        sources: list[str | None] = []
        for t in range(T):
            got = step_rewards.get(t, []) if t < T - 1 else []
            r = sum(v for v, _ in got)
            src = got[0][1] if got else None
            if t == T - 1 and outcome is not None:
                r, src = r + outcome, outcome_source
            rewards.append(r)
            sources.append(src)
        if outcome is None and not any(step_rewards.values()):
            return [Credit(None, None, None) for _ in range(T)]
        out: list[Credit] = [Credit(None, None, None)] * T
        g = 0.0
        for t in range(T - 1, -1, -1):
            g = rewards[t] + gamma * g
            out[t] = Credit(rewards[t], sources[t], g)
        return out
    if outcome is None:
        return [Credit(None, None, None) for _ in range(T)]
    if strategy == "identical":
        return [Credit(outcome, outcome_source, outcome) for _ in range(T)]
    if strategy == "discounted":
        return [Credit(r, outcome_source, r) for r in (outcome * gamma ** (T - 1 - t) for t in range(T))]
    if strategy == "last":
        return [Credit(None, None, None)] * (T - 1) + [Credit(outcome, outcome_source, outcome)]
    raise ValueError(f"unknown credit strategy {strategy!r}")


def tool_errors(steps: list[dict], pattern: "re.Pattern[str]") -> list[bool]:
    """For each call, whether one of its tool calls came back as an error: the
    tool message answering it (by `tool_call_id`, in a later call's input) says so."""
    if not any((s.get("output_message") or {}).get("tool_calls") for s in steps):
        return [False] * len(steps)  # no call asked for a tool: none can have errored (most trajectories)
    results: dict[str, str] = {}
    for s in steps:
        for m in s.get("input_messages") or []:
            if m.get("role") == "tool" and m.get("tool_call_id") and m["tool_call_id"] not in results:
                results[m["tool_call_id"]] = m.get("content") or ""
    out = []
    for s in steps:
        calls = (s.get("output_message") or {}).get("tool_calls") or []
        out.append(any(c.get("id") in results and pattern.search(results[c["id"]]) for c in calls))
    return out


def penalize(credits: list[Credit], errored: list[bool], penalty: float) -> list[Credit]:
    """Lower the return (and reward) of calls whose tool call errored; calls the
    strategy left uncredited stay so."""
    return [Credit(c.reward - penalty if c.reward is not None else None, c.source, c.ret - penalty)
            if bad and c.ret is not None else c for c, bad in zip(credits, errored)]


def advantages(df: pl.DataFrame, baseline: str, normalize: bool, eps: float = 1e-6) -> pl.Series:
    """`return` minus a baseline, weighted by `weight` so each trajectory counts as
    its weights say. `df` needs `return`, `weight`, `group_id`, `trajectory_id`.

    group: the weighted mean return of the rows sharing `group_id`, when at least two
    trajectories share it; rows of single-trajectory groups fall back to the batch.
    batch: the weighted mean over every row with a return. none: the return itself.
    `normalize` divides by the same pool's weighted standard deviation (a pool with
    no spread gives advantage 0, never a division by zero)."""
    rated = pl.col("return").is_not_null()
    w = pl.when(rated).then(pl.col("weight")).otherwise(0.0)
    r = pl.col("return").fill_null(0.0)

    def stats(over: list[str] | None) -> tuple[pl.Expr, pl.Expr]:
        sw = w.sum() if over is None else w.sum().over(over)
        mean = (w * r).sum() if over is None else (w * r).sum().over(over)
        mean = mean / sw
        sq = (w * r * r).sum() if over is None else (w * r * r).sum().over(over)
        var = (sq / sw - mean * mean).clip(lower_bound=0.0)
        return mean, var.sqrt()

    if baseline == "none":
        adv = pl.col("return")
        if normalize:
            _, std = stats(None)
            adv = pl.when(std > eps).then(adv / std).otherwise(0.0)
        return df.select(pl.when(rated).then(adv).alias("advantage"))["advantage"]

    b_mean, b_std = stats(None)
    if baseline == "group":
        g_mean, g_std = stats(["group_id"])
        n_traj = pl.col("trajectory_id").filter(rated).n_unique().over("group_id")
        use_group = pl.col("group_id").is_not_null() & (n_traj >= 2)
        mean = pl.when(use_group).then(g_mean).otherwise(b_mean)
        std = pl.when(use_group).then(g_std).otherwise(b_std)
    else:
        mean, std = b_mean, b_std
    adv = pl.col("return") - mean
    if normalize:
        adv = pl.when(std > eps).then(adv / std).otherwise(0.0)
    return df.select(pl.when(rated).then(adv).alias("advantage"))["advantage"]
