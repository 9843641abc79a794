"""The lake's retention (transform/retention.py): old dates go from every dataset,
a trace is pruned whole, and the lake it leaves builds, incrementally or in full,
into the same rows, whatever crash stops the prune. The generated histories here
compact the lake too (transform/compaction.py; its own tests: test_compaction.py)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from nightshift.transform import build as B
from nightshift.transform import compaction, output, retention
from nightshift.transform.retention import RetentionError, prune
from test_incremental import DAY, HOUR, MIDNIGHT, S, Crash, History, Traj, cfg_for, full_build, play, same, transitions
from traces import write_spans


def when(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc)


def spans(data) -> pl.DataFrame:
    files = sorted(Path(data, "spans").rglob("*.parquet"))
    return pl.concat([pl.read_parquet(f).with_columns(pl.lit(f.parent.name).alias("part")) for f in files]) if files \
        else pl.DataFrame()


def traj(seed: str, start: int, *, calls: int = 2, reward: float | None = 1.0, late: list[float] | None = None,
         task: str = "task") -> Traj:
    return Traj(seed, start, task, calls, reward, None, True, late or [])


# --- what goes and what stays ----------------------------------------------------------------------


def test_a_trace_that_crossed_the_cutoff_goes_whole_and_the_rest_stays_as_it_was(tmp_path):
    data = tmp_path / "data"
    # three days: an old trace, one that started two minutes before the cutoff's midnight and went on
    # past it (a late call 5 minutes in), and a trace of the first day kept
    day0 = MIDNIGHT
    crossing = traj("crosses", day0 + DAY - 120 * S, late=[300.0])
    write_spans(str(data), [traj("old", day0 + HOUR).trace("early"), crossing.trace("early")], batch="a",
                received_ns=day0 + DAY)
    write_spans(str(data), [crossing.trace("late:0"), traj("kept", day0 + DAY + HOUR).trace("early")], batch="b",
                received_ns=day0 + DAY + 2 * HOUR)
    write_spans(str(data), [traj("today", day0 + 2 * DAY + HOUR).trace("early")], batch="c",
                received_ns=day0 + 2 * DAY + 2 * HOUR)
    B.build(cfg_for(data, incremental=True), now_ns=day0 + 2 * DAY + 3 * HOUR)
    before = spans(data)
    assert sorted(set(before["part"])) == ["date=2025-11-22", "date=2025-11-23", "date=2025-11-24"]
    kept_file = next(Path(data, "spans", "date=2025-11-23").glob("*.parquet"))
    schema_before = pq.read_schema(kept_file)

    result = prune(str(data), 1, now=when(day0 + 2 * DAY + 3 * HOUR))

    assert result.cutoff == "2025-11-23" and result.dates["spans"] == ["2025-11-22"]
    assert result.dates["transitions"] == ["2025-11-22"]
    assert (result.traces, result.rewritten) == (1, 1), result.lines()
    after = spans(data)
    from traces import Trace
    gone = {Trace("old").hex, Trace("crosses").hex}
    assert not set(after["trace_id"]) & gone  # the crossing trace's call after midnight went with it
    # every other span as it was, every column
    keep = before.filter(~pl.col("trace_id").is_in(list(gone))).sort("span_id")
    assert after.sort("span_id").equals(keep)
    assert pq.read_schema(kept_file).equals(schema_before, check_metadata=True)  # the schema version kept
    assert not Path(data, "spans", "date=2025-11-22").exists()
    assert not Path(data, "transitions", "date=2025-11-22").exists()
    # the lake it leaves: the next incremental build equals a full one, and no orphan of the crossing trace
    check = B.build(cfg_for(data, incremental=True), now_ns=day0 + 2 * DAY + 3 * HOUR)
    assert "2025-11-23" in check.incremental
    inc = transitions(data)
    assert same(inc, full_build(data, tmp_path / "full", day0 + 2 * DAY + 3 * HOUR)) == ""
    assert not inc.filter(pl.col("flags").list.contains("orphan")).height
    assert sorted(inc["date"].cast(str).unique()) == ["2025-11-23", "2025-11-24"]
    assert any("rewrote 1 file(s)" in line for line in result.lines())


def test_log_records_of_a_pruned_trace_go_and_uncorrelated_ones_stay(tmp_path):
    from types import SimpleNamespace

    from traces import Trace, write_logs

    data = tmp_path / "data"
    crossing = traj("crosses", MIDNIGHT + DAY - 60 * S, late=[120.0])
    write_spans(str(data), [crossing.trace("early")], batch="a", received_ns=MIDNIGHT + DAY)
    write_spans(str(data), [crossing.trace("late:0"), traj("kept", MIDNIGHT + DAY + HOUR).trace("early")], batch="b",
                received_ns=MIDNIGHT + DAY + 2 * HOUR)
    span = bytes.fromhex("00" * 7 + "01")
    write_logs(str(data), [{"trace": Trace("crosses"), "span": span, "name": "gen_ai.choice", "body": "late"},
                           {"trace": SimpleNamespace(trace_id=b""), "span": b"", "name": "app.event", "body": "free"},
                           {"trace": Trace("kept"), "span": span, "name": "gen_ai.choice", "body": "kept"}],
               batch="l1", base_ns=MIDNIGHT + DAY + 10 * 60 * S)
    before = pl.read_parquet(next(Path(data, "logs").rglob("*.parquet")))
    assert before.height == 3 and before["trace_id"].null_count() == 1
    r = prune(str(data), 1, now=when(MIDNIGHT + 2 * DAY))
    assert (r.rewritten, r.rows) == (2, 2)  # the span file and the log file, a row each
    after = pl.read_parquet(next(Path(data, "logs").rglob("*.parquet")))
    assert after.equals(before.filter(pl.col("trace_id").is_null() | (pl.col("trace_id") != Trace("crosses").hex)))


def test_a_dry_run_says_the_same_and_changes_nothing(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR, late=[DAY / S]).trace("early")], batch="a",
                received_ns=MIDNIGHT + 2 * HOUR)
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR, late=[DAY / S]).trace("late:0")], batch="b",
                received_ns=MIDNIGHT + DAY + 2 * HOUR)

    def listing():  # the lock file aside: a build makes it too
        return sorted((p, p.stat().st_mtime_ns) for p in Path(data).rglob("*") if p.name != output.LOCK)

    before = listing()
    dry = prune(str(data), 1, now=when(MIDNIGHT + 2 * DAY + HOUR), dry_run=True)
    assert listing() == before
    assert "would remove 1 date(s)" in "\n".join(dry.lines()) and "would rewrite 1 file(s)" in "\n".join(dry.lines())
    wet = prune(str(data), 1, now=when(MIDNIGHT + 2 * DAY + HOUR))
    assert (dry.dates, dry.files, dry.bytes, dry.traces, dry.rewritten, dry.rows) == \
        (wet.dates, wet.files, wet.bytes, wet.traces, wet.rewritten, wet.rows)
    assert not list(Path(data, "spans").rglob("*.parquet"))  # the kept file held only that trace: gone too


def test_nothing_goes_at_zero_days_or_within_the_days(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR).trace("early")], received_ns=MIDNIGHT + 2 * HOUR)
    files = sorted(Path(data).rglob("*.parquet"))
    assert prune(str(data), 0, now=when(MIDNIGHT + 30 * DAY)).dates == {}
    # 7 days kept besides today: the date 7 days back stays, 8 days back goes
    r = prune(str(data), 7, now=when(MIDNIGHT + 7 * DAY + 23 * HOUR))
    assert r.cutoff == "2025-11-22" and not any(r.dates.values()) and sorted(Path(data).rglob("*.parquet")) == files
    assert r.lines()[-1].strip() == "nothing older: nothing removed"
    assert prune(str(data), 7, now=when(MIDNIGHT + 8 * DAY)).dates["spans"] == ["2025-11-22"]


def test_a_partition_named_with_no_date_is_refused_before_anything_goes(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR).trace("early")], received_ns=MIDNIGHT + 2 * HOUR)
    (data / "logs" / "date=yesterday").mkdir(parents=True)
    with pytest.raises(RetentionError, match=r"logs/date=yesterday: a partition whose name is not a date"):
        prune(str(data), 1, now=when(MIDNIGHT + 5 * DAY))
    assert list(Path(data, "spans").rglob("*.parquet"))


def test_a_build_holding_the_lake_is_waited_for_not_raced(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR).trace("early")], received_ns=MIDNIGHT + 2 * HOUR)
    import fsspec

    fs = fsspec.filesystem("file")
    with output.held(fs, str(data)):
        with pytest.raises(RetentionError, match="another build .* is writing .*: wait for it to finish; prune after it"):
            prune(str(data), 1, now=when(MIDNIGHT + 5 * DAY))
    assert list(Path(data, "spans").rglob("*.parquet"))


def test_a_collectors_file_in_flight_keeps_its_folder(tmp_path):
    data = tmp_path / "data"
    write_spans(str(data), [traj("a", MIDNIGHT + HOUR).trace("early")], received_ns=MIDNIGHT + 2 * HOUR)
    part = Path(data, "spans", "date=2025-11-22")
    (part / "part-x.parquet.tmp-1234abcd").write_bytes(b"being written")
    prune(str(data), 1, now=when(MIDNIGHT + 5 * DAY))
    assert [p.name for p in part.iterdir()] == ["part-x.parquet.tmp-1234abcd"]


def test_a_rewrite_killed_before_its_rename_leaves_the_old_file_and_the_next_prune_finishes(tmp_path, monkeypatch):
    data = tmp_path / "data"
    crossing = traj("crosses", MIDNIGHT + DAY - 60 * S, late=[120.0])
    write_spans(str(data), [crossing.trace("early")], batch="a", received_ns=MIDNIGHT + DAY)
    write_spans(str(data), [crossing.trace("late:0"), traj("kept", MIDNIGHT + DAY + HOUR).trace("early")], batch="b",
                received_ns=MIDNIGHT + DAY + 2 * HOUR)
    kept = Path(data, "spans", "date=2025-11-23", "part-b.parquet")
    before = kept.read_bytes()

    def killed(*a):
        raise Crash("killed between the rewrite and its rename")

    monkeypatch.setattr(retention.os, "replace", killed)
    monkeypatch.setattr(retention.os, "remove", lambda *a: None)  # killed: its own cleanup never ran
    with pytest.raises(Crash):
        prune(str(data), 1, now=when(MIDNIGHT + 2 * DAY))
    monkeypatch.undo()
    assert kept.read_bytes() == before and Path(data, "spans", "date=2025-11-22").exists()  # nothing half done
    assert len(list(kept.parent.glob(f"*{retention.TMP}"))) == 1
    r = prune(str(data), 1, now=when(MIDNIGHT + 2 * DAY))
    assert (r.rewritten, r.dates["spans"]) == (1, ["2025-11-22"])
    assert sorted(p.name for p in kept.parent.iterdir()) == ["part-b.parquet"]  # the leftover gone too
    from traces import Trace
    assert set(pl.read_parquet(kept)["trace_id"]) == {Trace("kept").hex}


def test_on_an_object_store(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://retention-{tmp_path.name}"
    base = url.removeprefix("memory://")
    crossing = traj("crosses", MIDNIGHT + DAY - 60 * S, late=[120.0])
    write_spans(url, [crossing.trace("early"), traj("old", MIDNIGHT + HOUR).trace("early")], batch="a",
                received_ns=MIDNIGHT + DAY)
    write_spans(url, [crossing.trace("late:0"), traj("kept", MIDNIGHT + DAY + HOUR).trace("early")], batch="b",
                received_ns=MIDNIGHT + DAY + 2 * HOUR)
    B.build(cfg_for(url), now_ns=MIDNIGHT + 2 * DAY)
    r = prune(url, 1, now=when(MIDNIGHT + 2 * DAY))
    assert (r.dates["spans"], r.dates["transitions"], r.traces, r.rewritten) == (["2025-11-22"], ["2025-11-22"], 1, 1)
    assert not fs.glob(f"{base}/spans/date=2025-11-22/*") and not fs.glob(f"{base}/transitions/date=2025-11-22/*")
    with fs.open(fs.glob(f"{base}/spans/date=2025-11-23/*.parquet")[0], "rb") as fh:
        left = pl.read_parquet(fh)
    from traces import Trace
    assert set(left["trace_id"]) == {Trace("kept").hex}


# --- the lake it leaves, over generated histories ----------------------------------------------------


def _prune_crashing(h: History, monkeypatch, days: int) -> None:
    """A prune that dies after its `k`-th file rewritten or partition removed."""
    k = h.rng.choice([1, 2, 3])
    steps = [0]

    def counted(real):
        def f(*a, **kw):
            out = real(*a, **kw)
            steps[0] += 1
            if steps[0] == k:
                raise Crash(f"prune, after step {k}")
            return out
        return f

    monkeypatch.setattr(retention, "_without", counted(retention._without))
    monkeypatch.setattr(retention, "_remove_partition", counted(retention._remove_partition))
    try:
        prune(str(h.data), days, now=when(h.clock))
        h.log.append(f"prune {days} day(s) at {h.clock} (finished before step {k})")
    except Crash as e:
        h.log.append(f"prune {days} day(s) at {h.clock}: crashed ({e})")
    finally:
        monkeypatch.undo()


def _prune(h: History, monkeypatch) -> None:
    days = h.rng.choice([1, 1, 2])
    if h.rng.random() < 0.3:
        _prune_crashing(h, monkeypatch, days)
    else:
        r = prune(str(h.data), days, now=when(h.clock))
        h.log.append(f"prune {days} day(s) at {h.clock}: {r.dates}, {r.traces} trace(s) cut")
    h.feedback_files = [p for p in h.feedback_files if os.path.exists(p)]


def _compact(h: History, monkeypatch) -> None:
    """The small files merged, of the dates before today or tomorrow (UTC), now and then
    dying at a merge's `k`-th fsync (before its rename, or after it with its inputs left)."""
    before = when(h.clock).date() + dt.timedelta(days=h.rng.choice([0, 1]))
    target = h.rng.choice([4_000, 20_000, 1 << 20])
    if h.rng.random() < 0.3:
        k = h.rng.choice([1, 2, 3, 4])
        calls = [0]
        real = output.fsync

        def fsync(path):
            calls[0] += 1
            if calls[0] == k:
                raise Crash(f"compaction, at fsync {k}")
            return real(path)

        monkeypatch.setattr(output, "fsync", fsync)
        try:
            compaction.compact(str(h.data), target_bytes=target, before=before)
            h.log.append(f"compact before {before}, target {target} (finished before fsync {k})")
        except Crash as e:
            h.log.append(f"compact before {before}, target {target}: crashed ({e})")
        finally:
            monkeypatch.undo()
    else:
        r = compaction.compact(str(h.data), target_bytes=target, before=before)
        h.log.append(f"compact before {before}, target {target}: {r.merged} -> {r.written}")
    h.feedback_files = sorted(h._feedback_paths())  # merged files in place of their inputs


def upkeep(monkeypatch):
    """Prunes (of 1 or 2 days) and compactions, now and then dying part way: after an
    event now and then, and before a build half the time, as the nightly job runs them."""
    def act(h: History, before_build: bool) -> None:
        p = 0.5 if before_build else 0.3
        if h.rng.random() < p:
            _prune(h, monkeypatch)
        if h.rng.random() < p:
            _compact(h, monkeypatch)
    return act


HISTORIES = int(os.environ.get("NIGHTSHIFT_HISTORIES", "200")) // 2


@pytest.mark.parametrize("block", range(2))
def test_the_lake_prunes_and_compactions_leave_builds_the_same_rows_incrementally_and_in_full(tmp_path, monkeypatch,
                                                                                             block):
    for seed in range(1000 + block, 1000 + HISTORIES, 2):
        play(seed, tmp_path / f"h{seed}", monkeypatch, rounds=4, upkeep=upkeep(monkeypatch))
        shutil.rmtree(tmp_path / f"h{seed}")


# --- where it runs: the nightly job, and `nightshift prune` ---------------------------------------------


def _two_days(data: Path) -> None:
    write_spans(str(data), [traj("old", MIDNIGHT + HOUR).trace("early")], batch="a", received_ns=MIDNIGHT + 2 * HOUR)
    write_spans(str(data), [traj("new", MIDNIGHT + DAY + HOUR).trace("early")], batch="b",
                received_ns=MIDNIGHT + DAY + 2 * HOUR)


def test_the_nightly_job_prunes_before_it_builds_and_says_so(tmp_path):
    from nightshift.nightly.run import NightlyConfig, run
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig
    from nightshift.transform.retention import RetentionConfig

    data = tmp_path / "data"
    _two_days(data)
    tcfg = TransformConfig(data=str(data), settle=0)
    trcfg = TrainConfig()
    trcfg.output = str(tmp_path / "ck")
    n = NightlyConfig(experiments="off", publish=False, train_window_days=3)
    B.build(cfg_for(data), now_ns=MIDNIGHT + DAY + 3 * HOUR)  # yesterday's build, both dates
    code, state = run(tcfg, trcfg, n, now=when(MIDNIGHT + 2 * DAY + HOUR), retention_cfg=RetentionConfig(days=1))
    assert code == 0, state.get("error")
    said = "\n".join(state["build"])
    assert "dates before 2025-11-23 go" in said and "spans: removed 1 date(s), 2025-11-22 .. 2025-11-22" in said
    assert "train_window_days 3 reaches past the 1 day(s) kept" in said
    assert not Path(data, "spans", "date=2025-11-22").exists()
    assert sorted(transitions(data)["date"].cast(str).unique()) == ["2025-11-23"]
    assert "retention: 1 day(s) kept" in Path(state["report"]).read_text()
    # off (the default): nothing goes
    _two_days(tmp_path / "data2")
    tcfg.data = str(tmp_path / "data2")
    trcfg.output = str(tmp_path / "ck2")
    code, state = run(tcfg, trcfg, n, now=when(MIDNIGHT + 9 * DAY))
    assert code == 0 and not any("retention" in line for line in state["build"])
    assert Path(tmp_path / "data2", "spans", "date=2025-11-22").exists()


def _cli(*args: str, env: dict | None = None):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "nightshift.cli", "prune", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_nightshift_prune_from_the_command_line(tmp_path):
    data = tmp_path / "data"
    _two_days(data)
    # the data's dates are in 2025: 1 day kept besides today removes both of them
    p = _cli("--data", str(data))
    assert p.returncode == 2 and "retention.days is 0, which keeps everything: give --days N" in p.stderr
    p = _cli("--data", str(data), "--dry-run", env={"NIGHTSHIFT_RETENTION_DAYS": "1"})
    assert p.returncode == 0, p.stderr
    assert "spans: would remove 2 date(s), 2025-11-22 .. 2025-11-23" in p.stdout and len(spans(data)) == 8
    cfg = tmp_path / "n.yaml"
    cfg.write_text(f"data: {data}\nretention:\n  days: 1\n")
    p = _cli("--config", str(cfg))
    assert p.returncode == 0 and "spans: removed 2 date(s)" in p.stdout, p.stderr
    assert not list(Path(data, "spans").rglob("*.parquet"))
    p = _cli("--data", str(data), "--days", "-1")
    assert p.returncode == 2 and "retention.days" in p.stderr
    (data / "feedback" / "date=soon").mkdir(parents=True)
    p = _cli("--data", str(data), "--days", "3")
    assert p.returncode == 2 and "feedback/date=soon: a partition whose name is not a date" in p.stderr
