"""`nightshift build --incremental` leaves the same rows as a full build from scratch
of the same data at the same clock, always: every column (advantages included), every
date partition.

The property test plays generated histories (trajectories arriving, some spans late and
on a later date, feedback added and removed, the clock moving within and past the
settle window, crashes between the partitions and the state, partitions deleted by
hand) and, after every incremental build, builds everything again from scratch beside
it and compares. The regression tests below it pin each way the old incremental build
lost rows, one at a time."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from nightshift.collector.datasets import DatasetStore
from nightshift.schemas import feedback as feedback_schema
from nightshift.transform import build as B
from nightshift.transform import incremental, output
from nightshift.transform.config import TransformConfig
from nightshift.collector.convert import SpanBuilder
from traces import T0, Trace, genai_call, request, write_logs, write_spans

S = 10**9
HOUR = 3600 * S
DAY = 24 * HOUR
SETTLE = 600.0
#: T0 is 08:26:40 UTC; this is midnight before it
MIDNIGHT = T0 - (8 * 3600 + 26 * 60 + 40) * S


def cfg_for(data, **kw) -> TransformConfig:
    cfg = TransformConfig(data=str(data), settle=kw.pop("settle", SETTLE))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def transitions(data) -> pl.DataFrame:
    """Every row under `transitions/`, with its partition's date, in id order (the
    order within a partition is the build's own; which partition holds a row is not)."""
    base = Path(data) / "transitions"
    if not base.is_dir() or not any(p.name.startswith("date=") for p in base.iterdir()):
        return pl.DataFrame()
    return pl.read_parquet(f"{base}/date=*/*.parquet", hive_partitioning=True).sort("transition_id")


class Crash(RuntimeError):
    """The process died here."""


def full_build(data, mirror, now_ns: int, **kw) -> pl.DataFrame:
    """A full build from scratch of `data`'s spans, logs and feedback (shared through
    symlinks, nothing copied) into `mirror`, at the same clock."""
    mirror = Path(mirror)
    if not mirror.exists():
        mirror.mkdir(parents=True)
        for name in ("spans", "logs", "feedback"):
            (Path(data) / name).mkdir(parents=True, exist_ok=True)
            (mirror / name).symlink_to(Path(data) / name, target_is_directory=True)
    shutil.rmtree(mirror / "transitions", ignore_errors=True)
    shutil.rmtree(mirror / "build", ignore_errors=True)
    B.build(cfg_for(mirror, **kw), now_ns=now_ns)
    return transitions(mirror)


def same(inc: pl.DataFrame, full: pl.DataFrame) -> str:
    """'' when equal, else what differs, in a line or two."""
    if inc.equals(full):
        return ""
    if inc.height != full.height or inc.columns != full.columns:
        a = set(inc["transition_id"]) if inc.height else set()
        b = set(full["transition_id"]) if full.height else set()
        return (f"incremental {inc.height} rows, full {full.height}; only incremental: {sorted(a - b)[:3]}, "
                f"only full: {sorted(b - a)[:3]}, rows twice: {inc.height - len(a)}")
    cols = [c for c in inc.columns if not inc[c].equals(full[c])]
    first = cols[0]
    i = next(k for k in range(inc.height) if inc[first][k] != full[first][k])
    return f"columns differ: {cols}; e.g. {first} of {inc['transition_id'][i]}: {inc[first][i]!r} != {full[first][i]!r}"


# --- generated histories ---------------------------------------------------------------------------


@dataclass
class Traj:
    seed: str
    start: int  # ns
    task: str
    calls: int
    reward: float | None
    session: str | None
    rooted: bool  # its root span ends (else it settles only after six settle windows)
    late: list[float] = field(default_factory=list)  # offsets (s) of calls that arrive later
    #: its calls' history is in another trace: ("continue", the response its first call
    #: continues or None) with each call continuing the one before, as OpenAI's stateful
    #: API records it; ("delta", whether an earlier trace of its conversation came first)
    #: with each call sending only its conversation's new messages (`session` names it)
    chained: tuple[str, object] | None = None
    #: the trajectory whose root span its root links to (AutoGen's trace per message)
    link: str | None = None

    def response(self, i: int) -> str:
        return f"resp-{self.seed}-{i}"

    def _call(self, i: int) -> dict:
        a = genai_call(self.task if i == 0 else f"{self.task} {i}", f"a{i}")
        if self.chained is None:
            return a
        how, before = self.chained
        a["gen_ai.response.id"] = self.response(i)
        user = json.loads(a["gen_ai.input.messages"])
        if how == "continue":
            a["gen_ai.input.messages"] = json.dumps(user)
            previous = self.response(i - 1) if i else before
            if previous:
                a["gen_ai.request.previous_response.id"] = previous
        else:  # the answer before it (this trace's last call's, or an earlier trace's) then the user's turn
            answer = [{"role": "assistant", "parts": [{"type": "text", "content": f"a{i - 1}" if i else "earlier"}]}]
            a["gen_ai.input.messages_delta"] = json.dumps((answer if i or before else []) + user)
            del a["gen_ai.input.messages"]
        return a

    def trace(self, which: str) -> Trace:
        """'early': what arrives first (root, calls, reward); 'late:i': late call i."""
        t = Trace(self.seed)
        off = (self.start - T0) / S
        other = Trace(self.link) if self.link else None
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=off, end=off + 30 if self.rooted else None,
                      links=[(other.trace_id, other.span("root"))] if other else None)
        attrs = {"gen_ai.conversation.id": self.session} if self.session else {}
        for i in range(self.calls):
            t.span("chat m1", {**self._call(i), **attrs}, parent=root,
                   start=off + 1 + 2 * i, end=off + 2 + 2 * i)
        if self.reward is not None:
            t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                                 "agentlightning.reward.0.value": self.reward},
                   parent=root, start=off + 25, end=off + 25.5)
        for i, late in enumerate(self.late):
            t.span("chat m1", {**genai_call(f"{self.task} late {i}", f"late {i}"), **attrs}, parent=root,
                   start=off + late, end=off + late + 1)
        keep = len(t.spans) - len(self.late)
        t.spans = t.spans[:keep] if which == "early" else [t.spans[keep + int(which[5:])]]
        return t


@dataclass
class History:
    """One generated history, played against an incremental and a full build."""

    seed: int
    root: Path
    rng: random.Random = None
    clock: int = 0
    trajs: list[Traj] = field(default_factory=list)
    pending: list[tuple[Traj, int]] = field(default_factory=list)  # late calls not sent yet
    feedback_files: list[str] = field(default_factory=list)
    batches: int = 0
    log: list[str] = field(default_factory=list)
    #: some trajectories continue others' calls (`Traj.chained`), drawn from a numbers
    #: stream of their own: without it a history draws the same numbers as it always did
    chains: bool = False
    #: some trajectories' roots link to an earlier one's, from a numbers stream of their own
    links: bool = False

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.chain_rng = random.Random(f"chains-{self.seed}")
        self.link_rng = random.Random(f"links-{self.seed}")
        self.clock = MIDNIGHT + self.rng.randrange(0, DAY)
        self.data = self.root / "data"
        self.data.mkdir(parents=True)
        self.store = DatasetStore(str(self.data))  # one, as a running collector has

    def batch(self) -> str:
        self.batches += 1
        return f"b{self.batches:03d}"

    def send(self, traces: list[Trace]) -> None:
        """Spans through the collector's conversion and dataset writer, arriving now."""
        sb = SpanBuilder()
        sb.add_request(request(traces), self.clock)
        w = self.store.writer("spans", self.batch())
        w.add(sb.table(), sb.dates)
        w.commit()

    def arrive(self) -> None:
        r = self.rng
        new = []
        for _ in range(r.randint(1, 3)):
            # started before now, often near a midnight, sometimes a day or two back
            start = self.clock - r.choice([r.randrange(0, 2 * HOUR), r.randrange(0, 2 * DAY)])
            if r.random() < 0.3:
                start = start - start % DAY + DAY - r.randrange(0, 120) * S  # in the last two minutes of a day
            late = [r.choice([40.0, 3 * 3600.0, 26 * 3600.0]) for _ in range(r.choice([0, 0, 1, 2]))]
            t = Traj(f"h{self.seed}-t{len(self.trajs)}", start, r.choice(["task a", "task b", "task c"]),
                     r.randint(1, 3), r.choice([None, 0.0, 0.5, 1.0]), r.choice([None, None, "s1", "s2"]),
                     r.random() < 0.85, late)
            if self.chains:
                self.chain(t)
            if self.links and self.trajs and self.link_rng.random() < 0.4:
                t.link = self.link_rng.choice(self.trajs).seed
            self.trajs.append(t)
            self.pending += [(t, i) for i in range(len(late))]
            new.append(t)
        self.send([t.trace("early") for t in new])
        self.log.append(f"arrive {[(t.seed, t.start, t.calls, t.rooted, t.late) for t in new]} at {self.clock}")

    def chain(self, t: Traj) -> None:
        """Make `t` continue an earlier trajectory's calls, often one of another day."""
        c = self.chain_rng
        how = c.choice(["continue", "continue", "delta", None])
        if how == "continue":
            earlier = [e for e in self.trajs if e is not t and e.chained and e.chained[0] == "continue"]
            before = c.choice(earlier).response(c.choice(earlier).calls - 1) if earlier and c.random() < 0.8 else (
                "resp-made-outside" if c.random() < 0.3 else None)
            t.chained = ("continue", before)
        elif how == "delta":
            t.session = c.choice(["d1", "d2"])
            t.chained = ("delta", any(e.session == t.session for e in self.trajs if e is not t))

    def late(self) -> None:
        t, i = self.pending.pop(self.rng.randrange(len(self.pending)))
        self.send([t.trace(f"late:{i}")])
        self.log.append(f"late span {i} of {t.seed} (+{t.late[i]} s) at {self.clock}")

    def feedback(self) -> None:
        r = self.rng
        rows = []
        for k in range(r.randint(1, 2)):
            row = {"feedback_id": f"f{self.seed}-{self.batches}-{k}", "name": "thumbs", "value": r.choice([0.0, 1.0]),
                   "received_time": self.clock, "source": "http"}
            if r.random() < 0.15:
                row["conversation_id"] = r.choice(["s1", "s2"])
            else:  # a trajectory seen, or one whose spans have not come yet
                t = r.choice(self.trajs) if self.trajs and r.random() < 0.9 else Traj(f"h{self.seed}-unseen", 0, "", 0, None,
                                                                                      None, True)
                row["trace_id"] = Trace(t.seed).hex
            rows.append(row)
        before = set(self._feedback_paths())
        write_feedback(self.data, rows, batch=self.batch(), store=self.store)
        self.feedback_files += sorted(set(self._feedback_paths()) - before)
        self.log.append(f"feedback {[(x.get('trace_id') or x.get('conversation_id'), x['value']) for x in rows]}")

    def _feedback_paths(self) -> list[str]:
        return [str(p) for p in (self.data / "feedback").rglob("*.parquet")]

    def unfeedback(self) -> None:
        path = self.feedback_files.pop(self.rng.randrange(len(self.feedback_files)))
        os.remove(path)
        self.log.append(f"feedback file removed {os.path.basename(path)}")

    def tick(self) -> None:
        step = self.rng.choice([60, 300, 700, 3700, 4 * 3600, 20 * 3600])
        self.clock += step * S
        self.log.append(f"clock +{step} s")

    def unpartition(self) -> None:
        parts = sorted((self.data / "transitions").glob("date=*"))
        if parts:
            victim = self.rng.choice(parts)
            shutil.rmtree(victim)
            self.log.append(f"partition deleted by hand {victim.name}")

    def event(self) -> None:
        r = self.rng
        choices = ["arrive", "arrive", "tick", "tick", "feedback"]
        if self.pending:
            choices += ["late", "late"]
        if self.feedback_files:
            choices.append("unfeedback")
        if r.random() < 0.04:
            choices = ["unpartition"]
        getattr(self, r.choice(choices))()


def write_feedback(data, rows: list[dict], batch: str, store: DatasetStore | None = None) -> None:
    cols = {f.name: [r.get(f.name) for r in rows] for f in feedback_schema.SCHEMA}
    t = pa.table({k: pa.array(v, feedback_schema.SCHEMA.field(k).type) for k, v in cols.items()},
                 schema=feedback_schema.SCHEMA)
    w = (store or DatasetStore(str(data))).writer("feedback", batch)
    w.add(t, [r["received_time"] for r in rows])
    w.commit()


def crash_at(monkeypatch, point: int) -> None:
    """The next build dies after its `point`-th partition write (0: before the state)."""
    writes = [0]
    real_write, real_save = output.write_partition, incremental.save

    def write(*a, **kw):
        n = real_write(*a, **kw)
        writes[0] += 1
        if writes[0] == point:
            raise Crash(f"after partition write {point}")
        return n

    def save(*a, **kw):
        raise Crash("before the state was written")

    monkeypatch.setattr(output, "write_partition", write)
    monkeypatch.setattr(incremental, "save", save)

    def undo():
        monkeypatch.setattr(output, "write_partition", real_write)
        monkeypatch.setattr(incremental, "save", real_save)
    return undo


def play(seed: int, root: Path, monkeypatch, rounds: int, upkeep=None, chains: bool = False, links: bool = False,
         **settings) -> None:
    """A first arrival and build (no state yet: a full one), then `rounds` rounds of one
    to four events and an incremental build (now and then crashing, then run again),
    each compared with a full build. `upkeep(h, before_build)`, when given, acts on
    the lake after each event and before each build (test_retention.py: prunes and
    compactions); without it a history draws the same numbers as it always did.
    `chains`: some trajectories continue others' calls (`Traj.chained`); `links`: some
    link to others (`Traj.link`); `settings`: the build's (both builds')."""
    h = History(seed, root, chains=chains, links=links)
    h.arrive()
    for step in range(rounds + 1):
        for _ in range(h.rng.randint(1, 4) if step else 0):
            h.event()
            if upkeep:
                upkeep(h, False)
        if upkeep and step:
            upkeep(h, True)
            if not list(Path(h.data, "spans").rglob("*.parquet")):
                h.log.append("every span pruned: nothing to build from")
                continue
        if h.rng.random() < 0.12:
            point = h.rng.choice([0, 1, 2])
            undo = crash_at(monkeypatch, point)
            h.log.append(f"incremental build at {h.clock}, crashing "
                         f"({'before the state' if not point else f'after partition write {point}'})")
            try:
                B.build(cfg_for(h.data, incremental=True, **settings), now_ns=h.clock)
            except Crash:
                pass
            finally:
                undo()
        budget = h.rng.choice([512 << 20] * 7 + [40_000])  # now and then in a few buckets of traces
        h.log.append(f"incremental build at {h.clock}, memory_budget {budget}")
        summary = B.build(cfg_for(h.data, incremental=True, memory_budget=budget, **settings), now_ns=h.clock)
        h.log.append(f"  -> {summary.incremental} ({summary.buckets} bucket(s))")
        if not step:
            continue
        diff = same(transitions(h.data), full_build(h.data, root / "full", h.clock, **settings))
        if diff:
            raise AssertionError(f"history {seed}, build {step}: {diff}\n  " + "\n  ".join(h.log))


#: Histories run by default (at least 200); NIGHTSHIFT_HISTORIES=5000 for a longer campaign,
#: NIGHTSHIFT_HISTORY_SEED=n to replay one.
HISTORIES = int(os.environ.get("NIGHTSHIFT_HISTORIES", "200"))
FIRST = int(os.environ.get("NIGHTSHIFT_HISTORY_SEED", "0"))


@pytest.mark.parametrize("block", range(4))
def test_incremental_equals_full_over_generated_histories(tmp_path, monkeypatch, block):
    """A quarter of the histories each, so one that fails says where, soon."""
    for seed in range(FIRST + block, FIRST + HISTORIES, 4):
        play(seed, tmp_path / f"h{seed}", monkeypatch, rounds=2)
        shutil.rmtree(tmp_path / f"h{seed}")


@pytest.mark.parametrize("block", range(2))
def test_incremental_equals_full_where_traces_continue_each_others_calls(tmp_path, monkeypatch, block):
    """Histories where calls continue stored responses of other traces and
    conversations send deltas across traces, often across days and buckets: a
    history is carried within a day only, in every build (`transform.chains`)."""
    for seed in range(FIRST + block, FIRST + HISTORIES // 4, 2):
        play(seed, tmp_path / f"h{seed}", monkeypatch, rounds=2, chains=True)
        shutil.rmtree(tmp_path / f"h{seed}")


@pytest.mark.parametrize("block", range(2))
def test_incremental_equals_full_for_conversation_trajectories(tmp_path, monkeypatch, block):
    """`trajectory: conversation`: a conversation's traces on any dates make one
    trajectory, and feedback may name the conversation; with traces continuing each
    other's calls besides (its deltas' conversations are conversations too)."""
    for seed in range(FIRST + block, FIRST + HISTORIES // 4, 2):
        play(seed, tmp_path / f"h{seed}", monkeypatch, rounds=2, chains=True, trajectory="conversation")
        shutil.rmtree(tmp_path / f"h{seed}")


# --- each way the old incremental build went wrong ---------------------------------------------------


def episode(seed: str, reward: float | None, start: int = T0, *, calls: int = 2, task: str = "task") -> Trace:
    return Traj(seed, start, task, calls, reward, None, True).trace("early")


def check_equal(data, now_ns: int, tmp_path, **kw) -> object:
    summary = B.build(cfg_for(data, incremental=True, **kw), now_ns=now_ns)
    diff = same(transitions(data), full_build(data, tmp_path / "full", now_ns, **kw))
    assert not diff, diff
    return summary


def test_a_trajectory_waiting_to_settle_is_built_when_it_settles(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("waits", 1.0)], received_ns=T0 + 60 * S)
    s = check_equal(data, T0 + 120 * S, tmp_path)  # a minute after its last span: waiting
    assert (s.waiting, s.transitions) == (1, 0) and transitions(data).height == 0
    s = check_equal(data, T0 + 60 * S + 700 * S, tmp_path)  # nothing new arrived, but it settled
    assert "settled" in s.incremental and transitions(data).height == 2


def test_a_removed_feedback_file_takes_its_reward_away(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("rated", 0.0)])
    write_feedback(data, [{"feedback_id": "x", "trace_id": Trace("rated").hex, "name": "thumbs", "value": 1.0,
                           "received_time": T0 + HOUR, "source": "http"}], batch="fb")
    check_equal(data, T0 + DAY, tmp_path)
    assert set(transitions(data)["reward"]) == {1.0}
    [path] = (data / "feedback").rglob("*.parquet")
    path.unlink()  # retracted
    s = check_equal(data, T0 + DAY, tmp_path)
    assert set(transitions(data)["reward"]) == {0.0} and "removed feedback" in s.incremental


def test_a_feedback_file_rewritten_under_its_name_is_read_again(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("relabelled", 0.0)])
    row = {"feedback_id": "x", "trace_id": Trace("relabelled").hex, "name": "thumbs", "value": 1.0,
           "received_time": T0 + HOUR, "source": "http"}
    write_feedback(data, [row], batch="fb")
    check_equal(data, T0 + DAY, tmp_path)
    [path] = (data / "feedback").rglob("*.parquet")
    path.unlink()
    write_feedback(data, [{**row, "value": 0.25}], batch="fb")  # the same name, another label
    check_equal(data, T0 + DAY, tmp_path)
    assert set(transitions(data)["reward"]) == {0.25}


def test_a_trace_that_started_before_midnight_stays_in_its_date(tmp_path):
    """A late span after midnight lands in the next date's partition; the trajectory
    stays whole, in the date it started on, not half in each."""
    data = tmp_path / "data"
    day2 = MIDNIGHT + DAY
    t = Traj("night", day2 - 60 * S, "night task", 1, 1.0, None, True, late=[3 * 3600.0])
    write_spans(str(data), [t.trace("early")], batch="a", received_ns=day2)
    check_equal(data, day2 + HOUR, tmp_path)
    write_spans(str(data), [t.trace("late:0")], batch="b", received_ns=day2 + 4 * HOUR)
    check_equal(data, day2 + 5 * HOUR, tmp_path)
    write_spans(str(data), [episode("next day", 0.0, day2 + DAY + HOUR)], batch="c", received_ns=day2 + DAY + 2 * HOUR)
    check_equal(data, day2 + DAY + 3 * HOUR, tmp_path)
    got = transitions(data).filter(pl.col("trace_id") == Trace("night").hex)
    assert got.height == 2 and set(got["date"].cast(pl.String)) == {"2025-11-22"}


def test_a_span_two_days_late_rebuilds_the_date_its_trace_started_on(tmp_path):
    data = tmp_path / "data"
    t = Traj("slow", T0, "slow task", 1, 1.0, None, True, late=[2 * 86400.0])
    write_spans(str(data), [t.trace("early"), episode("other", 0.0)], batch="a", received_ns=T0 + HOUR)
    check_equal(data, T0 + 2 * HOUR, tmp_path)
    write_spans(str(data), [t.trace("late:0")], batch="b", received_ns=T0 + 2 * DAY + HOUR)
    s = check_equal(data, T0 + 2 * DAY + 2 * HOUR, tmp_path)
    assert "2025-11-22" in s.partitions
    assert transitions(data).filter(pl.col("trace_id") == Trace("slow").hex).height == 2


def test_advantages_are_pooled_with_the_dates_kept(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("p1", 1.0), episode("p2", 0.0, task="other")], batch="a")
    check_equal(data, T0 + DAY, tmp_path)
    before = transitions(data)
    write_spans(str(data), [episode("p3", 0.0, T0 + 2 * DAY, task="task")], batch="b")
    s = check_equal(data, T0 + 3 * DAY, tmp_path)
    assert s.partitions == ["2025-11-24"] and s.repooled == ["2025-11-22"]
    moved = transitions(data).filter(pl.col("date") == pl.date(2025, 11, 22))
    assert not moved["advantage"].equals(before["advantage"])  # p1 now has a peer in its group


def test_a_partition_deleted_by_hand_is_rebuilt(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("d1", 1.0)], batch="a")
    write_spans(str(data), [episode("d2", 0.0, T0 + DAY)], batch="b")
    check_equal(data, T0 + 2 * DAY, tmp_path)
    shutil.rmtree(data / "transitions" / "date=2025-11-22")
    s = check_equal(data, T0 + 2 * DAY, tmp_path)
    assert s.partitions == ["2025-11-22"] and "changed since the last incremental build" in s.incremental


def _same_size_rewrite(tmp_path) -> tuple[Path, Path]:
    """Two span files of one batch name and one size, different content."""
    sizes: dict[int, Path] = {}
    for i, reward in enumerate([0.25, 0.75, 0.5, 0.125, 0.375, 0.625, 0.875]):
        d = tmp_path / f"try{i}"
        write_spans(str(d), [episode("copy", reward)], batch="same")
        [p] = (d / "spans").rglob("*.parquet")
        if p.stat().st_size in sizes:
            return sizes[p.stat().st_size], p
        sizes[p.stat().st_size] = p
    pytest.fail("no two files of the same size")


def test_a_span_file_replaced_by_other_content_of_the_same_size_is_read_again(tmp_path):
    first, second = _same_size_rewrite(tmp_path)
    data = tmp_path / "data"
    target = data / "spans" / first.parent.name / first.name
    target.parent.mkdir(parents=True)
    shutil.copyfile(first, target)
    check_equal(data, T0 + DAY, tmp_path)
    was = set(transitions(data)["reward"])
    shutil.copyfile(second, target)  # a user's copy: same name, same size
    assert target.stat().st_size == first.stat().st_size
    check_equal(data, T0 + DAY, tmp_path)
    assert set(transitions(data)["reward"]) != was


def test_log_events_that_arrive_late_are_built_in(tmp_path):
    data = tmp_path / "data"
    t = Trace("logged")
    sid = t.span("chat m1", {"gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "m1"},
                 start=1, end=2)
    write_spans(str(data), [t])
    check_equal(data, T0 + DAY, tmp_path)
    write_logs(str(data), [{"trace": t, "span": sid, "name": "gen_ai.user.message", "body": {"content": "hi"}},
                           {"trace": t, "span": sid, "name": "gen_ai.choice",
                            "body": {"index": 0, "finish_reason": "stop", "message": {"content": "yo"}}}])
    check_equal(data, T0 + DAY, tmp_path)
    assert transitions(data)["output_message"][0]["content"] == "yo"


def test_a_conversation_two_days_later_rebuilds_the_day_it_started_on_not_every_day(tmp_path):
    """Conversation trajectories build incrementally: a trace that joins a conversation
    begun two days earlier rebuilds the day the conversation started (its trajectory's)
    and its own, not the days between."""
    data = tmp_path / "data"
    a = Traj("c1", T0, "task", 1, 1.0, "conv", True).trace("early")
    b = Traj("c2", T0 + 2 * DAY, "task", 1, None, "conv", True).trace("early")
    other = Traj("o1", T0 + DAY, "task", 1, 0.0, None, True).trace("early")
    write_spans(str(data), [a, other], batch="a")
    check_equal(data, T0 + DAY + HOUR, tmp_path, trajectory="conversation")
    write_spans(str(data), [b], batch="b")
    s = check_equal(data, T0 + 3 * DAY, tmp_path, trajectory="conversation")
    assert "full build" not in s.incremental and "rebuilding" in s.incremental
    day = lambda ns: str(dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).date())  # noqa: E731
    assert day(T0 + DAY) not in s.partitions and {day(T0), day(T0 + 2 * DAY)} <= set(s.partitions)
    rows = transitions(data)
    assert rows.filter(pl.col("trace_id").is_in([a_.hex for a_ in (a, b)]))["trajectory_id"].n_unique() == 1


@pytest.mark.parametrize("block", range(2))
def test_incremental_equals_full_for_linked_trajectories(tmp_path, monkeypatch, block):
    """`trajectory: linked`: traces joined by their roots' links on any dates make one
    trajectory (AutoGen's trace per message), built incrementally."""
    for seed in range(FIRST + block, FIRST + HISTORIES // 4, 2):
        play(seed, tmp_path / f"h{seed}", monkeypatch, rounds=2, links=True, trajectory="linked")
        shutil.rmtree(tmp_path / f"h{seed}")


def test_a_clock_before_the_last_builds_gives_a_full_build(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [episode("early", 1.0)], received_ns=T0 + HOUR)
    check_equal(data, T0 + DAY, tmp_path)
    s = check_equal(data, T0 + HOUR + 60 * S, tmp_path)  # not settled by this clock
    assert "before the last build's" in s.incremental and transitions(data).height == 0


def test_a_crash_between_the_partitions_and_the_state_is_redone(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_spans(str(data), [episode("c1", 1.0)], batch="a")
    check_equal(data, T0 + DAY, tmp_path)
    write_spans(str(data), [episode("c2", 0.0, T0 + DAY)], batch="b")
    undo = crash_at(monkeypatch, 0)
    with pytest.raises(Crash):
        B.build(cfg_for(data, incremental=True), now_ns=T0 + 2 * DAY)
    undo()
    s = check_equal(data, T0 + 2 * DAY, tmp_path)
    assert "2025-11-23" in s.partitions  # redone, not taken for done


# --- the state file ---------------------------------------------------------------------------------


def _key() -> str:
    return incremental.settings_key(cfg_for("x"))


@pytest.mark.parametrize("text,said", [
    ('{"version": 2, "settings": "', "unreadable"),  # cut short
    ("[1, 2]", "not a JSON object"),
    ('{"version": 1, "settings": "KEY", "spans": [["a", 1]], "feedback": "x"}', "another version"),
    ('{"version": 2, "settings": "KEY", "now": 0, "spans": {"2025-11-22": [["a", 1]]}, "logs": {}, '
     '"feedback": {}, "dates": {}, "partitions": {}}', "not what a build writes"),
    ('{"version": 2, "settings": "KEY", "now": 0, "spans": {}, "logs": {}, "feedback": {}, '
     '"dates": {"2025-11-22": {"reach": "2025-11-23", "settle": null}}, "partitions": {}}', "not what a build writes"),
])
def test_a_bad_state_file_is_named_and_gives_a_full_build(tmp_path, caplog, text, said):
    data = tmp_path / "data"
    write_spans(str(data), [episode("s", 1.0)])
    (data / "build").mkdir(parents=True)
    (data / "build" / "state.json").write_text(text.replace("KEY", _key()))
    with caplog.at_level("WARNING", logger="nightshift.transform"):
        s = check_equal(data, T0 + DAY, tmp_path)
    assert said in s.incremental and "state.json" in s.incremental and "full build" in s.incremental
    assert said in caplog.text
    s = check_equal(data, T0 + DAY, tmp_path)  # and it wrote a good one
    assert s.incremental.startswith("nothing changed")


def test_the_state_is_written_durably_through_the_shared_writer(tmp_path, monkeypatch):
    data = tmp_path / "data"
    write_spans(str(data), [episode("d", 1.0)])
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    real_save = incremental.save
    monkeypatch.setattr(incremental, "save", lambda *a, **kw: (synced.clear(), real_save(*a, **kw)))
    B.build(cfg_for(data, incremental=True), now_ns=T0 + DAY)
    state = str(data / "build" / "state.json")
    assert any(p.startswith(str(data / "build") + "/.state.json") for p in synced)  # the file, before its rename
    assert str(data / "build") in synced  # the folder, after it
    assert json.loads(Path(state).read_text())["version"] == incremental.VERSION
    assert [p.name for p in (data / "build").iterdir()] == ["state.json"]


def test_an_incremental_build_on_an_object_store(tmp_path):
    """fsspec all the way: the state through the shared writer's one PUT, kept
    partitions whose advantages moved rewritten in place, and read back like a full
    build's (which reads the same object store)."""
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://incremental-{tmp_path.name}"

    def rows(prefix: str) -> pl.DataFrame:
        frames = []
        for path in sorted(fs.glob(f"{prefix}/transitions/date=*/*.parquet")):
            with fs.open(path, "rb") as fh:
                frames.append(pl.read_parquet(fh).with_columns(pl.lit(path.split("/")[-2]).alias("date")))
        return pl.concat(frames).sort("transition_id")

    write_spans(url, [episode("o1", 1.0), episode("o2", 0.0, task="other")], batch="a", received_ns=T0)
    B.build(cfg_for(url, incremental=True), now_ns=T0 + HOUR)
    write_spans(url, [episode("o3", 0.0, T0 + 2 * DAY)], batch="b", received_ns=T0 + 2 * DAY)
    s = B.build(cfg_for(url, incremental=True, memory_budget=1000), now_ns=T0 + 3 * DAY)  # bucketed too
    assert s.partitions == ["2025-11-24"] and s.repooled == ["2025-11-22"] and s.buckets > 1
    inc = rows(url.removeprefix("memory://"))
    fresh = f"memory://incremental-full-{tmp_path.name}"
    for path in fs.glob(f"{url.removeprefix('memory://')}/spans/**/*.parquet"):
        fs.pipe(path.replace(url.removeprefix("memory://"), fresh.removeprefix("memory://"), 1), fs.cat(path))
    B.build(cfg_for(fresh), now_ns=T0 + 3 * DAY)
    assert same(inc, rows(fresh.removeprefix("memory://"))) == ""
    state = json.loads(fs.cat(f"{url.removeprefix('memory://')}/build/state.json"))
    assert state["version"] == incremental.VERSION and set(state["partitions"]) == {"2025-11-22", "2025-11-24"}


def test_spans_without_a_start_time_are_built_into_the_date_they_arrived(tmp_path):
    """OTLP's 0 (no start time): the collector files such a span by its arrival, and
    the build used to fail on it with a traceback, in every build."""
    data = tmp_path / "data"
    t = Trace("no start")
    t.span("chat m1", genai_call("q", "a"), start=0, end=0)
    write_spans(str(data), [t], base_ns=0, received_ns=T0)
    check_equal(data, T0 + DAY, tmp_path)
    assert transitions(data)["date"].cast(pl.String).to_list() == ["2025-11-22"]
