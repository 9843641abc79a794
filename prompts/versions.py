"""Which prompt versions each agent used, and how each did in production: calls,
trajectories, rated trajectories, and the mean reward with a 95 % interval (a
success rate with Wilson's interval when rewards are 0/1), as `nightshift
versions` does for adapters (the same statistics: `interval` lives here and judge/ imports it, since this stage does not
import publish/).

A version is `schemas.prompt_identity.PromptVersion`: the agent's leading system
messages, its per-request data folded by `schemas.prompt_template` (templates are
inferred per agent and per message position, over every prompt the agent sent in
the window), and its tools. A trajectory counts for the version of the agent's first call in it, and its
outcome is the reward of its last rated step over every agent's calls (what the
adapters' table takes); unrated trajectories and NaN/infinite outcomes are left
out of the mean and counted. Calls recorded without their messages (content
capture off) have no prompt to hash: counted per agent, in no version.

A call whose answer `nightshift route` marked (`prompt_seen`: it put a candidate in
place of the agent's prompt) counts for the candidate's version, the prompt the
model saw, not the one the agent's span recorded; which version the agent itself
sends (`current`) still reads the recorded prompt.

Two agents sending the same prompt get the same version id, each with its own
figures, and each row says which other agents share it: a change matched on the
id alone would change them all. `current` is the version of the agent's newest
call: what it sends now.
"""

from __future__ import annotations

import datetime as dt
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import polars as pl

from nightshift.schemas import prompt_ids
from nightshift.schemas.prompt_identity import PromptVersion, canonical_tools, tool_names
from nightshift.schemas.prompt_template import Template, infer, normalize, placeholders, resolve, templated

from . import lake

#: Fewer rated trajectories than this and a version gets no interval, only a count.
MIN_TRAJECTORIES = 30


def interval(values: list[float], binary: bool) -> tuple[float, float]:
    """95 % interval of a mean: Wilson's for success rates (honest near 0 and 1), the
    normal one with the sample variance otherwise (judge/versions.py uses it too)."""
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


@dataclass
class PromptStats:
    agent: str
    version: PromptVersion
    calls: int
    trajectories: int
    rated: int
    mean: float | None
    low: float | None  # None: too few rated trajectories for an interval
    high: float | None
    binary: bool
    nonfinite: int = 0
    first_seen: dt.datetime | None = None
    last_seen: dt.datetime | None = None
    renderings: int = 1  # distinct prompts as sent, folded into this template
    names: list[str] = field(default_factory=list)  # name@version as an instrumentation recorded it
    shared_with: list[str] = field(default_factory=list)  # other agents that send this same version
    current: bool = False
    model: str | None = None  # the model its newest call asked for

    @property
    def id(self) -> str:
        return self.version.id

    def figure(self, min_trajectories: int = MIN_TRAJECTORIES) -> str:
        if self.mean is None:
            return "no rated trajectories"
        what = "success" if self.binary else "reward"
        if self.low is None:
            return f"{what} {self.mean:.3f} (too few rated trajectories for an interval: {min_trajectories} needed)"
        return f"{what} {self.mean:.3f}  [{self.low:.3f}, {self.high:.3f}]"

    def as_dict(self) -> dict:
        return {"agent": self.agent, "version": self.id, "system_hash": self.version.system_hash,
                "system": list(self.version.system), "tools": tool_names(self.version.tool_list),
                "calls": self.calls, "trajectories": self.trajectories, "rated": self.rated, "mean": self.mean,
                "low": self.low, "high": self.high, "binary": self.binary, "nonfinite": self.nonfinite,
                "first_seen": self.first_seen.isoformat() if self.first_seen else None,
                "last_seen": self.last_seen.isoformat() if self.last_seen else None,
                "renderings": self.renderings, "slots": _slots(self.version), "names": self.names,
                "shared_with": self.shared_with, "current": self.current, "model": self.model}


def _slots(v: PromptVersion) -> list[str]:
    return placeholders(v.text)


@dataclass
class AgentPrompts:
    """One agent's prompt versions, oldest first, and what could not be hashed."""

    agent: str
    versions: list[PromptStats]
    no_content: int = 0  # calls recorded without their messages
    templates: dict[int, list[Template]] = field(default_factory=dict)  # per leading-message position

    @property
    def current(self) -> PromptStats | None:
        return next((v for v in self.versions if v.current), None)

    def get(self, version_id: str) -> PromptStats | None:
        return next((v for v in self.versions if v.id == version_id), None)

    def resolve(self, system: list[str], tools) -> PromptVersion:
        """The version one request's prompt is: its texts through this agent's templates."""
        return PromptVersion.of([resolve(t, self.templates.get(k, []))[0] for k, t in enumerate(system)],
                                canonical_tools(tools))


class PromptTable(list):
    """`by_agent`'s answer: a list of `AgentPrompts`, the per-call frame beside it
    (`frame`: each call's `version`, its trajectory's `outcome`) and notes."""

    def __init__(self, rows=(), frame: pl.DataFrame | None = None, notes: list[str] | None = None):
        super().__init__(rows)
        self.frame = frame
        self.notes = notes or []

    def agent(self, name: str) -> AgentPrompts | None:
        return next((a for a in self if a.agent == name), None)


def _stats(agent: str, version: PromptVersion, calls: pl.DataFrame, trajs: pl.DataFrame,
           min_trajectories: int) -> PromptStats:
    rewards = trajs["reward"].drop_nulls().to_list()
    binary = bool(rewards) and all(r in (0.0, 1.0) for r in rewards)
    mean = sum(rewards) / len(rewards) if rewards else None
    low = high = None
    if len(rewards) >= min_trajectories:
        low, high = interval(rewards, binary)
    return PromptStats(agent, version, calls.height, trajs.height, len(rewards), mean, low, high, binary,
                       int(trajs["bad"].sum()), calls["start_time"].min(), calls["start_time"].max(),
                       renderings=calls.select(pl.col("system_id").n_unique()).item())


def routed(version_id: str) -> PromptVersion:
    """A version the lake knows only by its id: a candidate the route put in, whose
    text lives in the candidate store (`by_agent(candidates=...)` gives it)."""
    return PromptVersion(version_id, (f"(candidate {version_id}, put in by nightshift route: its text is in the "
                                      "candidate store)",), (), "")


def assign(rows: pl.DataFrame, candidates: dict[str, PromptVersion] | None = None,
           ) -> tuple[pl.DataFrame, dict[str, dict[int, list[Template]]], dict[str, PromptVersion]]:
    """Each call's prompt version: templates inferred per agent and position over the
    calls' prompts (weighted by calls), then each distinct (agent, prompt, tools)
    resolved once. Returns the rows with `system_id`, `sent` (the version of the prompt
    recorded; null: no content) and `version` (the one the model saw: the route's
    candidate when it put one in, else `sent`), the templates, and the versions by id
    (`candidates`: the routed candidates' versions, when the caller read them)."""
    if "prompt_seen" not in rows.columns:
        rows = rows.with_columns(pl.lit(None, pl.String).alias("prompt_seen"))
    if "system_id" not in rows.columns:  # every row with its texts (a caller's own frame): its ids made here
        rows = rows.hstack(prompt_ids.ids(rows, pl.col("system"), pl.col("tools"), pl.col("content")))
    keys = ["agent", "system_id", "tools_id"]
    sent = rows.select(*keys, "system", "tools", "content").filter(pl.col("content"))  # (not every column copied)
    # the texts once per key: on its first row in `lake.calls`' rows, on every row in a full frame
    distinct = (sent.group_by(keys).len("n")
                .join(sent.filter(pl.col("system").is_not_null()).group_by(keys)
                      .agg(pl.col("system").first(), pl.col("tools").first().fill_null("")), on=keys, how="left")
                .sort(keys))
    texts: dict[tuple[str, int], Counter] = defaultdict(Counter)
    norm: dict[str, str] = {}  # each distinct text normalized once: the patterns are the cost here
    for r in distinct.iter_rows(named=True):
        for k, t in enumerate(r["system"]):
            if t not in norm:
                norm[t] = normalize(t)[0]
            texts[(r["agent"], k)][norm[t]] += r["n"]
    templates: dict[str, dict[int, list[Template]]] = defaultdict(dict)
    for (agent, k), counts in texts.items():
        templates[agent][k] = infer(counts)
    versions: dict[str, PromptVersion] = {}
    made: dict[tuple, PromptVersion] = {}
    ids = []
    for r in distinct.iter_rows(named=True):
        per = templates[r["agent"]]
        key = (tuple(templated(norm[t], per.get(k, [])) for k, t in enumerate(r["system"])), r["tools"])
        if key not in made:
            made[key] = PromptVersion.of(list(key[0]), canonical_tools(r["tools"] or None))
        v = made[key]
        versions[v.id] = v
        ids.append(v.id)
    mapping = distinct.select(keys).with_columns(pl.Series("version", ids, pl.String))
    out = rows.hstack(lake.beside(rows.select(keys), mapping, keys, ["version"], nulls_equal=True))
    out = out.with_columns(pl.when(pl.col("content")).then(pl.col("version")).alias("sent"))
    out = out.with_columns(pl.coalesce("prompt_seen", "sent").alias("version"))
    for vid in out["prompt_seen"].drop_nulls().unique().to_list():
        versions.setdefault(vid, (candidates or {}).get(vid) or routed(vid))
    return out, dict(templates), versions


def by_agent(data: str, since: str = "", storage_options: dict | None = None, *, agent: str | None = None,
             min_trajectories: int = MIN_TRAJECTORIES, names: bool = True,
             rows: pl.DataFrame | None = None, candidates: dict[str, PromptVersion] | None = None) -> PromptTable:
    """Every agent's prompt versions with their production figures (or one agent's).
    `names`: read the spans for the prompt names instrumentations recorded;
    `candidates`: the versions of candidates the route put in, by id (else shown by id)."""
    rows = lake.calls(data, since, storage_options) if rows is None else rows
    rows, templates, versions = assign(rows, candidates)
    # each trajectory's outcome over every agent's calls, then attributed per agent
    outcome = (rows.sort("trajectory_id", "step").group_by("trajectory_id", maintain_order=True)
               .agg(pl.col("reward").drop_nulls().last().alias("o")))
    finite = pl.col("o").is_finite().fill_null(False)
    outcome = outcome.select("trajectory_id", pl.when(finite).then(pl.col("o")).alias("outcome"),
                             (pl.col("o").is_not_null() & ~finite).alias("bad"))
    rows = rows.hstack(lake.beside(rows.select("trajectory_id"), outcome, "trajectory_id", ["outcome", "bad"]))
    firsts = (rows.filter(pl.col("version").is_not_null()).sort("trajectory_id", "step")
              .group_by("agent", "trajectory_id", maintain_order=True)
              .agg(pl.col("version").first(), pl.col("outcome").first().alias("reward"), pl.col("bad").first()))
    recorded: dict[str, list[str]] = defaultdict(list)
    if names:
        got = lake.prompt_names(data, rows.filter(pl.col("version").is_not_null())["span_id"].unique().to_list(),
                                storage_options)
        if got.height:
            named = rows.select("span_id", "version").join(got, on="span_id")
            for r in named.unique(["version", "prompt_name", "prompt_version"]).sort(
                    "prompt_name", "prompt_version", nulls_last=True).iter_rows(named=True):
                recorded[r["version"]].append(f"{r['prompt_name'] or '?'}@{r['prompt_version'] or '?'}")
    users: dict[str, set[str]] = defaultdict(set)
    for a, v in rows.filter(pl.col("version").is_not_null()).select("agent", "version").unique().iter_rows():
        users[v].add(a)
    out = []
    agents = sorted(rows["agent"].unique().to_list()) if agent is None else [agent]
    # split once (a filter per agent and version read every row each time: agents x rows)
    by_name = rows.select("agent", "version", "sent", "start_time", "step", "system_id", "model").partition_by(
        "agent", as_dict=True)
    trajs = firsts.partition_by("agent", "version", as_dict=True)
    no_trajs = firsts.clear()
    for name in agents:
        mine = by_name.get((name,))
        if mine is None or not mine.height:
            continue
        have = mine.filter(pl.col("version").is_not_null())
        sent = mine.filter(pl.col("sent").is_not_null())
        newest = sent.sort("start_time", "step", nulls_last=False).tail(1) if sent.height else None
        per_version = have.partition_by("version", as_dict=True)
        stats = []
        for vid in have.group_by("version").agg(pl.col("start_time").min().alias("t")).sort("t", "version")["version"]:
            vc = per_version[(vid,)]
            s = _stats(name, versions[vid], vc, trajs.get((name, vid), no_trajs), min_trajectories)
            s.names = recorded.get(vid, [])
            s.shared_with = sorted(users[vid] - {name})
            s.current = newest is not None and newest["sent"][0] == vid
            s.model = vc.sort("start_time").tail(1)["model"][0]
            stats.append(s)
        out.append(AgentPrompts(name, stats, mine.height - have.height, templates.get(name, {})))
    notes = []
    for v, tags in recorded.items():
        for tag in set(tags):
            spread = {vid for vid, ts in recorded.items() if tag in ts}
            if len(spread) > 1 and v == min(spread):
                notes.append(f"prompt {tag} was recorded with {len(spread)} different texts: per-request data the "
                             "template detection did not fold, or an instrumentation that reuses one version name")
    return PromptTable(out, rows, notes)


def lines(table: PromptTable, min_trajectories: int = MIN_TRAJECTORIES, width: int = 100) -> list[str]:
    """The table `nightshift prompts` prints."""
    out = []
    for a in table:
        calls = sum(v.calls for v in a.versions)
        out.append(f"agent {a.agent}: {len(a.versions)} prompt version(s), {calls:,} calls"
                   + (f" (and {a.no_content:,} recorded without their messages: content capture was off)"
                      if a.no_content else ""))
        if not a.versions:
            continue
        out.append(f"  {'version':<14} {'calls':>8} {'trajs':>8} {'rated':>8}   mean reward [95 % interval]")
        for v in a.versions:
            mark = "*" if v.current else " "
            out.append(f"{mark} {v.id:<14} {v.calls:>8,} {v.trajectories:>8,} {v.rated:>8,}   "
                       + v.figure(min_trajectories))
            pad = " " * 4
            when = (f"{pad}{v.first_seen:%Y-%m-%d %H:%M} - {v.last_seen:%Y-%m-%d %H:%M} UTC"
                    if v.first_seen and v.last_seen else pad.rstrip())
            extra = [f"model {v.model}"] if v.model else []
            slots = _slots(v.version)
            if v.renderings > 1 or slots:
                extra.append(f"{v.renderings:,} rendering(s) folded into one template"
                             + (f" (slots {', '.join('{{' + s + '}}' for s in slots)})" if slots else ""))
            if v.names:
                extra.append("recorded as " + ", ".join(v.names))
            out.append(when + ("; " + "; ".join(extra) if extra else ""))
            text = " ".join(v.version.text.split()) or "(no system prompt)"
            out.append(f'{pad}"{text[:width]}{"..." if len(text) > width else ""}"'
                       + (f" + tools {', '.join(tool_names(v.version.tool_list))}" if v.version.tools else ""))
            if v.shared_with:
                out.append(f"{pad}the same prompt is sent by agent(s) {', '.join(v.shared_with)}: a change matched on "
                           "this id alone would change theirs too")
            unrated = v.trajectories - v.rated - v.nonfinite
            left = [f"{unrated:,} unrated"] if unrated else []
            left += [f"{v.nonfinite:,} with a NaN/inf reward"] if v.nonfinite else []
            if left:
                out.append(f"{pad}left out of the mean: {', '.join(left)} (trajectories)")
    if any(a.versions for a in table):
        out.append("* = the version of the agent's newest call")
    return out + list(table.notes)
