"""The lake's small files merged (transform/compaction.py): the same rows in the same
order in fewer files, a merge stopped anywhere finished by the next run with every
row readable meanwhile, and the same transitions built from the lake it leaves."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nightshift.transform import build as B
from nightshift.transform import compaction
from nightshift.transform.compaction import compact
from test_incremental import DAY, HOUR, MIDNIGHT, S, Crash, Traj, cfg_for, full_build, same, transitions
from traces import Trace, write_spans

#: the day after the data's: compaction looks at the data's date
AFTER = (dt.datetime.fromtimestamp(MIDNIGHT / 1e9, dt.timezone.utc) + dt.timedelta(days=1)).date()


def traj(seed: str, start: int, **kw) -> Traj:
    return Traj(seed, start, kw.pop("task", "task"), kw.pop("calls", 2), kw.pop("reward", 1.0), None, True,
                kw.pop("late", []))


def quiet_sidecar(data: Path, n: int, day: int = 0) -> None:
    """`n` files of one trajectory each into one date, as a quiet collector seals them."""
    for i in range(n):
        write_spans(str(data), [traj(f"q{day}-{i}", MIDNIGHT + day * DAY + i * 60 * S).trace("early")],
                    batch=f"seg{day:02d}-{i:05d}", received_ns=MIDNIGHT + day * DAY + i * 60 * S + S)


def rows(data: Path, dataset: str = "spans") -> pl.DataFrame:
    """Every row in listing order (the build's), files one after another."""
    files = sorted(Path(data, dataset).glob("date=*/*.parquet"))
    return pl.concat([pl.read_parquet(f) for f in files]) if files else pl.DataFrame()


def test_small_files_of_a_past_date_become_one_with_the_same_rows_in_the_same_order(tmp_path):
    data = tmp_path / "data"
    quiet_sidecar(data, 30)
    quiet_sidecar(data, 3, day=1)  # today's: a collector may still write there
    part = Path(data, "spans", "date=2025-11-22")
    before, today = rows(data), sorted(Path(data, "spans", "date=2025-11-23").iterdir())
    schema = pq.read_schema(next(part.iterdir()))
    B.build(cfg_for(data, incremental=True), now_ns=MIDNIGHT + 2 * DAY)
    r = compact(str(data), before=AFTER)
    assert (r.merged["spans"], r.written["spans"], r.dates["spans"]) == (30, 1, ["2025-11-22"])
    files = sorted(part.iterdir())
    assert len(files) == 1 and files[0].name.startswith("part-seg00-00000.c")  # sorts where its first input did
    assert rows(data).equals(before)  # every row, every column, in the same order
    assert pq.read_schema(files[0]).equals(schema, check_metadata=True)
    assert pq.ParquetFile(files[0]).metadata.num_row_groups == 1  # thirty tiny row groups became one
    assert sorted(Path(data, "spans", "date=2025-11-23").iterdir()) == today
    assert "spans: merged 30 file(s) into 1, in 1 date(s)" in "\n".join(r.lines())
    # the lake it leaves builds the same rows, incrementally (the date redone) and in full
    s = B.build(cfg_for(data, incremental=True), now_ns=MIDNIGHT + 2 * DAY)
    assert "2025-11-22" in s.incremental
    assert same(transitions(data), full_build(data, tmp_path / "full", MIDNIGHT + 2 * DAY)) == ""
    # merged once: nothing left to merge
    again = compact(str(data), before=AFTER)
    assert not any(again.dates.values()) and again.lines()[-1] == "  nothing to merge"


def test_big_files_stay_and_runs_are_cut_at_the_target(tmp_path):
    data = tmp_path / "data"
    quiet_sidecar(data, 12)
    sizes = sorted(p.stat().st_size for p in Path(data, "spans", "date=2025-11-22").iterdir())
    target = 4 * sizes[-1] + 1  # four files a merge; none is half the target
    r = compact(str(data), target_bytes=target, before=AFTER)
    assert (r.merged["spans"], r.written["spans"]) == (12, 3)
    merged = sorted(Path(data, "spans", "date=2025-11-22").iterdir())
    assert len(merged) == 3 and all(p.stat().st_size < target for p in merged)
    # a file half the target or more is left as it is
    r = compact(str(data), target_bytes=2 * min(p.stat().st_size for p in merged), before=AFTER)
    assert r.merged["spans"] == 0


def test_files_of_two_schema_versions_are_not_merged_together(tmp_path):
    data = tmp_path / "data"
    quiet_sidecar(data, 4)
    part = Path(data, "spans", "date=2025-11-22")
    odd = sorted(part.iterdir())[1]  # the second file as another version wrote it
    t = pq.read_table(odd)
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"nightshift.note": b"other"}), odd)
    r = compact(str(data), before=AFTER)
    # runs in name order: [0], [1], [2, 3] -> only the last is a merge
    assert (r.merged["spans"], r.written["spans"]) == (2, 1)
    assert len(list(part.iterdir())) == 3


def test_a_torn_file_is_left_where_it_is_and_the_rest_merged(tmp_path, caplog):
    data = tmp_path / "data"
    quiet_sidecar(data, 5)
    part = Path(data, "spans", "date=2025-11-22")
    torn = sorted(part.iterdir())[2]
    torn.write_bytes(torn.read_bytes()[:200])  # a copy cut short
    before = pl.concat([pl.read_parquet(p) for p in sorted(part.iterdir()) if p != torn])
    r = compact(str(data), before=AFTER)
    assert (r.merged["spans"], r.written["spans"]) == (4, 1)
    assert torn.exists() and "not a readable Parquet file" in caplog.text
    merged = [p for p in part.iterdir() if p != torn]
    assert len(merged) == 1 and pl.read_parquet(merged[0]).equals(before)


@pytest.mark.parametrize("stop", ["after the journal", "after the output", "after one input went"])
def test_a_merge_stopped_anywhere_reads_every_row_and_the_next_run_finishes_it(tmp_path, monkeypatch, stop):
    data = tmp_path / "data"
    quiet_sidecar(data, 6)
    before = rows(data)
    now = MIDNIGHT + 2 * DAY
    expected = full_build(data, tmp_path / "expected", now)
    part = Path(data, "spans", "date=2025-11-22")
    real_rm = compaction.fsspec.implementations.local.LocalFileSystem.rm

    if stop == "after the journal":
        def killed(*a):  # the merged file written, not yet renamed into place
            raise Crash(stop)
        monkeypatch.setattr(compaction.output, "fsync", killed)
        monkeypatch.setattr(compaction.os, "remove", lambda *a: None)  # killed: no cleanup of its own
    else:
        def rm(self, path, *a, **kw):
            if isinstance(path, list) and stop == "after one input went":
                real_rm(self, path[:1], *a, **kw)
            if isinstance(path, list):
                raise Crash(stop)
            return real_rm(self, path, *a, **kw)
        monkeypatch.setattr(compaction.fsspec.implementations.local.LocalFileSystem, "rm", rm)
    with pytest.raises(Crash):
        compact(str(data), before=AFTER)
    monkeypatch.undo()
    assert any(p.name.startswith(compaction.JOURNAL) for p in part.iterdir())
    # meanwhile: every row readable (some twice), and a build of this lake makes the rows
    after_crash = rows(data)
    assert after_crash.unique(["trace_id", "span_id"]).height == before.height
    assert same(full_build(data, tmp_path / "during", now), expected) == ""
    # the next run finishes it: one file per run merged, no journal, no leftover, the same rows
    r = compact(str(data), before=AFTER)
    assert r.finished == 1
    left = sorted(p.name for p in part.iterdir())
    assert len(left) == 1 and left[0].endswith(".parquet"), left
    assert rows(data).sort("span_id").equals(before.sort("span_id"))
    assert same(full_build(data, tmp_path / "after", now), expected) == ""


def test_on_an_object_store(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://compaction-{tmp_path.name}"
    base = url.removeprefix("memory://")
    for i in range(5):
        write_spans(url, [traj(f"m{i}", MIDNIGHT + i * 60 * S).trace("early")], batch=f"s{i:03d}",
                    received_ns=MIDNIGHT + i * 60 * S + S)
    before = [fs.cat(p) for p in sorted(fs.glob(f"{base}/spans/date=2025-11-22/*.parquet"))]
    want = pa.concat_tables([pq.read_table(pa.BufferReader(b)) for b in before])
    r = compact(url, before=AFTER)
    assert (r.merged["spans"], r.written["spans"]) == (5, 1)
    files = fs.glob(f"{base}/spans/date=2025-11-22/*")
    assert len(files) == 1 and files[0].endswith(".parquet")
    assert pq.read_table(pa.BufferReader(fs.cat(files[0]))).equals(want)


def test_the_nightly_job_compacts_before_it_builds_unless_told_not_to(tmp_path):
    from nightshift.nightly.run import NightlyConfig, run
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.compaction import CompactionConfig
    from nightshift.transform.config import TransformConfig

    for off in (False, True):
        data = tmp_path / f"data{off}"
        quiet_sidecar(data, 8)
        tcfg = TransformConfig(data=str(data), settle=0)
        trcfg = TrainConfig()
        trcfg.output = str(tmp_path / f"ck{off}")
        code, state = run(tcfg, trcfg, NightlyConfig(experiments="off", publish=False),
                          now=dt.datetime.fromtimestamp((MIDNIGHT + DAY + HOUR) / 1e9, dt.timezone.utc),
                          compaction_cfg=CompactionConfig(enabled=not off))
        assert code == 0, state.get("error")
        said = "\n".join(state["build"])
        files = list(Path(data, "spans", "date=2025-11-22").iterdir())
        if off:
            assert "compaction" not in said and len(files) == 8
        else:
            assert "spans: merged 8 file(s) into 1" in said and len(files) == 1
            assert "transitions: 16 rows" in said  # 8 trajectories of 2 calls


def test_nightshift_compact_from_the_command_line(tmp_path):
    data = tmp_path / "data"
    quiet_sidecar(data, 4)
    env = {**os.environ}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "nightshift.cli", "compact", "--data", str(data), *args],
                              capture_output=True, text=True, timeout=120, env=env)

    p = cli("--dry-run")
    assert p.returncode == 0 and "spans: would merge 4 file(s) into 1" in p.stdout, p.stderr
    assert len(list(Path(data, "spans", "date=2025-11-22").iterdir())) == 4
    p = cli("--target-bytes", "not-a-size")
    assert p.returncode == 2 and "compaction.target_bytes" in p.stderr
    p = cli()
    assert p.returncode == 0 and "spans: merged 4 file(s) into 1" in p.stdout
    assert len(list(Path(data, "spans", "date=2025-11-22").iterdir())) == 1
