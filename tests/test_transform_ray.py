"""Item 3 of issue 28: `nightshift build` runs its buckets as tasks on Ray, and makes
the rows the single-process build makes, row for row and column for column, full and
incremental, on a local cluster of 2 workers; a worker killed half way through a
bucket is retried by Ray and the output is still the same, nothing half-written.

One local cluster for the module (2 CPUs, no dashboard): Ray's start-up is most of
this file's time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import polars as pl
import pytest
import ray

from nightshift.transform import build as B
from test_incremental import SETTLE, History, cfg_for
from traces import T0, Trace, agent_run, genai_call, write_spans

S = 10**9
TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    marker = tmp_path_factory.mktemp("kill") / "killed"
    env = {"PYTHONPATH": os.pathsep.join([TESTS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
           "NIGHTSHIFT_TEST_KILL_ONCE": str(marker), "RAY_AUTH_MODE": "disabled"}
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
    skip = ("transitions:", "ray:", "time:")
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


def test_ray_builds_the_rows_one_process_builds_full_and_incremental(tmp_path, cluster):
    """A generated history (test_incremental's): trajectories arriving, late spans,
    feedback, the clock moving; after each step both folders build incrementally
    (the first build is a full one: no state yet), one in this process, one on Ray."""
    h = History(7, tmp_path / "h")
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


def test_a_few_large_span_files_are_split_by_row_groups_on_ray_and_the_rows_are_the_same(tmp_path, cluster):
    """Fewer span files than split tasks (the benchmark's window is three files, one
    per date, for two workers): each file is cut into runs of its row groups, so the
    workers share the split, and the buckets get their rows in the same order."""
    import fsspec
    import pyarrow.parquet as pq

    data = tmp_path / "data"
    traces = [agent_run(f"cut-{i}", i, calls=2, task=f"task {i % 4}", reward=float(i % 3 == 0)) for i in range(30)]
    write_spans(str(data), traces)
    (path,) = (data / "spans").rglob("*.parquet")
    pq.write_table(pq.read_table(path), path, row_group_size=16)  # 120 spans: 8 row groups, metadata kept
    groups = pq.ParquetFile(path).metadata.num_row_groups
    assert groups == 8
    fs = fsspec.filesystem("file")
    cut = B._cut(fs, [B._Source(str(path), "d")], 4)
    assert [c.groups for c in cut] == [(0, 2), (2, 4), (4, 6), (6, 8)]  # every row group once, in order
    assert B._cut(fs, [B._Source(str(path), "d")] * 4, 4) == [B._Source(str(path), "d")] * 4  # enough files: whole
    on_ray = mirror(data, tmp_path / "ray")
    now = T0 + 3600 * S
    remote = B.build(cfg(on_ray, "ray"), now_ns=now)
    local = B.build(cfg(data, "local"), now_ns=now)
    assert local.transitions == 60 and lines(local, data) == lines(remote, on_ray)
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
