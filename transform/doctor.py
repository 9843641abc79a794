"""`nightshift doctor`: what the stored spans would become, per service and agent,
and for each thing in the way, the exact setting that fixes it.

A newcomer's first day fails quietly: spans arrive but carry no messages, no
reward reaches them, the build waits for trajectories to settle, an agent has no
name. Each is a line in the build's summary at best. The doctor reads the same
spans with the build's own decisions (`calls.classify`, `ancestry`, `read_record`,
`dedupe`, `rewards.outcome`), so its counts are what `nightshift build` would
write now, and turns each loss into a finding: severity, scope, what, why, fix.

`diagnose` is pure over the frames `recent.read` returns; `build_hints` gives the
same fixes from a finished build's summary.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import polars as pl

from . import attrs as A
from . import calls as C
from .config import TransformConfig
from .instrumentations import identify
from .rewards import (CARRIER_KEYS, CARRIER_PREFIXES, Observation, Trajectory, call_function, from_span,
                      load_function, outcome)

SEVERITIES = ("error", "warning", "info")

#: Attribute keys that look like an outcome an application recorded itself.
REWARD_LIKE = r"(?i)(reward|score|rating|outcome|success|grade|feedback|label)"

AGENT_SETUP = ("OTEL_EXPORTER_OTLP_ENDPOINT=http://<collector>:4318 and OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf "
               "(or :4317 for gRPC) in the agent's environment, with an instrumentation loaded: "
               "pip install opentelemetry-distro opentelemetry-exporter-otlp opentelemetry-instrumentation-openai-v2 "
               "opentelemetry-util-genai==1.1b0 (util-genai 1.3b0 breaks its import), "
               "then run `opentelemetry-instrument python your_agent.py`")
INSTRUMENT_CALLS = ("pip install opentelemetry-instrumentation-openai-v2 opentelemetry-util-genai==1.1b0 (or your "
                    "framework's OpenInference / OpenLLMetry package) into the agent's environment and start it with `opentelemetry-instrument` "
                    "(or call its Instrumentor().instrument() at start-up); check OTEL_PYTHON_DISABLED_INSTRUMENTATIONS "
                    "does not name it")
NAME_AGENTS = ("open a span around each agent's turn named `invoke_agent NAME` with gen_ai.operation.name=invoke_agent "
               "and gen_ai.agent.name=NAME, or name the agent in its framework (create_react_agent(name=...), "
               "Agent(name=...), a CrewAI role)")
ATTRIBUTE_LIMIT = "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=1024"
REWARD_SOURCES = ("load outcomes as feedback: `nightshift feedback labels.csv` (columns trace_id,value) or POST "
                  "/v1/feedback to the collector; or record one on a span and name it with --reward-keys KEY "
                  "(transform.reward.keys); or score trajectories with --reward-functions module:function; "
                  "--reward-default 0 trains on unrated rows as neutral")


@dataclass
class Finding:
    """One thing between the spans and rewarded transitions, and its fix."""

    severity: str  # error: this scope builds no trainable rows because of it; warning: some lost; info
    scope: str  # "service S", "service S, agent A", "data", "collector URL"
    what: str
    why: str
    fix: str  # the exact flag, environment variable or setting
    count: int = 0


@dataclass
class Group:
    """The calls of one agent in one service, and what the build would make of them now."""

    service: str
    agent: str | None
    calls: int = 0  # distinct calls (a call recorded twice counts once)
    with_content: int = 0
    waiting: int = 0  # in trajectories not settled yet: a later build
    not_selected: int = 0  # left out by agents_include / agents_exclude
    rows: int = 0  # rows the build would write now
    rewarded: int = 0  # of those, with a reward
    ready: int = 0  # of those, with a reward and content: what training can use
    instrumentations: dict[str, int] = field(default_factory=dict)  # package -> calls


@dataclass
class Service:
    service: str
    spans: int = 0
    traces: int = 0
    llm_spans: int = 0  # spans the build reads as LLM calls
    truncated: int = 0  # spans that lost attributes to the SDK's limit
    duplicates: int = 0  # of those, the same call recorded again
    no_request: int = 0  # LLM-kind spans that sent nothing (preparation steps)
    unknown_layout: int = 0  # LLM calls in a layout no reader knows (left out)
    other_scopes: list[str] = field(default_factory=list)  # what made the rest of its spans


@dataclass
class Report:
    window: str = ""
    spans: int = 0
    traces: int = 0
    services: list[Service] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Would a build now write rewarded transitions with content?"""
        return any(g.ready for g in self.groups)

    def add(self, severity: str, scope: str, what: str, why: str, fix: str, count: int = 0) -> None:
        self.findings.append(Finding(severity, scope, what, why, fix, count))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def lines(self) -> list[str]:
        out = [f"nightshift doctor: {self.window}: {self.spans} spans in {self.traces} traces"]
        groups = defaultdict(list)
        for g in self.groups:
            groups[g.service].append(g)
        for s in self.services:
            out.append(f"service {s.service}: {s.spans} spans in {s.traces} traces, {s.llm_spans} LLM-call spans"
                       + (f" ({s.duplicates} recording a call twice)" if s.duplicates else ""))
            insts: dict[str, int] = defaultdict(int)
            for g in groups[s.service]:
                for k, v in g.instrumentations.items():
                    insts[k] += v
            if insts:
                out.append("  instrumentation: " + "; ".join(f"{k}: {v} calls" for k, v in sorted(insts.items())))
            if s.other_scopes:
                out.append("  other spans from: " + ", ".join(s.other_scopes))
            for g in groups[s.service]:
                out.append(f"  agent {g.agent or '(no name)'}: {g.calls} call(s) -> {g.rows} row(s) now, {g.ready} "
                           f"trainable (content {g.with_content}/{g.calls}, rewarded {g.rewarded}/{g.rows}"
                           + (f", waiting to settle {g.waiting}" if g.waiting else "")
                           + (f", not selected {g.not_selected}" if g.not_selected else "") + ")")
        order = {s: i for i, s in enumerate(SEVERITIES)}
        if self.findings:
            out.append("findings:")
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            out.append(f"  {f.severity.upper()} {f.scope}: {f.what}")
            out.append(f"    why: {f.why}")
            out.append(f"    fix: {f.fix}")
        ready = sum(g.ready for g in self.groups)
        out.append(f"verdict: {ready} rewarded transitions with content would be built now" if self.ok else
                   "verdict: no rewarded transitions with content would be built now; "
                   + ("fix the errors above" if any(f.severity == "error" for f in self.findings)
                      else "the findings above say why" if self.findings else "no calls in the window"))
        return out


def _duration(seconds: float) -> str:
    if seconds and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def _events_by_span(logs: pl.DataFrame) -> dict[tuple[str, str], list[dict]]:
    """GenAI log events (the content of instrumentations that log it) by span."""
    if logs.height == 0 or "span_id" not in logs.columns:
        return {}
    name = pl.coalesce(pl.col("event_name"), pl.col("attributes").list.eval(
        pl.element().filter(pl.element().struct.field("key") == "event.name").struct.field("value")
        .struct.field("string_value")).list.first())
    ev = (logs.with_columns(name.alias("event_name"))
          .filter(pl.col("event_name").str.starts_with("gen_ai.") & pl.col("span_id").is_not_null())
          .sort(pl.coalesce("time", "observed_time"), "record_id"))
    if ev.height == 0:
        return {}
    attrs = A.to_dicts(ev["attributes"].to_arrow(compat_level=pl.CompatLevel.newest()))
    out: dict[tuple[str, str], list[dict]] = {}
    for t, s, n, a, b in zip(ev["trace_id"], ev["span_id"], ev["event_name"], attrs, ev["body"].to_list()):
        out.setdefault((t, s), []).append({"event_name": n, "body": _body(b), "attributes": a})
    return out


def _body(b: dict | None) -> Any:
    """A log record's AnyValue body as Python (arrays and maps are stored as JSON)."""
    if not b:
        return None
    import json

    t = b.get("type")
    if t in ("array", "kvlist"):
        try:
            return json.loads(b["json_value"]) if b.get("json_value") is not None else None
        except json.JSONDecodeError:
            return b["json_value"]
    return {"string": b.get("string_value"), "int": b.get("int_value"), "double": b.get("double_value"),
            "bool": b.get("bool_value"), "bytes": b.get("bytes_value")}.get(t)


def _reward_candidates(df: pl.DataFrame, cfg: TransformConfig) -> dict[str, dict[str, dict]]:
    """Numeric span attributes that look like an outcome but that the build does not
    read as a reward, per service: service -> key -> {spans, traces, example}, the key
    on most traces first."""
    key = pl.col("key")
    known = key.is_in(list(cfg.reward.keys) + list(CARRIER_KEYS))
    for p in CARRIER_PREFIXES:
        known = known | key.str.starts_with(p)
    long = A.long_form(df, key.str.contains(REWARD_LIKE) & ~known)
    long = long.filter(pl.col("number").is_not_null() & pl.col("number").is_finite())
    if long.height == 0:
        return {}
    found = (long.with_columns(df["service_name"].gather(long["row"]).alias("service"),
                               df["trace_id"].gather(long["row"]).alias("trace_id"))
             .group_by("service", "key").agg(pl.len().alias("spans"), pl.col("trace_id").n_unique().alias("traces"),
                                             pl.col("number").first().alias("example"))
             .sort("traces", "key", descending=[True, False]))
    out: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in found.iter_rows(named=True):
        out[r["service"]][r["key"]] = {"spans": r["spans"], "traces": r["traces"], "example": r["example"]}
    return out


def diagnose(spans: pl.DataFrame, logs: pl.DataFrame, feedback: pl.DataFrame, cfg: TransformConfig, now_ns: int,
             window: str = "", feedback_since_ns: int | None = None) -> Report:
    """The report on `spans` (whole traces) as `nightshift build` with `cfg` would
    see them at the clock `now_ns`."""
    report = Report(window or "the spans given")
    if spans.height == 0:
        report.add("error", "data", "no spans in the window",
                   "nothing has reached the collector from the agents in this time (or the data folder is another)",
                   AGENT_SETUP + "; and check --data points where `nightshift collect` writes")
        return report
    df = spans.unique(["trace_id", "span_id"], keep="first", maintain_order=True).with_columns(
        pl.col("start_time").cast(pl.Int64).alias("start_ns"), pl.col("end_time").cast(pl.Int64).alias("end_ns"),
        pl.col("received_time").cast(pl.Int64).alias("received_ns"))
    for col, dtype in (("scope_version", pl.String), ("dropped_attributes_count", pl.UInt32)):
        if col not in df.columns:
            df = df.with_columns(pl.lit(None, dtype).alias(col))
    report.spans, report.traces = df.height, df["trace_id"].n_unique()
    group_attr = cfg.group_by.split(":", 1)[1] if cfg.group_by.startswith("attribute:") else None
    cls = C.classify(df, tuple(cfg.reward.keys), group_attr)
    anc = C.ancestry(df, cls)
    df = df.with_columns(cls["is_call"].alias("_is_call"), cls["carrier"].alias("_carrier"),
                         cls["session"].alias("_session"))
    services = {r["service_name"]: Service(r["service_name"], r["spans"], r["traces"], r["llm"], r["truncated"])
                for r in df.group_by("service_name").agg(
                    pl.len().alias("spans"), pl.col("trace_id").n_unique().alias("traces"),
                    pl.col("_is_call").sum().alias("llm"),
                    (pl.col("dropped_attributes_count").fill_null(0) > 0).sum().alias("truncated"),
                ).sort("service_name").iter_rows(named=True)}
    for (svc,), part in df.filter(~pl.col("_is_call")).group_by("service_name"):
        services[svc].other_scopes = sorted(x or "(no scope)" for x in part["scope_name"].unique().to_list())
    report.services = list(services.values())

    records = _records(df, anc, _events_by_span(logs), services, report)
    trajectories = _trajectories(df, cfg)
    rewards = _rewards(df, feedback, cfg)
    functions = [(spec, load_function(spec)) for spec in cfg.reward.functions]
    include = re.compile(cfg.agents_include) if cfg.agents_include else None
    exclude = re.compile(cfg.agents_exclude) if cfg.agents_exclude else None
    settle_ns = int(cfg.settle * 1e9)
    groups: dict[tuple[str, str | None], Group] = {}
    waiting_traj: dict[str, set[str]] = defaultdict(set)
    unended: dict[str, set[str]] = defaultdict(set)
    unrated_names: dict[str, set[str]] = defaultdict(set)
    function_errors: list[str] = []
    by_traj: dict[str, list[dict]] = defaultdict(list)
    for rec in records:
        by_traj[trajectories.key(rec["trace_id"])].append(rec)
    for key, steps in sorted(by_traj.items()):
        steps.sort(key=lambda r: (r["start_ns"] or 0, r["span_id"]))
        tids = trajectories.traces_of[key]
        last = max(trajectories.last[t] for t in tids)
        rooted = all(trajectories.root_ended[t] for t in tids)
        waiting = settle_ns > 0 and now_ns < last + (settle_ns if rooted else 6 * settle_ns)
        session = next((trajectories.session[t] for t in tids if trajectories.session[t]), None)
        R = None
        if not waiting:
            obs = [o for t in tids for o in rewards.by_trace.get(t, [])] + rewards.by_session.get(session or "", [])
            if functions:
                traj = Trajectory(key, tids, session, steps[0]["service_name"], steps, list(obs))
                for spec, fn in functions:
                    got, err = call_function(spec, fn, traj, now_ns)
                    if err:
                        function_errors.append(f"{spec}: {err}")
                    obs += got
            best = outcome(obs, cfg.reward.name, cfg.reward.prefer)
            R = best.value if best else (float(cfg.reward.default) if cfg.reward.default else None)
            if R is None:
                unrated_names[steps[0]["service_name"]] |= {o.name for o in obs}
        for s in steps:
            g = groups.setdefault((s["service_name"], s["agent_name"]), Group(s["service_name"], s["agent_name"]))
            g.calls += 1
            inst = identify(s["scope"], s["scope_version"], s["convention"]).package
            g.instrumentations[inst] = g.instrumentations.get(inst, 0) + 1
            content = "content_missing" not in s["flags"]
            g.with_content += content
            name = s["agent_name"] or ""
            if (include and not include.search(name)) or (exclude and exclude.search(name)):
                g.not_selected += 1
                continue
            if waiting:
                g.waiting += 1
                waiting_traj[s["service_name"]].add(key)
                if not rooted:
                    unended[s["service_name"]].add(key)
                continue
            g.rows += 1
            g.rewarded += R is not None
            g.ready += R is not None and content
    report.groups = sorted(groups.values(), key=lambda g: (g.service, g.agent or ""))
    _findings(report, records, cfg, waiting_traj, unended, unrated_names, _reward_candidates(df, cfg))
    for err in sorted(set(function_errors))[:3]:
        report.add("warning", "data", f"a reward function failed: {err}",
                   "the build marks the trajectory reward_function_error and goes on without that reward",
                   "fix the function (it is called with a rewards.Trajectory and returns a number, a dict of "
                   "numbers, or None)", len(function_errors))
    _feedback_findings(report, feedback, df, feedback_since_ns)
    return report


def _records(df: pl.DataFrame, anc: pl.DataFrame, log_events: dict, services: dict[str, Service],
             report: Report) -> list[dict]:
    """One record per distinct call, as the build reads it (double recordings merged)."""
    call_rows = df.filter(pl.col("_is_call"))
    if call_rows.height == 0:
        return []
    attrs = A.to_dicts_without(call_rows["attributes"], C.TOKEN_KEYS)
    span_events = C.events_of(call_rows)
    meta = call_rows.select("trace_id", "span_id", "start_ns", "end_ns", "service_name", "gen_ai_operation_name",
                            "scope_name", "scope_version", "dropped_attributes_count").to_dicts()
    root_calls = set(call_rows.filter(pl.col("parent_span_id").is_null())["span_id"].to_list())
    info = anc.to_dicts()
    unknown: dict[tuple[str, str], list] = {}
    records = []
    for i, (row, a) in enumerate(zip(meta, attrs)):
        key = (row["trace_id"], row["span_id"])
        rec = C.read_record(row, a, log_events.get(key, []) + span_events.get(key, []))
        svc = services[row["service_name"]]
        if "unknown_layout" in rec["flags"]:
            svc.unknown_layout += 1
            u = unknown.setdefault((row["service_name"], row["scope_name"] or "(no scope)"), [0, row["span_id"]])
            u[0] += 1
            continue
        if C.made_no_request(rec, row):
            svc.no_request += 1
            continue
        rec["scope_version"] = row["scope_version"]
        rec["agent_name"] = info[i]["agent_name"]
        records.append(rec)
    outer_of = {row["span_id"]: info[i]["outer"] for i, row in enumerate(meta)}
    before: dict[str, int] = defaultdict(int)
    for r in records:
        before[r["service_name"]] += 1
    counts = C.Counts()
    records = C.merge_detached(C.dedupe(records, outer_of, counts), root_calls, counts)
    after: dict[str, int] = defaultdict(int)
    for r in records:
        after[r["service_name"]] += 1
    for svc, n in before.items():
        services[svc].duplicates = n - after[svc]
    for (svc, scope), (n, example) in sorted(unknown.items()):
        report.add("warning", f"service {svc}", f"{n} LLM-call spans from {scope} in a layout no reader knows "
                   f"(left out), e.g. span {example}",
                   "a release of that instrumentation changed its attributes; the build never guesses at content",
                   "please report it with the span (`nightshift show`); until then pin the instrumentation's "
                   "previous release", n)
    return records


@dataclass
class _Trajectories:
    how: str
    session: dict[str, str | None]
    last: dict[str, int]
    root_ended: dict[str, bool]
    traces_of: dict[str, list[str]]

    def key(self, trace_id: str) -> str:
        if self.how == "conversation" and self.session.get(trace_id):
            return "conversation:" + str(self.session[trace_id])
        return trace_id


def _trajectories(df: pl.DataFrame, cfg: TransformConfig) -> _Trajectories:
    """Per trace: its conversation, when its last span arrived, whether its root
    ended; and which traces make each trajectory (`linked` is read as `trace`: the
    doctor counts calls, which linking does not change)."""
    per = df.group_by("trace_id").agg(
        pl.col("received_ns").max().fill_null(0).alias("last"),
        (pl.col("parent_span_id").is_null() & pl.col("end_ns").is_not_null()).any().alias("root_ended"),
        pl.col("_session").drop_nulls().first().alias("session"))
    t = _Trajectories(cfg.trajectory, dict(zip(per["trace_id"], per["session"])), dict(zip(per["trace_id"], per["last"])),
                      dict(zip(per["trace_id"], per["root_ended"])), defaultdict(list))
    for tid in sorted(t.last):
        t.traces_of[t.key(tid)].append(tid)
    return t


@dataclass
class _Rewards:
    by_trace: dict[str, list[Observation]]
    by_session: dict[str, list[Observation]]


def _rewards(df: pl.DataFrame, feedback: pl.DataFrame, cfg: TransformConfig) -> _Rewards:
    """Every reward the build would find for these traces: on their spans, in feedback."""
    out = _Rewards(defaultdict(list), defaultdict(list))
    carriers = df.filter(pl.col("_carrier"))
    if carriers.height:
        dicts = A.to_dicts(carriers["attributes"].to_arrow(compat_level=pl.CompatLevel.newest()))
        for (t, s, name, start), a in zip(carriers.select("trace_id", "span_id", "name", "start_ns").iter_rows(), dicts):
            found, _bad = from_span(name or "", a, tuple(cfg.reward.keys))
            for rname, value, detail, primary in found:
                out.by_trace[t].append(Observation(rname, value, "span", detail, int(start or 0), s, primary))
    if feedback.height:
        for r in feedback.iter_rows(named=True):
            o = Observation(r["name"], r["value"], "feedback", f"feedback:{r['name']}", int(r["received_time"] or 0),
                            r["span_id"], False)
            if r["trace_id"]:
                out.by_trace[r["trace_id"]].append(o)
            if r["conversation_id"]:
                out.by_session[r["conversation_id"]].append(o)
    return out


def _findings(report: Report, records: list[dict], cfg: TransformConfig, waiting: dict[str, set[str]],
              unended: dict[str, set[str]], unrated_names: dict[str, set[str]],
              reward_like: dict[str, dict[str, dict]]) -> None:
    groups_of: dict[str, list[Group]] = defaultdict(list)
    for g in report.groups:
        groups_of[g.service].append(g)
    for s in report.services:
        gs = groups_of[s.service]
        scope = f"service {s.service}"
        if s.truncated:
            report.add("error" if s.llm_spans == 0 else "warning", scope,
                       f"{s.truncated} spans lost attributes to the SDK's limit (dropped_attributes_count > 0)",
                       "the OpenTelemetry SDK keeps 128 attributes a span (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT) and drops "
                       "the rest: messages of long conversations, or the gen_ai.operation.name that marks an LLM call, "
                       "so the call is not seen at all", f"{ATTRIBUTE_LIMIT} in the agent's environment", s.truncated)
        if s.llm_spans == 0:
            report.add("error", scope, f"{s.spans} spans from {', '.join(s.other_scopes) or 'no scope'}, but no LLM call "
                       "among them",
                       "transitions are made of LLM-call spans, which an instrumentation of the LLM client or framework "
                       "records; none is loaded in this service" + (
                           ", or the attributes that mark them were dropped (above)" if s.truncated else ""),
                       INSTRUMENT_CALLS, s.spans)
            continue
        calls = sum(g.calls for g in gs)
        ready = sum(g.ready for g in gs)
        # content, per instrumentation: its own switch
        missing: dict[str, list] = {}
        for r in records:
            if r["service_name"] == s.service and "content_missing" in r["flags"]:
                inst = identify(r["scope"], r["scope_version"], r["convention"])
                missing.setdefault(inst.package, [0, inst.content_switch])[0] += 1
        with_content = sum(g.with_content for g in gs)
        for package, (n, switch) in sorted(missing.items()):
            report.add("error" if with_content == 0 else "warning", f"{scope} ({package})",
                       f"{n} of {calls} calls recorded without their messages (model and token counts only)",
                       "the instrumentation's content capture is off, and a row without its prompt and answer "
                       "cannot be trained on", f"{switch}, in the agent's environment", n)
        n_wait = sum(g.waiting for g in gs)
        if n_wait:
            t = waiting[s.service]
            fix = (f"build later: a trajectory is built once nothing has arrived for it for {_duration(cfg.settle)} "
                   "(transform.settle); for a batch you know is complete, `nightshift build --settle 0` "
                   "(NIGHTSHIFT_TRANSFORM_SETTLE=0)")
            why = "an agent may still add calls to it; building now would cut it short"
            if unended[s.service]:
                why += (f"; {len(unended[s.service])} of them never ended their root span, so they wait six times "
                        "as long (end the span around each run, and shut the tracer provider down at exit so the "
                        "last spans are sent)")
            report.add("warning" if ready == 0 else "info", scope,
                       f"{n_wait} calls in {len(t)} trajectories are still settling (not built now)", why, fix, n_wait)
        rows = sum(g.rows for g in gs)
        unrated = rows - sum(g.rewarded for g in gs)
        if unrated:
            fix = REWARD_SOURCES
            candidates = reward_like.get(s.service, {})
            if candidates:
                k, c = next(iter(candidates.items()))
                fix = (f"--reward-keys {k} (transform.reward.keys: [{k}]; on {c['spans']} spans of {c['traces']} "
                       f"traces, e.g. {c['example']:g})" + ("; other keys that look like rewards: "
                                                            + ", ".join(list(candidates)[1:4]) if len(candidates) > 1 else "")
                       + "; or " + REWARD_SOURCES.split("; or ", 1)[0])
            why = "a row without a reward teaches nothing about which answers were good"
            names = sorted(unrated_names.get(s.service, set()))
            if names and cfg.reward.name:
                why = f"rewards were found, named {', '.join(names)}, but the outcome is --reward-name {cfg.reward.name}"
                fix = f"--reward-name {names[0]} (transform.reward.name), or leave it empty for the primary reward"
            report.add("error" if sum(g.rewarded for g in gs) == 0 else "warning", scope,
                       f"{unrated} of {rows} rows would have no reward", why, fix, unrated)
        nameless = sum(g.calls for g in gs if not g.agent)
        if nameless:
            dropped = sum(g.not_selected for g in gs if not g.agent)
            report.add("error" if dropped and dropped == calls else "warning", scope,
                       f"{nameless} of {calls} calls have no agent name",
                       "rows cannot be told apart by agent (agent_name is null), and --agents-include leaves them out",
                       NAME_AGENTS, nameless)
        not_selected = sum(g.not_selected for g in gs)
        if not_selected:
            names = sorted({g.agent or "(no name)" for g in gs})
            report.add("error" if not_selected == calls else "info", scope,
                       f"{not_selected} of {calls} calls left out by the agent selection",
                       f"agents_include={cfg.agents_include!r}, agents_exclude={cfg.agents_exclude!r}; agents seen: "
                       + ", ".join(names),
                       "--agents-include / --agents-exclude (transform.agents_include) as a regex on those names",
                       not_selected)


def _feedback_findings(report: Report, feedback: pl.DataFrame, df: pl.DataFrame, since_ns: int | None) -> None:
    """Labels sent in the window that name no trace or conversation it holds: a wrong
    id (a decimal trace id, a span id) never joins."""
    if feedback.height == 0:
        return
    fb = feedback
    if since_ns is not None:
        fb = fb.filter(pl.col("received_time") >= since_ns)
    traces = df["trace_id"].unique().implode()
    sessions = df["_session"].drop_nulls().unique().implode()
    lost = fb.filter(~pl.col("trace_id").fill_null("").is_in(traces)
                     & ~pl.col("conversation_id").fill_null("").is_in(sessions))
    if lost.height:
        ex = lost.row(0, named=True)
        report.add("warning", "data", f"{lost.height} of {fb.height} feedback labels name no trace or conversation "
                   f"in the window, e.g. trace_id={ex['trace_id']!r} conversation_id={ex['conversation_id']!r}",
                   "a label joins its trajectory by the trace id (32 hex digits) or gen_ai.conversation.id; "
                   "other ids never match (or its trace is older than the window)",
                   "send format(span.get_span_context().trace_id, '032x') of the run's root span as trace_id, "
                   "or widen --hours", lost.height)


def build_hints(summary: Any, cfg: TransformConfig) -> list[Finding]:
    """The doctor's fixes for what a finished build's summary shows: no rows, rows
    without a reward, trajectories still settling, spans without LLM calls."""
    out: list[Finding] = []
    if summary.spans and not summary.by_instrumentation and not summary.waiting:
        out.append(Finding("error", "build", f"no LLM calls among {summary.spans} spans",
                           "no instrumentation of the LLM client or framework is loaded", INSTRUMENT_CALLS))
    if summary.waiting:
        out.append(Finding("warning" if not summary.transitions else "info", "build",
                           f"{summary.waiting} trajectories are still settling",
                           f"a trajectory is built once nothing has arrived for it for {_duration(cfg.settle)}",
                           "build later, or `--settle 0` (NIGHTSHIFT_TRANSFORM_SETTLE=0) for a batch you know "
                           "is complete"))
    if summary.unrated:
        out.append(Finding("error" if not summary.rewards_by_source else "warning", "build",
                           f"{summary.unrated} trajectories without a reward", "a row without a reward cannot be "
                           "trained on", REWARD_SOURCES + "; `nightshift doctor` lists span attributes that look "
                           "like rewards"))
    for conv, n in sorted(summary.content_missing.items()):
        out.append(Finding("warning", "build", f"{n} rows without their messages ({conv})",
                           "content capture was off", "`nightshift doctor` names your instrumentation's switch"))
    return out


def clock(now_ns: int) -> str:
    return dt.datetime.fromtimestamp(now_ns / 1e9, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
