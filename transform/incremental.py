"""Which transition partitions an incremental build redoes, so that it leaves the
same rows a full build from scratch would, at the same clock.

A date's rows are a function of the spans of the trajectories that started on it
(wherever those spans are), their log events, the feedback naming them, the build's
clock (a trajectory is built once it has settled) and the settings; and, through
the advantages, of every other row (pooled: see `pool`). The build records in
`<data>/build/state.json` (beside the datasets, not in one: a reader of
`transitions/` must find only Parquet) what it read and what each date depends on:

- every span, log and feedback file, with a stamp from the listing (size, and the
  inode and mtime, or the object store's ETag): a file rewritten under its old name,
  even to the same size, is a new file;
- per output date, the other dates holding its trajectories' spans and log events
  (`reach`), and when the first of its waiting trajectories settles (`settle`);
- per feedback file, the dates whose trajectories it named;
- per transitions partition, its stamp, so a partition deleted or changed by hand (or
  by a build that was not incremental) is rebuilt.

The next build redoes a date when a trajectory of it may have changed: one of its
traces is in a new span or log file (found by the trace ids of the new files, at
whatever date the trace started, however late the span), a file it was read from is
gone or rewritten, a feedback file naming it is added, rewritten or removed, a
trajectory of it settles by the build's clock, or its partition changed by hand.
It reads all the spans of the trajectories it rebuilds, on every date they are on.

With `trajectory: conversation` (`linked`) a trajectory is every trace of a
conversation (joined by links), on any dates: the traces touched grow to their
trajectories' (`_Joined`, from every span file's conversation keys or links' trace
ids, read once, not the spans), and so do the traces of a rebuilt date, read whole.
Feedback naming a conversation names the traces whose spans name it (read the same
way), whatever the trajectories.

A full build instead, said in a sentence in the log: no state, one that cannot be
read or is not what this version writes; other settings; a clock before the last
build's (a trajectory it built may not have settled yet).

The state is written after every partition is in place: a crash before leaves the
old one, so the next build redoes this build's dates (idempotent), never skips them.
Reward functions must depend on the trajectory alone, not on the clock or on code
changed under the same name, for an incremental build to agree with a full one.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import polars as pl

from nightshift.schemas import layout
from nightshift.storage import write_atomic

from . import chains, scan

STATE = "build/state.json"
VERSION = 2

#: Settings that do not change a partition's rows: the window and the resources.
_NOT_SHAPING = ("data", "since", "until", "memory_budget", "storage_options", "incremental", "build")
#: Listing fields that change when a file is rewritten: local disks, then object stores.
_STAMP_KEYS = ("ino", "mtime", "ETag", "etag", "LastModified", "last_modified", "generation", "created")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}\Z")


def settings_key(cfg) -> str:
    shaping = {k: v for k, v in asdict(cfg).items() if k not in _NOT_SHAPING}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stamp(entry: dict) -> str:
    """One version of a file, from its listing entry: its size, and what the file
    system changes when the file is written again. The collector writes each file
    once under a unique name, but a user's copy can replace one with other content
    of the same size; name and size alone would miss that."""
    parts = [str(entry.get("size"))]
    for key in _STAMP_KEYS:
        if entry.get(key) is not None:
            parts.append(f"{key}={entry[key]}")
            if key != "ino":
                break
    return " ".join(parts)


@dataclass
class Inputs:
    """What a build finds under the data root, from listings alone (nothing opened)."""

    root: str
    spans: dict[str, dict[str, str]]  # date -> file name -> stamp
    logs: dict[str, dict[str, str]]
    feedback: dict[str, str]  # "date=YYYY-MM-DD/name" -> stamp
    partitions: dict[str, str]  # transitions date -> stamp of its files

    def span_paths(self, dates) -> dict[str, list[str]]:
        return {d: [layout.file(self.root, layout.SPANS, d, n) for n in sorted(self.spans[d])]
                for d in sorted(dates) if d in self.spans}

    def log_paths(self, dates) -> dict[str, list[str]]:
        return {d: [layout.file(self.root, layout.LOGS, d, n) for n in sorted(self.logs[d])]
                for d in sorted(dates) if d in self.logs}


@dataclass
class Plan:
    """What an incremental build does: the dates it rebuilds (None: all of them) and
    what it reads for them."""

    dates: set[str] | None
    why: str
    #: dates read but not rebuilt -> the traces to read from them: those with a span on a
    #: rebuilt date (their spans elsewhere complete them), for spans and for log events
    spans: dict[str, pl.Series] = field(default_factory=dict)
    logs: dict[str, pl.Series] = field(default_factory=dict)


@dataclass
class Seen:
    """What a build learns of each date it builds, for the next one."""

    reach: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    settle: dict[str, int] = field(default_factory=dict)
    #: (trace ids, conversation, date) of every trajectory that made rows: what feedback can name
    built: list[tuple[list[str], str | None, str]] = field(default_factory=list)

    def trajectory(self, day: str, dates: set[str], settle_at: int | None, tids: list[str],
                   session: str | None, rows: bool) -> None:
        self.reach[day] |= dates - {day}
        if settle_at is not None:
            self.settle[day] = min(settle_at, self.settle.get(day, settle_at))
        if rows:
            self.built.append((tids, session, day))

    def add(self, other: "Seen") -> None:
        """What another bucket learnt (buckets added in order: the same state as one
        process building them all)."""
        for day, dates in other.reach.items():
            self.reach[day] |= dates
        for day, at in other.settle.items():
            self.settle[day] = min(at, self.settle.get(day, at))
        self.built += other.built


# --- the state file -------------------------------------------------------------------------------


def load(fs, root: str) -> tuple[dict | None, str]:
    """The last build's state, or None and the sentence that says why a full build."""
    path = f"{root}/{STATE}"
    if not fs.exists(path):
        return None, f"no earlier build state ({path}): a full build"
    try:
        with fs.open(path, "rb") as fh:
            state = json.loads(fh.read())
    except (OSError, ValueError) as e:
        return None, (f"the build state {path} is unreadable ({type(e).__name__}: {e}; cut short?): a full build, "
                      "which writes a good one")
    if not isinstance(state, dict):
        return None, f"the build state {path} is not a JSON object ({type(state).__name__}): a full build"
    if state.get("version") != VERSION:
        return None, (f"the build state {path} is from another version of nightshift (version "
                      f"{state.get('version')!r}, this one writes {VERSION}): a full build")
    problem = check(state)
    if problem:
        return None, f"the build state {path} is not what a build writes ({problem}): a full build"
    return state, ""


def _files_ok(v) -> bool:
    return isinstance(v, dict) and all(
        isinstance(d, str) and isinstance(files, dict) and all(isinstance(n, str) and isinstance(s, str)
                                                               for n, s in files.items()) for d, files in v.items())


def _dates_ok(v) -> bool:
    return isinstance(v, list) and all(isinstance(d, str) and _DATE.match(d) for d in v)


def check(state: dict) -> str | None:
    """The first thing in a state that a build could not have written, in words."""
    if not isinstance(state.get("settings"), str):
        return "settings is not a string"
    if not isinstance(state.get("now"), int) or isinstance(state.get("now"), bool):
        return "now is not an integer"
    for key in ("spans", "logs"):
        if not _files_ok(state.get(key)):
            return f"{key} is not a map of dates to files and stamps"
    fb = state.get("feedback")
    if not isinstance(fb, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("stamp"), str) and _dates_ok(r.get("dates")) for r in fb.values()):
        return "feedback is not a map of files to a stamp and dates"
    dates = state.get("dates")
    if not isinstance(dates, dict) or not all(
            _DATE.match(str(d)) and isinstance(r, dict) and _dates_ok(r.get("reach"))
            and (r.get("settle") is None or (isinstance(r.get("settle"), int) and not isinstance(r.get("settle"), bool)))
            for d, r in dates.items()):
        return "dates is not a map of dates to reach and settle"
    parts = state.get("partitions")
    if not isinstance(parts, dict) or not all(isinstance(s, str) for s in parts.values()):
        return "partitions is not a map of dates to stamps"
    return None


def save(fs, root: str, state: dict, storage_options: dict | None = None) -> None:
    """Through the shared atomic writer: fsync'd, renamed, the folder fsync'd (one PUT
    on an object store), so a crash leaves the old state or the new, whole."""
    write_atomic(fs.unstrip_protocol(f"{root}/{STATE}"), json.dumps(state, sort_keys=True), storage_options)


def new_state(inputs: Inputs, old: dict | None, plan_dates: set[str] | None, seen: Seen,
              feedback_dates: dict[str, set[str]], now_ns: int, cfg) -> dict:
    """What this build read and learnt, merged with what the last one knew of the
    dates this one kept."""
    keep = old if old is not None and plan_dates is not None else None
    dates = {}
    if keep:
        dates = {d: r for d, r in keep["dates"].items() if d not in plan_dates}
    for d in sorted(set(seen.reach) | set(seen.settle)):
        dates[d] = {"reach": sorted(seen.reach.get(d, ())), "settle": seen.settle.get(d)}
    feedback = {}
    for path, st in inputs.feedback.items():
        got = set(feedback_dates.get(path, ()))
        if keep and path in keep["feedback"] and keep["feedback"][path]["stamp"] == st:
            got |= set(keep["feedback"][path]["dates"]) - plan_dates
        feedback[path] = {"stamp": st, "dates": sorted(got)}
    return {"version": VERSION, "settings": settings_key(cfg), "now": int(now_ns), "spans": inputs.spans,
            "logs": inputs.logs, "feedback": feedback, "dates": dates, "partitions": inputs.partitions}


# --- the decision ---------------------------------------------------------------------------------


def plan(fs, state: dict | None, why_none: str, inputs: Inputs, feedback: pl.DataFrame, now_ns: int, cfg) -> Plan:
    """The dates to rebuild and what to read for them; `feedback` holds every feedback
    row with its file (`_file`), as read for the build."""
    if state is None:
        return Plan(None, why_none)
    if state["settings"] != settings_key(cfg):
        return Plan(None, "settings changed since the last build: a full build")
    if now_ns < state["now"]:
        return Plan(None, f"this build's clock ({now_ns} ns) is before the last build's ({state['now']} ns): a "
                          "trajectory built then may not have settled yet: a full build")
    # a conversation's or linked set's traces, on any dates, from every span file's keys or links (not the spans)
    every = [chains.Source(p) for p in _flat(inputs.span_paths(inputs.spans))]
    convs = chains.conversations(fs, every) if cfg.trajectory == "conversation" else None
    joined = (_Joined(chains.conversation_groups(convs)) if convs is not None else
              _Joined(chains.links(fs, every)) if cfg.trajectory == "linked" else None)
    why: list[str] = []
    dates: set[str] = set()

    new_spans = _new(inputs.spans, state["spans"])
    new_logs = _new(inputs.logs, state["logs"])
    gone = {d for d, _ in _new(state["spans"], inputs.spans) | _new(state["logs"], inputs.logs)}
    if new_spans:
        dates |= {d for d, _ in new_spans}
        why.append(f"{len(new_spans)} new span file(s)")
    if new_logs:
        why.append(f"{len(new_logs)} new log file(s)")
    if gone:
        dates |= gone | {d for d, r in state["dates"].items() if gone & set(r["reach"])}
        why.append(f"span or log files gone or rewritten on {len(gone)} date(s)")

    due = {d for d, r in state["dates"].items() if r["settle"] is not None and r["settle"] <= now_ns}
    if due:
        dates |= due
        why.append(f"waiting trajectories settled on {len(due)} date(s)")

    fb_new = [p for p, s in inputs.feedback.items() if state["feedback"].get(p, {}).get("stamp") != s]
    fb_gone = [p for p, r in state["feedback"].items() if inputs.feedback.get(p) != r["stamp"]]
    for p in fb_gone:
        dates |= set(state["feedback"][p]["dates"])
    fb_traces = pl.Series("trace_id", [], pl.String)
    if fb_new:
        named = feedback.filter(pl.col("_file").is_in(fb_new))
        # a row that shares its id with a new one may now win, or lose, the tie
        named = feedback.filter(pl.col("_file").is_in(fb_new) | pl.col("feedback_id").is_in(named["feedback_id"].implode()))
        by_conv = named["conversation_id"].drop_nulls().unique()
        fb_traces = named["trace_id"].drop_nulls().unique()
        if by_conv.len():  # the traces whose spans name the conversation (any key: at least the label's)
            convs = chains.conversations(fs, every) if convs is None else convs
            fb_traces = pl.concat([fb_traces, convs.filter(pl.col("s").is_in(by_conv.implode()))["trace_id"]]).unique()
    if fb_new or fb_gone:
        why.append(f"{len(fb_new)} new or rewritten and {len(set(fb_gone) - set(fb_new))} removed feedback file(s)")

    hand = {d for d in set(state["partitions"]) | set(inputs.partitions)
            if state["partitions"].get(d) != inputs.partitions.get(d)}
    if hand:
        dates |= hand
        why.append(f"{len(hand)} transitions partition(s) changed since the last incremental build wrote them")

    # Traces with new spans, log events or feedback: rebuilt on every date they are on,
    # which holds the date they start on (a span is filed by its start) and the date
    # they started on before a late span that starts earlier.
    ids = scan.Scan(fs)
    new_paths = [layout.file(inputs.root, layout.SPANS, d, n) for d, n in sorted(new_spans)]
    new_paths += [layout.file(inputs.root, layout.LOGS, d, n) for d, n in sorted(new_logs)]
    touched = pl.concat([ids.traces_of(new_paths), fb_traces]).unique()
    if joined is not None:  # a conversation's (a linked set's) trajectory changes with any of its traces
        touched = joined.grow(touched)
    old_files = {d: [layout.file(inputs.root, layout.SPANS, d, n) for n in sorted(files) if (d, n) not in new_spans]
                 for d, files in inputs.spans.items()}
    new_files: dict[str, list[str]] = defaultdict(list)
    for d, n in sorted(new_spans):
        new_files[d].append(layout.file(inputs.root, layout.SPANS, d, n))
    first = set(dates)
    wanted = pl.concat([touched, ids.traces_of(_flat(inputs.span_paths(first)))]).unique()
    where_old = ids.dates_of(old_files, wanted)
    where_new = ids.dates_of(new_files, wanted)
    for t in touched:  # every date it is on: the one it starts on now, and the one it started on before
        dates |= where_old.get(t, set()) | where_new.get(t, set())

    # Every trace with a span on a rebuilt date is read whole: its spans on other dates too.
    more = dates - first
    if more:
        extra = ids.traces_of(_flat(inputs.span_paths(more)))
        extra = extra.filter(~extra.is_in(wanted.implode()))
        for t, ds in ids.dates_of(inputs.span_paths(inputs.spans), extra).items():
            where_old.setdefault(t, set()).update(ds)
    on_dates = ids.traces_of(_flat(inputs.span_paths(dates)))
    if joined is not None:  # a rebuilt date's conversations are read whole: their traces on other dates too
        on_dates = joined.grow(on_dates)
        unknown = on_dates.filter(~on_dates.is_in(list(where_old.keys() | where_new.keys())))
        for t, ds in ids.dates_of(inputs.span_paths(inputs.spans), unknown).items():
            where_old.setdefault(t, set()).update(ds)
    only: dict[str, list[str]] = defaultdict(list)  # date read, not rebuilt -> the traces wanted from it
    for t in on_dates:
        for d in (where_old.get(t, set()) | where_new.get(t, set())) - dates:
            only[d].append(t)
    log_only: dict[str, list[str]] = defaultdict(list)
    if on_dates.len() and inputs.logs:
        for t, ds in ids.dates_of(inputs.log_paths(inputs.logs), on_dates).items():
            for d in ds - dates:
                if d in inputs.spans:  # a full build reads the log events of dates with spans
                    log_only[d].append(t)
    return Plan(dates, ", ".join(why) or "nothing changed", {d: pl.Series("trace_id", ts, pl.String) for d, ts in only.items()},
                {d: pl.Series("trace_id", ts, pl.String) for d, ts in log_only.items()})


class _Joined:
    """The traces that make one trajectory across any dates (`trajectory: conversation`
    or `linked`), from `chains`' groups: what the traces an incremental build touches
    or rebuilds grow to."""

    def __init__(self, groups: dict[str, str]):
        firsts = pl.DataFrame({"trace_id": list(groups), "first": list(groups.values())}, schema={
            "trace_id": pl.String, "first": pl.String})
        self.groups = pl.concat([firsts, firsts.select(pl.col("first").alias("trace_id"), "first").unique()])

    def grow(self, traces: pl.Series) -> pl.Series:
        """`traces` and every trace joined to one of them."""
        firsts = self.groups.filter(pl.col("trace_id").is_in(traces.implode()))["first"]
        mates = self.groups.filter(pl.col("first").is_in(firsts.implode()))["trace_id"]
        return pl.concat([traces.cast(pl.String).rename("trace_id"), mates]).unique()


def _new(now: dict[str, dict[str, str]], before: dict[str, dict[str, str]]) -> set[tuple[str, str]]:
    """(date, name) of the files in `now` that `before` did not have, or had with another stamp."""
    return {(d, n) for d, files in now.items() for n, s in files.items() if before.get(d, {}).get(n) != s}


def _flat(paths: dict[str, list[str]]) -> list[str]:
    return [p for ps in paths.values() for p in ps]


def feedback_dates(feedback: pl.DataFrame, built: list[tuple[list[str], str | None, str]]) -> dict[str, set[str]]:
    """Per feedback file, the dates of the trajectories its rows name (by trace or by
    conversation), counting every row that shares an id with one of them: removing a
    file can hand the id to another file's row."""
    if feedback.height == 0 or not built:
        return {}
    by_trace = pl.DataFrame([(t, day) for tids, _, day in built for t in tids], schema=["trace_id", "_day"], orient="row")
    by_conv = pl.DataFrame([(s, day) for _, s, day in built if s], schema=["conversation_id", "_day"], orient="row")
    rows = feedback.select("_file", "feedback_id", "trace_id", "conversation_id")
    hits = pl.concat([rows.join(by_trace, on="trace_id"), rows.join(by_conv, on="conversation_id")] if by_conv.height
                     else [rows.join(by_trace, on="trace_id")], how="diagonal")
    per_id = hits.select("feedback_id", "_day").unique()
    out: dict[str, set[str]] = defaultdict(set)
    for f, d in rows.select("_file", "feedback_id").join(per_id, on="feedback_id").select("_file", "_day").unique().iter_rows():
        out[f].add(d)
    return out
