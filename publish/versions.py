"""How each published version does in production: its calls, its rewarded
trajectories and their mean reward with a 95 % interval, per agent and in total.

The evidence is the transitions dataset itself: every row names the version that
produced it (`policy_version`, from the model name the server answered with), and
feedback that arrives late is in the next build's rewards, so it counts when it
arrives. A trajectory's reward is its outcome: the reward of its last rated step
(what every credit strategy gives the last call). A trajectory served by several
versions (it crossed a publication) counts for the version of its first call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl

#: Fewer rewarded trajectories than this and a version gets no interval, only a count.
MIN_TRAJECTORIES = 30
BASE = "base"  # calls no published version made: the base model, or a hosted one


def calls(data: str, since: str = "", storage_options: dict | None = None) -> pl.DataFrame:
    """The columns of the transitions dataset this module reads, one scan, one row per call."""
    tr = pl.scan_parquet(f"{data.rstrip('/')}/transitions/**/*.parquet", hive_partitioning=True,
                         storage_options=storage_options or None, missing_columns="insert")
    if since:
        tr = tr.filter(pl.col("start_time") >= pl.lit(since).str.to_datetime(time_zone="UTC"))
    return tr.select("trajectory_id", "step", "agent_name", "policy_version", "reward", "start_time").collect()


def trajectory_rewards(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per trajectory of `calls(...)`: `trajectory_id`, `version`, `agents` (the
    agents whose calls it holds), `reward` (null when unrated), `start` (its first call)."""
    return (rows.sort("trajectory_id", "step").group_by("trajectory_id", maintain_order=True).agg(
        pl.col("policy_version").first().fill_null(BASE).alias("version"),
        pl.col("agent_name").drop_nulls().unique(maintain_order=True).alias("agents"),
        pl.col("reward").filter(pl.col("reward").is_not_null() & pl.col("reward").is_finite()).last().alias("reward"),
        pl.col("start_time").min().alias("start"),
    ))


@dataclass
class VersionStats:
    version: str
    agent: str  # "(all)" for every agent together
    calls: int
    trajectories: int
    rated: int
    mean: float | None
    low: float | None  # 95 % interval of the mean reward; None with too few rated trajectories
    high: float | None
    binary: bool  # every reward 0 or 1: the mean is a success rate

    def line(self, min_trajectories: int = MIN_TRAJECTORIES) -> str:
        head = f"{self.version:<10} {self.agent:<16} {self.calls:>8,} {self.trajectories:>8,} {self.rated:>8,}"
        if self.mean is None:
            return head + "   no rewarded trajectories"
        what = "success" if self.binary else "reward"
        if self.low is None:
            return head + f"   {what} {self.mean:.3f} (too few rated trajectories for an interval: {min_trajectories} needed)"
        return head + f"   {what} {self.mean:.3f}  [{self.low:.3f}, {self.high:.3f}]"


def interval(values: list[float], binary: bool) -> tuple[float, float]:
    """95 % interval of a mean: Wilson's for success rates (honest near 0 and 1),
    the normal one with the sample variance otherwise."""
    n = len(values)
    mean = sum(values) / n
    z = 1.959964
    if binary:
        centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        return centre - half, centre + half
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    half = z * math.sqrt(var / n)
    return mean - half, mean + half


def _stats(version: str, agent: str, calls: int, trajs: pl.DataFrame, min_trajectories: int) -> VersionStats:
    rewards = trajs["reward"].drop_nulls().to_list()
    binary = bool(rewards) and all(r in (0.0, 1.0) for r in rewards)
    mean = sum(rewards) / len(rewards) if rewards else None
    low = high = None
    if len(rewards) >= min_trajectories:
        low, high = interval(rewards, binary)
    return VersionStats(version, agent, calls, trajs.height, len(rewards), mean, low, high, binary)


def by_version(data: str, since: str = "", min_trajectories: int = MIN_TRAJECTORIES,
               storage_options: dict | None = None) -> list[VersionStats]:
    """Per version (in version order, the base first), every agent together and then each agent."""
    rows = calls(data, since, storage_options)
    trajs = trajectory_rewards(rows)
    per_call = rows.select(pl.col("policy_version").fill_null(BASE).alias("version"), "agent_name")
    out = []
    order = sorted(trajs["version"].unique().to_list(), key=lambda v: (v != BASE, v))
    for v in order:
        mine = trajs.filter(pl.col("version") == v)
        vcalls = per_call.filter(pl.col("version") == v)
        out.append(_stats(v, "(all)", vcalls.height, mine, min_trajectories))
        for agent in sorted(a for a in vcalls["agent_name"].drop_nulls().unique().to_list()):
            out.append(_stats(v, agent, vcalls.filter(pl.col("agent_name") == agent).height,
                              mine.filter(pl.col("agents").list.contains(agent)), min_trajectories))
    return out


def lines(stats: list[VersionStats], min_trajectories: int = MIN_TRAJECTORIES) -> list[str]:
    head = f"{'version':<10} {'agent':<16} {'calls':>8} {'trajs':>8} {'rated':>8}   mean reward [95 % interval]"
    return [head] + [s.line(min_trajectories) for s in stats]
