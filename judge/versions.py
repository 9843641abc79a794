"""How each published version does in production: its calls, its rewarded
trajectories and their mean reward with a 95 % interval, per agent and in total,
and, when traffic has a weekly shape, the version before it over the same hours
of the week.

The evidence is the transitions dataset itself: every row names the version that
produced it (`policy_version`, from the model name the server answered with), and
feedback that arrives late is in the next build's rewards, so it counts when it
arrives. A trajectory's reward is its outcome: the reward of its last rated step
(what every credit strategy gives the last call). A trajectory served by several
versions (it crossed a publication) counts for the version of its first call.
Calls are attributed by `policy_version`, never by time: a call stamped hours off
by an agent host's clock still counts for the version that made it.

Left out of every mean, and counted: trajectories with no rated step, and those
whose outcome is NaN or infinite (a broken judge; an earlier step's reward is not
taken in its place). A `policy_version` that `published.json` does not name
(`unknown`), or that is not `vNNNN` at all (`malformed`), keeps a row of its own:
it is never merged into another version or the base.

When was a version serving? From `<checkpoints>/published.json` when the
checkpoints folder is given: from each publication of it to the next publication
on the same endpoint and name, by the clock of the machine that published, which
no agent's clock can move. Without it, from what the transitions show: the first
and last call, trimmed (the 1st and 99th percentiles of its trajectories' first
calls), so that a few calls stamped by a skewed clock do not move it.

Weekly shape. A version published on a Monday and judged on its first three days
against its predecessor's whole life compares Monday-to-Wednesday traffic with a
mix of every day; if users, tasks or the agent mix differ by weekday, that
difference is read as the versions'. Traffic is taken to have a weekly shape when
the mean reward differs by weekday *within* versions: for each version with at
least two weekdays of `MIN_PER_DAY` rated trajectories, a one-way analysis of
variance of its trajectory rewards by weekday (between-weekday sum of squares over
the pooled within-weekday variance: chi-square with k - 1 degrees of freedom for
samples of this size), summed over versions (independent samples, so the sum is
chi-square with the summed degrees of freedom), and shaped at p < `SHAPE_ALPHA`.
Within versions, so that a better version serving on different days is not
mistaken for a weekday effect; on the reward, because that is what biases the
comparison: an agent mix that shifts by weekday matters only if those agents'
rewards differ, and then the weekday means of all agents together differ too.
One aggregation in Polars, whatever the size of the data. Within a version a
trend over its first days reads as a weekday effect too; restricting the
baseline is then harmless (the same comparison, on fewer trajectories).
When it is shaped, each version is shown beside its predecessor restricted to the
hours of the week (UTC) the version served ("matched"), unless it served all 168.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from dataclasses import dataclass, field

import polars as pl

from nightshift.prompts.versions import interval  # one 95 % interval for adapters and prompts
from nightshift.publish import registry
from nightshift.schemas import layout

#: Fewer rewarded trajectories than this and a version gets no interval, only a count.
MIN_TRAJECTORIES = 30
BASE = registry.BASE  # calls no published version made: the base model, or a hosted one
ALL = "(all)"
#: the weekly-shape test: its level, and the rated trajectories a weekday of a version needs to take part
SHAPE_ALPHA = 0.01
MIN_PER_DAY = 5
#: trimmed share at each end of a version's first calls when its serving time comes from the transitions
TRIM = 0.01
WEEK_HOURS = 168
VERSION_NAME = re.compile(r"^v\d+$")  # what `transform.calls.policy_version` writes
READER = "nightshift versions"


class NoTransitions(FileNotFoundError):
    """Nothing built yet under the data root: said, never a traceback."""


def calls(data: str, since: str = "", storage_options: dict | None = None) -> pl.DataFrame:
    """The columns of the transitions dataset this module reads, one scan, one row per call;
    every file checked first (`layout.LayoutError`: its version, the columns schemas/ declares)."""
    layout.check_dataset(data, layout.TRANSITIONS, READER, storage_options)
    tr = pl.scan_parquet(layout.files(data, layout.TRANSITIONS), hive_partitioning=True,
                         storage_options=storage_options or None, missing_columns="insert")
    if since:
        tr = tr.filter(pl.col("start_time") >= pl.lit(since).str.to_datetime(time_zone="UTC"))
    try:
        return tr.select("trajectory_id", "step", "agent_name", "policy_version", "reward", "start_time",
                         pl.coalesce("response_model", "model").alias("served_as")).collect()
    except (FileNotFoundError, pl.exceptions.ComputeError) as e:
        if "expanded paths were empty" in str(e) or isinstance(e, FileNotFoundError):
            raise NoTransitions(f"no transitions under {data} yet (run `nightshift build`)") from None
        raise


def trajectory_rewards(rows: pl.DataFrame) -> pl.DataFrame:
    """One row per trajectory of `calls(...)`: `trajectory_id`, `version`, `agents` (the
    agents whose calls it holds), `reward` (null when unrated or not finite), `bad`
    (its outcome is NaN or infinite), `start` (its first call)."""
    out = rows.sort("trajectory_id", "step").group_by("trajectory_id", maintain_order=True).agg(
        pl.col("policy_version").first().fill_null(BASE).alias("version"),
        pl.col("agent_name").drop_nulls().unique(maintain_order=True).alias("agents"),
        pl.col("reward").drop_nulls().last().alias("outcome"),
        pl.col("start_time").min().alias("start"),
    )
    finite = pl.col("outcome").is_finite().fill_null(False)
    return out.with_columns(pl.when(finite).then(pl.col("outcome")).alias("reward"),
                            (pl.col("outcome").is_not_null() & ~finite).alias("bad")).drop("outcome")


@dataclass
class Served:
    """When a version was serving, and where that was read."""

    since: dt.datetime | None
    until: dt.datetime | None  # None: still serving (from published.json)
    source: str  # "published.json" or "calls"
    hours: frozenset[int] = frozenset()  # hours of the week (0: Monday 00:00 UTC) it served

    def line(self) -> str:
        fmt = (lambda t: t.strftime("%Y-%m-%d %H:%M") if t else "?")
        end = fmt(self.until) if self.until else "now (serving)"
        what = "published.json" if self.source == "published.json" else "first and last call, trimmed"
        return f"served {fmt(self.since)} - {end} UTC ({what}; {len(self.hours)} of 168 hours of the week)"


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
    nonfinite: int = 0  # trajectories whose outcome is NaN or infinite: left out of the mean
    tags: list[str] = field(default_factory=list)  # unknown, malformed, folder deleted, rolled back
    served: Served | None = None  # on the "(all)" row
    baseline: str | None = None  # the version before it (publish order)
    matched: VersionStats | None = None  # the baseline over the hours of the week this version served

    @property
    def label(self) -> str:
        return self.version if self.version.strip() else repr(self.version)

    @property
    def too_few(self) -> bool:
        return self.mean is not None and self.low is None

    def figure(self, min_trajectories: int = MIN_TRAJECTORIES) -> str:
        if self.mean is None:
            return "no rewarded trajectories"
        what = "success" if self.binary else "reward"
        if self.low is None:
            return f"{what} {self.mean:.3f} (too few rated trajectories for an interval: {min_trajectories} needed)"
        return f"{what} {self.mean:.3f}  [{self.low:.3f}, {self.high:.3f}]"

    def line(self, min_trajectories: int = MIN_TRAJECTORIES) -> str:
        head = f"{self.label[:10]:<10} {self.agent:<16} {self.calls:>8,} {self.trajectories:>8,} {self.rated:>8,}"
        return head + "   " + self.figure(min_trajectories)

    def details(self, min_trajectories: int = MIN_TRAJECTORIES) -> list[str]:
        """The lines under this row: what it is, when it served, what was left out, its matched baseline."""
        pad = " " * 11
        out = [pad + t for t in self.tags]
        if self.served:
            out.append(pad + self.served.line())
        unrated = self.trajectories - self.rated - self.nonfinite
        left = [f"{unrated:,} unrated"] if unrated else []
        left += [f"{self.nonfinite:,} with a NaN/inf reward"] if self.nonfinite else []
        if left:
            out.append(pad + "left out of the mean: " + ", ".join(left) + " (trajectories)")
        if self.matched is not None and not self.matched.trajectories:
            out.append(f"{pad}{self.matched.label} served none of these hours of the week: no matched comparison")
        elif self.matched is not None:
            m = self.matched
            out.append(f"{pad}{m.label} over the same hours of the week: {m.trajectories:,} trajs, {m.rated:,} rated   "
                       + m.figure(min_trajectories))
        return out


class VersionTable(list):
    """`by_version`'s rows (a list of `VersionStats`), with the notes that go with them."""

    def __init__(self, rows=(), shape: WeeklyShape | None = None, notes: list[str] | None = None):
        super().__init__(rows)
        self.shape = shape
        self.notes = notes or []


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for X chi-square with `k` (integer) degrees of freedom, in closed form."""
    if k <= 0 or x <= 0 or math.isnan(x):
        return 1.0
    if math.isinf(x):
        return 0.0
    h = x / 2
    if k % 2 == 0:
        total = sum(math.exp(i * math.log(h) - math.lgamma(i + 1) - h) for i in range(k // 2))
    else:
        total = math.erfc(math.sqrt(h)) + sum(math.exp((i - 0.5) * math.log(h) - math.lgamma(i + 0.5) - h)
                                              for i in range(1, (k - 1) // 2 + 1))
    return min(1.0, max(0.0, total))


@dataclass
class WeeklyShape:
    shaped: bool
    chi2: float
    df: int
    p: float
    versions: int  # versions that took part (two weekdays or more with MIN_PER_DAY rated trajectories)

    def line(self) -> str:
        if self.df == 0:
            return (f"weekly shape: cannot tell (no version has {MIN_PER_DAY} rated trajectories on two weekdays); "
                    "versions compared over their whole periods")
        test = f"chi-square {self.chi2:.1f} on {self.df} df over {self.versions} version(s), p {self.p:.2g}"
        if self.shaped:
            return (f"weekly shape: yes, mean reward differs by weekday within versions ({test}); each version is "
                    "shown beside the one before it over the same hours of the week it served")
        return f"weekly shape: not seen ({test}); versions compared over their whole periods"


def weekly_shape(trajs: pl.DataFrame, alpha: float = SHAPE_ALPHA, min_per_day: int = MIN_PER_DAY) -> WeeklyShape:
    """Does mean reward differ by weekday within versions? (The module's docstring says why this test.)"""
    days = (trajs.filter(pl.col("reward").is_not_null() & pl.col("start").is_not_null())
            .group_by("version", pl.col("start").dt.weekday().alias("day"))
            .agg(pl.len().alias("n"), pl.col("reward").mean().alias("m"),
                 (pl.col("reward").var(ddof=0) * pl.len()).alias("ss"))
            .filter(pl.col("n") >= min_per_day))
    per = (days.group_by("version").agg(pl.len().alias("k"), pl.col("n").sum().alias("N"), pl.col("ss").sum().alias("ss"),
                                        ((pl.col("n") * pl.col("m")).sum() / pl.col("n").sum()).alias("grand"),
                                        pl.col("n"), pl.col("m"))
           .filter((pl.col("k") >= 2) & (pl.col("N") > pl.col("k"))))
    chi2, df = 0.0, 0
    for r in per.iter_rows(named=True):
        between = sum(n * (m - r["grand"]) ** 2 for n, m in zip(r["n"], r["m"]))
        within = r["ss"] / (r["N"] - r["k"])
        chi2 += between / within if within > 0 else (math.inf if between > 1e-12 else 0.0)
        df += r["k"] - 1
    p = chi2_sf(chi2, df)
    return WeeklyShape(df > 0 and p < alpha, chi2, df, p, per.height)


def _stats(version: str, agent: str, calls: int, trajs: pl.DataFrame, min_trajectories: int) -> VersionStats:
    rewards = trajs["reward"].drop_nulls().to_list()
    binary = bool(rewards) and all(r in (0.0, 1.0) for r in rewards)
    mean = sum(rewards) / len(rewards) if rewards else None
    low = high = None
    if len(rewards) >= min_trajectories:
        low, high = interval(rewards, binary)
    return VersionStats(version, agent, calls, trajs.height, len(rewards), mean, low, high, binary,
                        nonfinite=int(trajs["bad"].sum()) if "bad" in trajs.columns else 0)


def _hour_of_week(col: str) -> pl.Expr:
    return (pl.col(col).dt.weekday().cast(pl.Int16) - 1) * 24 + pl.col(col).dt.hour().cast(pl.Int16)


def week_hours(since: dt.datetime, until: dt.datetime) -> set[int]:
    """The hours of the week (0: Monday 00:00 UTC) that [since, until) touches (at least since's)."""
    if until - since >= dt.timedelta(days=7):
        return set(range(WEEK_HOURS))
    t = since.astimezone(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    out = {t.weekday() * 24 + t.hour}
    while t < until and len(out) < WEEK_HOURS:
        out.add(t.weekday() * 24 + t.hour)
        t += dt.timedelta(hours=1)
    return out


def _time(s) -> dt.datetime | None:
    try:
        t = dt.datetime.fromisoformat(str(s))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def _number(v: str) -> int:
    return int(v[1:]) if VERSION_NAME.match(v) else -1


@dataclass
class _Publications:
    """What `published.json` says about each version: publish order, serving intervals,
    the version each replaced, which were rolled back."""

    order: list[str]
    intervals: dict[str, list[tuple[dt.datetime, dt.datetime | None]]]
    before: dict[str, str]
    rolled_back: dict[str, str]  # version -> "rolled back to v0002 at 2026-11-22T00:00" / "canary stopped at ..."

    @classmethod
    def read(cls, entries: list[dict]) -> _Publications:
        order: list[str] = []
        intervals: dict[str, list] = {}
        before: dict[str, str] = {}
        rolled: dict[str, str] = {}
        # one endpoint and adapter name: what served it, in order; canaries (a share of the
        # traffic beside what serves) on a lane of their own, ended by their canary_end
        lanes: dict[tuple, list[dict]] = {}
        for e in entries:
            v = str(e.get("version") or "")
            if not v:
                continue
            role = e.get("role")
            is_canary = role in ("canary", "canary_end")
            lane = (e.get("endpoint"), str(e.get("name") or "").split("@")[0], is_canary)
            past = lanes.setdefault(lane, [])
            if role != "canary_end":
                if v not in order:
                    order.append(v)
                if v not in before:
                    serving = lanes.get(lane[:2] + (False,), [])
                    before[v] = (str(e.get("serving") or BASE) if is_canary else
                                 next((p["version"] for p in reversed(serving) if p.get("version") != v), BASE))
            elif e.get("outcome") in ("stopped", "expired"):
                rolled[v] = f"canary {e['outcome']} at {str(e.get('time') or '?')[:16]}"
            past.append(e)
            if e.get("rollback_of"):
                rolled[str(e["rollback_of"])] = f"rolled back to {v} at {str(e.get('time') or '?')[:16]}"
        for past in lanes.values():
            for e, nxt in zip(past, past[1:] + [None]):
                start = _time(e.get("time"))
                if start is None or e.get("role") == "canary_end":
                    continue
                intervals.setdefault(str(e["version"]), []).append((start, _time(nxt.get("time")) if nxt else None))
        return cls(order, intervals, before, rolled)


def _read_registry(checkpoints: str, storage_options: dict | None) -> tuple[list[dict] | None, list[str]]:
    """A report only reads: entries it cannot use are skipped and said, and a file it
    cannot use at all is read as absent (serving times from the calls)."""
    entries, notes = registry.read_lenient(checkpoints, storage_options)
    return (entries if entries or not notes else None), notes


def _deleted(checkpoints: str, versions: list[str], storage_options: dict | None) -> set[str]:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(checkpoints, **(storage_options or {}))
        return {v for v in versions if not fs.exists(f"{root.rstrip('/')}/{v}")}
    except Exception:  # noqa: BLE001 - a checkpoints folder that cannot be listed: nothing said about folders
        return set()


def by_version(data: str, since: str = "", min_trajectories: int = MIN_TRAJECTORIES,
               storage_options: dict | None = None, *, checkpoints: str | None = None,
               rows: pl.DataFrame | None = None) -> VersionTable:
    """Per version (the base first, then in publish order: `published.json`'s when
    `checkpoints` is given, else by number; unknown and malformed versions last),
    every agent together and then each agent. `rows`: `calls(...)` already read."""
    rows = calls(data, since, storage_options) if rows is None else rows
    trajs = trajectory_rewards(rows)
    per_call = rows.select(pl.col("policy_version").fill_null(BASE).alias("version"), "agent_name", "start_time",
                           "served_as")
    seen = trajs["version"].unique().to_list()
    notes: list[str] = []
    entries = None
    if checkpoints:
        entries, problems = _read_registry(checkpoints, storage_options)
        notes += problems
        if entries == []:
            notes.append(f"no {checkpoints}/published.json: no version can be checked against it")
            entries = None
    pubs = _Publications.read(entries) if entries else None

    malformed = sorted(v for v in seen if v != BASE and not VERSION_NAME.match(v))
    unknown = sorted((v for v in seen if v != BASE and VERSION_NAME.match(v) and pubs and v not in pubs.order),
                     key=_number)
    if pubs:
        known = [v for v in pubs.order if v in seen]
    else:
        known = sorted((v for v in seen if v != BASE and VERSION_NAME.match(v)), key=_number)
    order = ([BASE] if BASE in seen else []) + known + unknown + malformed

    # when each version served
    bounds = (trajs.filter(pl.col("start").is_not_null()).group_by("version").agg(
        pl.col("start").dt.epoch("us").quantile(TRIM, "lower").alias("lo"),
        pl.col("start").dt.epoch("us").quantile(1 - TRIM, "higher").alias("hi")))
    trimmed = {r["version"]: (dt.datetime.fromtimestamp(r["lo"] / 1e6, dt.timezone.utc),
                              dt.datetime.fromtimestamp(r["hi"] / 1e6, dt.timezone.utc))
               for r in bounds.iter_rows(named=True) if r["lo"] is not None}
    served: dict[str, Served] = {}
    for v in known:
        if pubs and pubs.intervals.get(v):
            ivs = pubs.intervals[v]
            last_call = trimmed.get(v, (None, None))[1]
            hours: set[int] = set()
            for a, b in ivs:  # an open interval: to its last call (the hour of that call included)
                hours |= week_hours(a, b or max(a, last_call or a) + dt.timedelta(microseconds=1))
            ends = [b for _, b in ivs]
            served[v] = Served(min(a for a, _ in ivs), None if None in ends else max(ends), "published.json",
                               frozenset(hours))
        elif v in trimmed:
            a, b = trimmed[v]
            served[v] = Served(a, b, "calls", frozenset(week_hours(a, b + dt.timedelta(microseconds=1))))
    before = {v: (pubs.before.get(v, BASE) if pubs else (known[i - 1] if i else BASE)) for i, v in enumerate(known)}

    shape = weekly_shape(trajs)
    deleted = _deleted(checkpoints, known, storage_options) if checkpoints else set()  # not unknown: never there
    served_as = dict(per_call.filter(pl.col("served_as").is_not_null()).group_by("version")
                     .agg(pl.col("served_as").first()).iter_rows())
    hour_trajs = trajs.with_columns(_hour_of_week("start").alias("how"))
    hour_calls = per_call.with_columns(_hour_of_week("start_time").alias("how"))

    def tags(v: str) -> list[str]:
        out = []
        name = f" (served as {served_as[v]!r})" if v in served_as else ""
        if v in unknown:
            out.append(f"unknown: {v}{name} is not in published.json; counted on its own")
        if v in malformed:
            out.append(f"malformed version name {v!r}{name}: not vNNNN; counted on its own")
        if v in deleted:
            out.append(f"folder deleted: {checkpoints.rstrip('/')}/{v} is gone (figures from the transitions)")
        if pubs and v in pubs.rolled_back:
            out.append(pubs.rolled_back[v])
        return out

    def matched(v: str, agent: str | None) -> VersionStats | None:
        b = before.get(v)
        if not shape.shaped or b is None or b not in seen or v not in served:
            return None
        hours = served[v].hours
        if not hours or len(hours) >= WEEK_HOURS:
            return None
        bt = hour_trajs.filter((pl.col("version") == b) & pl.col("how").is_in(list(hours)))
        bc = hour_calls.filter((pl.col("version") == b) & pl.col("how").is_in(list(hours)))
        if agent:
            bt = bt.filter(pl.col("agents").list.contains(agent))
            bc = bc.filter(pl.col("agent_name") == agent)
        return _stats(b, agent or ALL, bc.height, bt, min_trajectories)

    out = []
    for v in order:
        mine = trajs.filter(pl.col("version") == v)
        vcalls = per_call.filter(pl.col("version") == v)
        s = _stats(v, ALL, vcalls.height, mine, min_trajectories)
        s.tags, s.served, s.baseline, s.matched = tags(v), served.get(v), before.get(v), matched(v, None)
        out.append(s)
        for agent in sorted(a for a in vcalls["agent_name"].drop_nulls().unique().to_list()):
            a = _stats(v, agent, vcalls.filter(pl.col("agent_name") == agent).height,
                       mine.filter(pl.col("agents").list.contains(agent)), min_trajectories)
            a.baseline, a.matched = before.get(v), matched(v, agent)
            out.append(a)
    odd = unknown + malformed
    if odd:
        n_calls = per_call.filter(pl.col("version").is_in(odd)).height
        n_rated = trajs.filter(pl.col("version").is_in(odd) & pl.col("reward").is_not_null()).height
        notes.append(f"unknown or malformed versions: {', '.join(repr(v) if v in malformed else v for v in odd)} "
                     f"({n_calls:,} calls, {n_rated:,} rated trajectories), each counted on its own, in no published "
                     "version's figures")
    if pubs:
        gone = [v for v in pubs.order if v not in seen and v in deleted]
        if gone:
            notes.append(f"published, no calls, folder deleted: {', '.join(gone)}")
    return VersionTable(out, shape, notes)


def lines(stats: list[VersionStats], min_trajectories: int = MIN_TRAJECTORIES) -> list[str]:
    shape = getattr(stats, "shape", None)
    head = f"{'version':<10} {'agent':<16} {'calls':>8} {'trajs':>8} {'rated':>8}   mean reward [95 % interval]"
    out = [shape.line()] if shape is not None else []
    out.append(head)
    for s in stats:
        out += [s.line(min_trajectories)] + s.details(min_trajectories)
    return out + list(getattr(stats, "notes", []))
