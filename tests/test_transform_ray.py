"""Item 3 of issue 28: `nightshift build` runs its buckets as tasks on Ray, and makes
the rows the single-process build makes, row for row and column for column, full and
incremental, on a local cluster of 2 workers; a worker killed half way through a
bucket is retried by Ray and the output is still the same, nothing half-written.

One local cluster for the module (2 CPUs, no dashboard): Ray's start-up is most of
this file's time."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import polars as pl
import pytest
import ray

from nightshift.transform import build as B
from nightshift.transform.distributed import LEAN
from test_incremental import SETTLE, History, cfg_for
from test_transform_ray_cut import lake
from traces import T0, Trace, agent_run, genai_call, write_spans

S = 10**9
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    marker = tmp_path_factory.mktemp("kill") / "killed"
    env = {"PYTHONPATH": os.pathsep.join([TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           "NIGHTSHIFT_TEST_KILL_ONCE": str(marker), "RAY_AUTH_MODE": "disabled",
           **{k: v for k, v in LEAN.items() if k not in os.environ}}  # as a build's own cluster runs
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the workers inherit them: the tests' modules, the kill switch
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, logging_level="WARNING")
    try:
        yield marker
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def partitions(data) -> dict[str, pl.DataFrame]:
    """Each date partition's rows in the file's own order."""
    base = Path(data) / "transitions"
    if not base.is_dir():
        return {}
    return {p.name: pl.read_parquet(p / "part-0.parquet") for p in sorted(base.glob("date=*"))}


def mirror(data: Path, to: Path) -> Path:
    """Another data folder reading the same spans, logs and feedback (symlinks)."""
    to.mkdir(parents=True)
    for name in ("spans", "logs", "feedback"):
        (data / name).mkdir(parents=True, exist_ok=True)
        (to / name).symlink_to(data / name, target_is_directory=True)
    return to


def lines(summary, data) -> list[str]:
    """The summary, less its time and the workers' memory, the data folder's name as DATA."""
    skip = ("transitions:", "ray:", "ray idle", "time:")
    return [x.replace(str(data), "DATA") for x in summary.lines() if not x.startswith(skip)] + [
        f"{summary.transitions} {summary.trajectories} {summary.spans} {summary.buckets}"]


def same(local, on_ray) -> None:
    a, b = partitions(local), partitions(on_ray)
    assert list(a) == list(b)
    for day in a:
        assert a[day].columns == b[day].columns
        assert a[day].equals(b[day]), day  # row for row, in the same order
    leftovers = [p.name for p in (Path(on_ray) / "transitions").iterdir() if not p.name.startswith("date=")]
    assert not leftovers  # no scratch, no half-written partition


def cfg(data, engine: str, **kw):
    c = cfg_for(data, **kw)
    c.build.engine, c.build.buckets = engine, 3  # three buckets each: rows in a partition follow the buckets
    return c


@pytest.mark.parametrize("seed,chains", [(7, False), (6, True)])
def test_ray_builds_the_rows_one_process_builds_full_and_incremental(tmp_path, cluster, seed, chains):
    """A generated history (test_incremental's): trajectories arriving, late spans,
    feedback, the clock moving; after each step both folders build incrementally
    (the first build is a full one: no state yet), one in this process, one on Ray.
    With `chains`, some calls continue other traces' (`transform.chains`): the split's
    tasks on Ray bucket each group as one, as this process does."""
    h = History(seed, tmp_path / "h", chains=chains)
    for _ in range(3):
        h.arrive()
    on_ray = mirror(h.data, tmp_path / "ray")
    for step in range(3):
        for _ in range(h.rng.randint(2, 4) if step else 0):
            getattr(h, h.rng.choice(["arrive", "tick", "feedback"] + (["late"] if h.pending else [])))()
        local = B.build(cfg(h.data, "local", incremental=True), now_ns=h.clock)
        remote = B.build(cfg(on_ray, "ray", incremental=True), now_ns=h.clock)
        assert remote.workers and not local.workers  # the buckets ran in Ray's worker processes
        # each worker's tasks counted in CPU-seconds, for the benchmark's contention-robust Amdahl figure
        assert set(remote.worker_cpu) == set(remote.workers) and all(c > 0 for c in remote.worker_cpu.values())
        assert lines(local, h.data) == lines(remote, on_ray)
        same(h.data, on_ray)
        h.clock += int(SETTLE) * S
    assert local.transitions and "rebuilding" in local.incremental  # the last one was incremental, and built rows
    if chains:
        flags = {f for fs in pl.read_parquet(f"{on_ray}/transitions", hive_partitioning=True)["flags"].to_list() for f in fs}
        assert {"history_from_previous_response", "history_from_delta"} <= flags


def test_a_worker_killed_mid_bucket_is_retried_and_nothing_half_written(tmp_path, cluster):
    """The reward function kills the worker building the first trajectory it sees, once:
    Ray runs the bucket again on another worker, the driver commits after every
    bucket is done, and the rows are those of a build in one process."""
    data = tmp_path / "data"
    traces = [agent_run(f"kill-{i}", i, calls=2, task=f"task {i % 5}", reward=float(i % 2)) for i in range(24)]
    write_spans(str(data), traces)
    on_ray = mirror(data, tmp_path / "ray")
    now = T0 + 3600 * S
    c = cfg(on_ray, "ray")
    c.reward.functions = ["ray_kill:reward"]
    remote = B.build(c, now_ns=now)
    assert cluster.exists(), "no worker was killed"
    killed = int(cluster.read_text())
    # The bucket was finished by another worker: the killed one is gone. (Its id may
    # still be in remote.workers, which counts the split's tasks too: the same worker
    # process may have split files before it took the bucket.)
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    c = cfg(data, "local")
    c.reward.functions = ["ray_kill:reward"]  # the marker is there: it kills nobody now
    local = B.build(c, now_ns=now)
    assert local.transitions == 48 and lines(local, data) == lines(remote, on_ray)
    same(data, on_ray)


def test_a_span_file_it_cannot_read_is_one_sentence_on_ray_as_in_one_process(tmp_path, cluster):
    """Issue 28 item 4: a task's `LayoutError` comes back as the local engine raises it,
    the sentence `nightshift build` prints (exit 2), not the worker's traceback."""
    import pyarrow.parquet as pq

    from nightshift.schemas.layout import LayoutError

    for seed in ("a", "b"):
        t = Trace(seed)
        t.span("chat m1", genai_call("task", "answer"), start=1, end=2)
        write_spans(tmp_path, [t], batch=seed)
    (spoiled,) = (tmp_path / "spans").rglob("part-b.parquet")
    table = pq.read_table(spoiled)
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"nightshift.schema_version": b"99"}),
                   spoiled)
    with pytest.raises(LayoutError) as e:
        B.build(cfg(tmp_path, "ray", settle=0))
    said = str(e.value)
    assert said.startswith(f"{spoiled} is spans schema version 99") and "\n" not in said and "ray::" not in said


def test_span_files_are_split_in_runs_of_equal_bytes_on_ray_and_the_rows_are_the_same(tmp_path, cluster):
    """The split tasks get contiguous runs of about the same bytes, cut between row
    groups wherever a run ends (`_cut`, `distributed.balance`): runs of equal file
    count gave one of the benchmark's two workers 427 MB and the other 374 (three
    files of 80 MB and one of 27 per date). Whatever the cuts, the buckets get their
    rows in the same order: the rows are those of a build in one process."""
    import fsspec
    import pyarrow.parquet as pq

    from nightshift.transform import distributed

    assert distributed.balance([80, 80, 80, 27] * 3, 4) == [(0, 3), (3, 6), (6, 9), (9, 12)]  # whole files: no better
    w = [8] * 10 + [3] * 10 + [8] * 10 + [3] * 2
    runs = distributed.balance(w, 4)
    assert [a for a, _ in runs[1:]] == [b for _, b in runs[:-1]] and runs[0][0] == 0 and runs[-1][1] == len(w)
    assert max(sum(w[a:b]) for a, b in runs) - sum(w) / 4 <= max(w)  # no run longer than its share and a unit
    paths = lake(tmp_path)  # five span files, 12 spans a row group
    data = tmp_path / "data"
    fs = fsspec.filesystem("file")
    sources = [B._Source(str(p), "d") for p in paths]
    rows = [[pq.ParquetFile(p).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(p).metadata.num_row_groups)]
            for p in paths]
    assert [sum(r) for r in rows] == [40, 40, 40, 12, 28]  # large files and small ones, as the benchmark's dates end
    runs = B._cut(fs, sources, 4)
    taken = [sum(sum(rows[paths.index(Path(s.path))][slice(*(s.groups or (None, None)))]) for s in run) for run in runs]
    # by file count the runs were 80, 40, 12 and 28 spans; by bytes each is within a row group of 40
    assert sum(taken) == 160 and max(taken) <= 40 + 12, taken
    assert (runs[0][0].path, runs[0][0].groups) == (str(paths[0]), None)  # a file a run takes whole is read whole
    one = pq.ParquetFile(paths[0]).metadata.num_row_groups
    cut = B._cut(fs, [B._Source(str(paths[0]), "d")], 4)
    assert [[s.groups for s in run] for run in cut] == [[(g, g + 1)] for g in range(one)]  # one file: its row groups
    on_ray = mirror(data, tmp_path / "ray")
    now = T0 + 3600 * S
    remote = B.build(cfg(on_ray, "ray"), now_ns=now)
    local = B.build(cfg(data, "local"), now_ns=now)
    assert local.transitions == 80 and lines(local, data) == lines(remote, on_ray)
    same(data, on_ray)


def test_a_round_of_three_dates_on_two_workers_runs_at_once_sharing_the_cores(tmp_path, cluster):
    """A date's partition is one file, so three dates on two workers were two rounds,
    the second on one core. `spread` runs them together, each with 2/3 of a CPU (in
    Ray's ten-thousandths, rounded down so that three fit in two)."""
    import ray_together

    from nightshift.transform import distributed
    from nightshift.transform.config import BuildConfig

    assert distributed.share(2, 3) == 0.6666 and 3 * 6666 <= 2 * 10_000
    assert distributed.share(2, 2) == distributed.share(2, 4) == distributed.share(2, 1) == 1.0  # whole rounds
    with distributed.Engine(BuildConfig(engine="ray")) as engine:  # the module's cluster: 2 CPUs
        assert engine.cpus == 2
        met = engine.run(ray_together.meet, [0, 1, 2], (str(tmp_path), 3, 60.0), spread=True)
    assert met == [True, True, True]


def test_the_heaviest_jobs_are_handed_out_first_and_results_come_back_in_the_jobs_order(tmp_path, cluster):
    """`weights`: the two workers take the two heaviest jobs first, then the lighter
    ones, so a round ends on light jobs (and a spread round's late worker gets the
    lightest); the results are in the jobs' order all the same."""
    import ray_together

    from nightshift.transform import distributed
    from nightshift.transform.config import BuildConfig

    assert distributed.order([1, 3, 2, 4, 2]) == [3, 1, 2, 4, 0]  # ties in the jobs' order
    log = tmp_path / "log"
    with distributed.Engine(BuildConfig(engine="ray")) as engine:  # the module's cluster: 2 CPUs, a job each
        got = engine.run(ray_together.arrive, [0, 1, 2, 3], (str(log), 0.3), weights=[1, 3, 2, 4])
    assert got == [0, 1, 2, 3]
    taken = [int(x) for x in log.read_text().split()]
    assert set(taken[:2]) == {1, 3} and set(taken[2:]) == {0, 2}, taken  # in the jobs' order: 0 and 1 first


def test_a_spread_rounds_extra_process_starts_in_the_round_before_and_stays(tmp_path, cluster):
    """`prestart` before the buckets: three dates on two CPUs take three processes,
    and Ray started the third only with the round, its imports taken from the other
    two; prestarted between the rounds (ray6), the warm two waited for it. Now it
    starts as the round before's last tasks run (a task of no CPU: a process of its
    own), imports the next round's module (`netrc` here: nothing in a worker imports
    it, `colorsys` Ray does), and stays while the driver pools the advantages (LEAN,
    as on a build's own cluster: Ray stopped an idle process beyond one per CPU after
    a second, and the round had two processes, or a new one); the round runs on the
    three, none started anew."""
    import ray_together

    from nightshift.transform import distributed
    from nightshift.transform.config import BuildConfig

    with distributed.Engine(BuildConfig(engine="ray")) as engine:  # the module's cluster: 2 CPUs
        engine.prestart("netrc", 3)
        assert engine._warming is None  # armed, not started: the round before has its workers to itself
        before = engine.run(ray_together.where, [0.2, 0.2, 2.0, 2.0], None)  # the last two run 2 s together
        assert engine._warming is not None  # started in that round's tail
        refs = engine._warming
        time.sleep(1.5)  # the driver pools the advantages: Ray stopped a process beyond one per CPU idle a second
        warm = engine.run(ray_together.has, [0, 1, 2], ("netrc", 0.5), spread=True, weights=[3, 2, 1])
        (started,) = ray.get(refs)
        assert engine._warming is None
        engine.prestart("netrc", 2)  # two jobs on two CPUs: the warm workers, nothing to start
        assert engine._armed is None
    assert started not in before  # a process of its own, not a worker of the round before
    assert {pid for _, pid in warm} == set(before) | {started}  # all kept idle, none started anew for the round
    assert all(there == (pid == started) for there, pid in warm)  # the module imported in it, before its job


def test_scratch_a_task_is_done_with_is_removed_while_the_others_run(tmp_path, cluster, monkeypatch):
    """A bucket's split pieces go as its task's result comes in, a date's spilled rows
    as its partition is staged (`Engine.run(each=...)`): left to the end, the 1M
    benchmark's took the driver alone 3 s to remove after the last task, and held
    the window's size again on disk until then. What a task is done with is never
    read again (a task done is not retried): the rows are those of one process."""
    import glob

    from nightshift.transform import distributed
    from nightshift.transform.config import BuildConfig

    with distributed.Engine(BuildConfig()) as local:
        came = []
        assert local.run(lambda job, _: job * 2, [3, 4, 5], each=came.append) == [6, 8, 10] and came == [0, 1, 2]
    data = tmp_path / "data"
    traces = [agent_run(f"rm-{i}", i, calls=2, task=f"task {i % 4}", reward=float(i % 3 == 0)) for i in range(24)]
    write_spans(str(data), traces[:12], batch="a")
    write_spans(str(data), traces[12:], batch="b")
    on_ray = mirror(data, tmp_path / "ray")
    seen: dict[str, list] = {"pieces": [], "rows": []}
    advantages, commit = B.spill.advantages, B.output.commit

    def pooled(slim, folder, *a, **kw):  # in the driver, after the buckets' round
        seen["pieces"].append(glob.glob(os.path.join(os.path.dirname(folder), "bucket-*.arrow")))
        return advantages(slim, folder, *a, **kw)

    def committed(root, date, staged, rows):  # in the driver, after the dates' round
        seen["rows"].append(glob.glob(os.path.join(os.path.dirname(staged), "rows-*.arrow")))
        return commit(root, date, staged, rows)

    monkeypatch.setattr(B.spill, "advantages", pooled)
    monkeypatch.setattr(B.output, "commit", committed)
    now = T0 + 3600 * S
    remote = B.build(cfg(on_ray, "ray"), now_ns=now)
    assert remote.buckets == 3 and seen["pieces"] == [[]] and seen["rows"] and all(r == [] for r in seen["rows"])
    monkeypatch.undo()
    local = B.build(cfg(data, "local"), now_ns=now)
    assert local.transitions == remote.transitions > 0 and lines(local, data) == lines(remote, on_ray)
    same(data, on_ray)
