#!/usr/bin/env python
"""Transform benchmark for `nightshift build`.

    python benchmarks/transform.py [--spans 1000000] [--calls 5] [--prompt-chars 2000] [--mix]
                                   [--data DIR] [--jobs N] [--replicate N] [--peer agl [--peer-spans 16000]]
                                   [--engine ray [--workers 1,2] [--buckets N]]

What it does, in one run:

1. Writes a synthetic `spans` dataset straight to Parquet (benchmarks/synth_traces.py:
   vectorized, seeded, the collector's schema with its metadata and its Parquet
   settings, zstd level 1; files of --chunk-spans spans over --days date
   partitions, written by --jobs processes). One trajectory per trace, shaped like
   the Agent Lightning benchmark in shared/research/agent-lightning-bench: a root
   span, an agent span (agent.name=writer), K LLM calls (OpenLLMetry's pre-0.55
   `gen_ai.prompt.{i}.*` layout with Agent Lightning's prompt/response token ids;
   with --mix, a third each of that, OpenInference and OpenTelemetry GenAI JSON
   attributes) and a reward span (agentlightning.reward.0.value). With --data DIR
   the dataset is kept there and reused by later runs with the same parameters.
   Past --replicate spans (default 1M) the dataset is whole copies of a base set of
   that size, each copy's trace ids changed in Arrow: 10M spans cost one 1M
   generation and nine Parquet rewrites.
2. Runs `python -m nightshift.cli build --data DIR --settle 0` as a subprocess
   (the page cache holds the files just written) and measures wall time, the
   child's CPU time (os.wait4), peak RSS of its process tree (psutil, every
   50 ms) and of its largest process (wait4's ru_maxrss).
3. Counts the transitions written (Parquet footers) and checks them against the
   workload: one row per LLM call, each trajectory rewarded, token ids kept.
4. With `--engine ray --workers 1,2`: the same build as Ray tasks (`--build-engine
   ray`, --buckets buckets of traces) on a local cluster of each worker count, its
   wall time, the speed-up over one worker, what that projects for N workers
   (Amdahl's law fitted to the first and last counts: the driver's share stays),
   and the peak RSS of the driver and of each worker; then the same in CPU-seconds
   (each worker's tasks, the driver's serial share, the speed-up they give and its
   projection), which a machine shared with other work does not distort.
5. With `--peer agl`: Agent Lightning 0.3's `TracerTraceToTriplet` on the first
   --peer-spans spans' worth of the same trajectories, in its own virtualenv
   (benchmarks/peer_agl.py), and the ratio of the two.

Targets (the issue's) are printed beside the figures, marked met / NOT met; the
script never fails on them. Progress goes to stderr; the report to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import peer_agl  # noqa: E402
import synth_traces as st  # noqa: E402
from harness import Target, fmt, log  # noqa: E402

MIB = 1 << 20
GENERATOR_VERSION = 2  # bump when the dataset differs for the same parameters (2: copies XOR the trace-id prefix)

# Targets printed next to the figures (issue 16).
T_FLOOR = Target(">=", 0.5, "0.5x")  # the floor's CPU-seconds / the build's: read the spans + write the transitions, nothing else
T_AGL = Target(">=", 2.0, "2.0x")  # spans per CPU-second, nightshift / Agent Lightning's TracerTraceToTriplet
T_RSS_SPANS = 10_000_000  # the RSS target applies at this many spans
T_RSS = Target("<", 1 << 30, f"1 GiB at {T_RSS_SPANS // 1_000_000}M spans")  # peak RSS of the build, bytes
T_RAY = Target(">=", 1.7, "1.7x one worker")  # --engine ray: wall of 1 worker / wall of 2, on this 2-core machine
#: the Ray target is read at the benchmark's own size (the issue's "1M-span benchmark"): a smaller window measures
#: the fixed start-up (the CLI's imports, Ray's cluster and its workers' imports) more than the parallel work
T_RAY_SPANS = 1_000_000


@dataclass
class Floor:
    wall: float
    cpu: float
    read_s: float
    write_s: float


def measure_floor(root: Path) -> Floor:
    """What no build can beat: read the same spans Parquet whole with pyarrow, and
    write the same transitions with the build's writer settings (`output.WRITER`, row
    groups of 16,384). One file, one row group at a time, so the floor fits any input; the
    transitions are read back untimed."""
    import pyarrow.parquet as pq

    from nightshift.schemas import transitions
    from nightshift.transform import output

    wall = cpu = read_s = write_s = 0.0
    for f in sorted(glob.glob(str(root / "spans" / "date=*" / "*.parquet"))):
        t0, c0 = time.perf_counter(), time.process_time()
        pq.read_table(f)
        read_s += time.perf_counter() - t0
        wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
    sink = root / ".floor.parquet"
    for f in sorted(glob.glob(str(root / "transitions" / "date=*" / "*.parquet"))):
        src = pq.ParquetFile(f)
        with pq.ParquetWriter(sink, transitions.SCHEMA, **output.WRITER) as w:
            for g in range(src.num_row_groups):
                t = src.read_row_group(g).cast(transitions.SCHEMA)
                t0, c0 = time.perf_counter(), time.process_time()
                w.write_table(t, row_group_size=16384)
                write_s += time.perf_counter() - t0
                wall, cpu = wall + time.perf_counter() - t0, cpu + time.process_time() - c0
    sink.unlink(missing_ok=True)
    return Floor(wall, cpu, read_s, write_s)


# --------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------


@dataclass
class Generated:
    rows: int
    bytes: int
    files: int
    seconds: float
    reused: bool
    jobs: int
    copies: int = 1  # the base set and its copies (--replicate)


def base_params(p: st.Params, replicate: int) -> tuple[st.Params, int]:
    """The set generated span by span and how many copies of it make `p`: with
    --replicate N below the dataset's size, whole copies of an N-span base (N
    rounded to whole trajectories); otherwise `p` itself, once."""
    if not replicate or replicate >= p.total_spans:
        return p, 1
    base = st.Params.from_json({**p.to_json(), "spans": replicate})
    return base, max(1, p.total_spans // base.total_spans)


def replicated(p: st.Params, replicate: int) -> st.Params:
    """The parameters the dataset really has: a whole number of copies of the base."""
    base, copies = base_params(p, replicate)
    return p if copies == 1 and base is p else st.Params.from_json({**p.to_json(), "spans": base.total_spans * copies})


def copy_file(src: str, copy: int) -> tuple[int, int]:
    """Copy `copy` of one base file, beside it: every trace id's first four hex digits
    XORed with the copy's number (span ids are unique within their trace), columnar
    in Arrow, so a copy costs a Parquet read and write, not Python per span. The
    collector's Parquet settings and schema metadata, as the generator writes them.
    (Replacing the digits with the number made copy k of a base trace whose id began
    with k the base trace again: 18 of 1.25M traces at 10M spans.)"""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src)
    rows_per_group = pf.metadata.row_group(0).num_rows if pf.metadata.num_row_groups else 10_000
    t = pf.read()
    i = t.schema.get_field_index("trace_id")
    ids = t.column(i)
    head = pc.utf8_slice_codeunits(ids, 0, 4)
    seen = pc.unique(head).to_pylist()  # at most 65,536 prefixes
    moved = pa.array([f"{int(h, 16) ^ copy:04x}" for h in seen], pa.string())
    new = pc.binary_join_element_wise(pc.take(moved, pc.index_in(head, value_set=pa.array(seen, pa.string()))),
                                      pc.utf8_slice_codeunits(ids, 4), "")
    t = t.set_column(i, t.schema.field(i), new.cast(t.schema.field(i).type))
    dst = src[:-len(".parquet")] + f"-copy{copy:04d}.parquet"
    pq.write_table(t, dst + ".tmp", compression="zstd", compression_level=1, write_statistics=True,
                   row_group_size=rows_per_group)
    os.replace(dst + ".tmp", dst)
    return t.num_rows, os.path.getsize(dst)


def _copy_star(a: tuple[str, int]) -> tuple[int, int]:
    return copy_file(*a)


def replicate_dataset(root: Path, copies: int, jobs: int, progress) -> tuple[int, int, int]:
    """Copies 1..copies-1 of the base files already in root/spans, by `jobs` processes."""
    base = sorted(f for f in glob.glob(str(root / "spans" / "date=*" / "*.parquet")) if "-copy" not in f)
    work = [(f, k) for k in range(1, copies) for f in base]
    rows = size = 0
    if jobs <= 1:
        results = map(_copy_star, work)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ex = ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))
        results = ex.map(_copy_star, work)
    try:
        for done, (r, s) in enumerate(results, 1):
            rows, size = rows + r, size + s
            progress(done, len(work), rows)
    finally:
        if jobs > 1:
            ex.shutdown()
    return rows, size, len(work)


def generate(p: st.Params, root: Path, args) -> Generated:
    marker = root / "synth.json"
    desc = {"generator": GENERATOR_VERSION, "params": p.to_json(), "chunk_spans": args.chunk_spans,
            "row_group_spans": args.row_group_spans, "replicate": args.replicate}
    files = sorted(glob.glob(str(root / "spans" / "date=*" / "*.parquet")))
    if marker.exists() and files:
        try:
            same = json.loads(marker.read_text()) == desc
        except (OSError, json.JSONDecodeError):
            same = False
        if same:
            log(f"reusing the dataset in {root} (same parameters)")
            return Generated(p.total_spans, sum(os.path.getsize(f) for f in files), len(files), 0.0, True, 0)
    shutil.rmtree(root / "spans", ignore_errors=True)
    marker.unlink(missing_ok=True)
    full, (p, copies) = p, base_params(p, args.replicate)
    n_chunks = len(st.chunks(p, args.chunk_spans))
    jobs = max(1, min(args.jobs, n_chunks))
    log(f"writing {p.total_spans:,} spans ({p.trajectories:,} trajectories) to {root}/spans: "
        f"{n_chunks} files, {jobs} process(es)" + (f", then {copies - 1} copies of them" if copies > 1 else ""))
    step = max(1, n_chunks // 10)

    def progress(done: int, total: int, rows: int) -> None:
        if done % step == 0 or done == total:
            log(f"  {done}/{total} files, {rows:,} spans, {time.perf_counter() - t0:.0f} s")

    t0 = time.perf_counter()
    rows, size, nfiles = st.write_dataset(p, str(root), chunk_spans=args.chunk_spans,
                                          row_group_spans=args.row_group_spans, jobs=jobs, progress=progress)
    if copies > 1:
        step = max(1, (copies - 1) * nfiles // 10)
        more = replicate_dataset(root, copies, jobs, lambda d, n, r: progress(d, n, rows + r))
        rows, size, nfiles = rows + more[0], size + more[1], nfiles + more[2]
        assert rows == replicated(full, args.replicate).total_spans, (rows, full)
    took = time.perf_counter() - t0
    marker.write_text(json.dumps(desc, indent=1))
    return Generated(rows, size, nfiles, took, False, jobs, copies)


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------


@dataclass
class BuildRun:
    cmd: list
    rc: int | None = None
    timed_out: bool = False
    over_rss: bool = False  # killed by --rss-limit
    wall: float = 0.0
    cpu_user: float = 0.0
    cpu_sys: float = 0.0
    maxrss_one: float = 0.0  # bytes, largest single process (wait4)
    peak_rss_tree: float = 0.0  # bytes, process tree sum (psutil samples)
    peak_rss_root: float = 0.0  # bytes, the build's own process (psutil samples)
    samples: int = 0
    other_cores: float = 0.0  # CPU used by other processes during the build, in cores
    proc_cpu: dict = field(default_factory=dict)  # pid -> (command line, CPU-seconds last sampled): the tree's processes
    stdout: str = ""
    stderr: str = ""

    @property
    def cpu(self) -> float:
        return self.cpu_user + self.cpu_sys


class RssSampler(threading.Thread):
    """Peak RSS of a process and all its descendants, sampled every `interval` s."""

    def __init__(self, pid: int, interval: float = 0.05, limit: float = 0.0):
        super().__init__(daemon=True)
        self.pid, self.interval, self.limit = pid, interval, limit
        self.peak = 0.0
        self.peak_root = 0.0  # the process itself (the build's driver), without its children
        self.samples = 0
        self.over = False  # killed for going over `limit` bytes
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (its command line, its CPU-seconds when last seen)
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._halt.is_set():
            total = 0
            try:
                procs = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                break
            for q in procs:
                try:
                    rss = q.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                with contextlib.suppress(psutil.Error):  # Ray's own processes, each counted (--engine ray)
                    self.cpu[q.pid] = (self.cpu[q.pid][0] if q.pid in self.cpu else " ".join(q.cmdline()),
                                       sum(q.cpu_times()[:2]))
                if q is proc:
                    self.peak_root = max(self.peak_root, rss)
            self.peak = max(self.peak, total)
            self.samples += 1
            if self.limit and total > self.limit and not self.over:
                self.over = True  # protect the machine: the whole tree goes
                for q in reversed(procs):
                    try:
                        q.kill()
                    except psutil.Error:
                        pass
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)


def run_build(root: Path, extra: list[str], timeout: float, rss_limit: float) -> BuildRun:
    cmd = [sys.executable, "-m", "nightshift.cli", "build", "--data", str(root), "--settle", "0", *extra]
    run = BuildRun(cmd)
    out_path, err_path = root / "build.stdout", root / "build.stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        busy0, _ = harness.machine_busy()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=str(root))
        sampler = RssSampler(proc.pid, limit=rss_limit)
        sampler.start()

        def kill() -> None:
            run.timed_out = True
            try:
                proc.kill()
            except OSError:
                pass

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, ru = os.wait4(proc.pid, 0)
        except BaseException:
            kill()
            raise
        finally:
            timer.cancel()
        run.wall = time.perf_counter() - t0
        busy1, _ = harness.machine_busy()
        sampler.stop()
        proc.returncode = run.rc = os.waitstatus_to_exitcode(status)
    run.cpu_user, run.cpu_sys = ru.ru_utime, ru.ru_stime
    run.maxrss_one = ru.ru_maxrss * 1024  # KiB on Linux
    run.peak_rss_tree = max(sampler.peak, run.maxrss_one)
    run.peak_rss_root = sampler.peak_root
    run.samples = sampler.samples
    run.proc_cpu = sampler.cpu
    run.over_rss = sampler.over
    # the build's own CPU: what wait4 reaped, or what the sampler saw its processes use, whichever is more
    # (Ray's workers are the raylet's children, stopped by the node: wait4 never reaps them, and a quiet
    # machine read "other processes used 1.7 cores" when only the build's own Ray workers ran)
    own = max(run.cpu, sum(c for _, c in sampler.cpu.values()))
    run.other_cores = max(0.0, (busy1 - busy0) - own) / run.wall if run.wall else 0.0
    run.stdout = out_path.read_text(errors="replace")
    run.stderr = err_path.read_text(errors="replace")
    return run


@dataclass
class Output:
    rows: int = 0
    bytes: int = 0
    files: int = 0
    checks: list = field(default_factory=list)  # report lines
    ok: bool = True


def inspect_output(p: st.Params, root: Path, replicate: int = 0) -> Output:
    """Rows from the footers, then a few checks against the workload (not timed); a
    replicated dataset's conventions are its base's, copy after copy."""
    import numpy as np
    import polars as pl
    import pyarrow.parquet as pq

    out = Output()
    files = [f for f in sorted(glob.glob(str(root / "transitions" / "date=*" / "*.parquet")))]
    for f in files:
        out.rows += pq.ParquetFile(f).metadata.num_rows
        out.bytes += os.path.getsize(f)
    out.files = len(files)
    if not files:
        out.ok = False
        return out
    base, copies = base_params(p, replicate)
    conv = np.tile(np.asarray(st.convention_of(base, np.arange(base.trajectories, dtype=np.uint64))),
                   copies) if p.mix else None
    expected_by_conv = ({st.CONVENTIONS[k]: int(n) * p.calls for k, n in enumerate(np.bincount(conv, minlength=3))}
                        if p.mix else {st.CONVENTIONS[st.AGL]: p.llm_spans})
    try:
        df = pl.scan_parquet(files).select(
            pl.len().alias("rows"),
            pl.col("trajectory_id").n_unique().alias("trajectories"),
            pl.col("reward").is_not_null().sum().alias("rewarded"),
            (pl.col("prompt_token_ids").list.len() > 0).sum().alias("prompt_ids"),
            (pl.col("completion_token_ids").list.len() > 0).sum().alias("completion_ids"),
            pl.col("output_message").struct.field("content").is_not_null().sum().alias("outputs"),
        ).collect().row(0, named=True)
        by_conv = dict(pl.scan_parquet(files).group_by("convention").len().collect().iter_rows())
    except Exception as e:  # noqa: BLE001  (a schema change must not hide the timing)
        out.checks.append(f"could not read the transitions back: {type(e).__name__}: {e}")
        out.ok = False
        return out

    def check(label: str, got: int, want: int) -> None:
        good = got == want
        out.ok &= good
        out.checks.append(f"{label}: {got:,} (expected {want:,}){'' if good else '  MISMATCH'}")

    check("rows (one per LLM call)", df["rows"], p.llm_spans)
    check("trajectories", df["trajectories"], p.trajectories)
    check("rows with a reward", df["rewarded"], p.llm_spans)
    check("rows with an output message", df["outputs"], p.llm_spans)
    agl_rows = expected_by_conv.get(st.CONVENTIONS[st.AGL], 0)
    check("rows with prompt token ids", df["prompt_ids"], agl_rows)
    check("rows with completion token ids", df["completion_ids"], agl_rows)
    out.checks.append("rows by convention: " + ", ".join(f"{k} {v:,}" for k, v in sorted(by_conv.items(), key=str))
                      + "  (generated: " + ", ".join(f"{k} {v:,}" for k, v in expected_by_conv.items()) + " LLM calls)")
    return out


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def parse_args() -> tuple[argparse.Namespace, st.Params]:
    d = st.Params()
    ap = harness.parser(__doc__, seed=d.seed, temp_dir=True, keep=True,
                        peer={"agl": "Agent Lightning 0.3's TracerTraceToTriplet on the same trajectories (own venv, "
                                     "see benchmarks/peer_agl.py)"})
    ap.add_argument("--spans", type=int, default=d.spans, help=f"spans to generate, rounded down to whole trajectories "
                    f"(default {d.spans:,}; the RSS target is for 10,000,000)")
    st.add_shape_flags(ap)
    ap.add_argument("--days", type=int, default=d.days, help=f"date partitions (default {d.days})")
    ap.add_argument("--mix", action="store_true",
                    help="a third of the traces each in Agent Lightning's (OpenLLMetry <0.55), OpenInference's and "
                         "OpenTelemetry GenAI JSON layouts (default: all Agent Lightning's)")
    ap.add_argument("--chunk-spans", type=int, default=100_000, help="spans per Parquet file (default 100,000)")
    ap.add_argument("--row-group-spans", type=int, default=10_000, help="spans per row group (default 10,000)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="generator processes (default: CPU count)")
    ap.add_argument("--data", type=Path, default=None,
                    help="keep the dataset in DIR and reuse it when the parameters match (default: a temp dir, removed)")
    ap.add_argument("--replicate", type=int, default=1_000_000, metavar="N",
                    help="a dataset larger than N spans is whole copies of an N-span base, generated once; each copy's "
                         "trace ids differ (default 1,000,000: 10M spans in minutes, not half an hour; 0: generate all)")
    ap.add_argument("--generate-only", action="store_true", help="write the dataset, print the generator's figures, stop")
    ap.add_argument("--build-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `nightshift build` (repeatable), e.g. --build-arg=--credit=discounted")
    ap.add_argument("--timeout", type=float, default=3600.0, help="kill the build after this many seconds (default 3600)")
    ap.add_argument("--rss-limit", type=float, default=round(psutil.virtual_memory().total * 0.85 / MIB),
                    help="kill the build if its process tree's RSS goes over this many MiB, to keep the machine "
                         "usable (default: 85%% of RAM; 0: no limit)")
    ap.add_argument("--peer-spans", type=int, default=16_000, help="spans the peer adapts (default 16,000)")
    ap.add_argument("--engine", choices=("local", "ray"), default="local",
                    help="local: the build in one process (default); ray: its buckets as Ray tasks on a local cluster "
                         "of each --workers count, with the speed-up over one worker and its projection for N")
    ap.add_argument("--workers", default="1,2", help="--engine ray: worker counts to run, comma-separated (default 1,2)")
    ap.add_argument("--buckets", type=int, default=0,
                    help="--engine ray: buckets of traces (default: 4 per worker of the largest count)")
    args = ap.parse_args()
    try:
        args.worker_counts = sorted({int(w) for w in args.workers.split(",") if w.strip()})
    except ValueError:
        ap.error(f"--workers must be numbers separated by commas, got {args.workers!r}")
    if not args.worker_counts or min(args.worker_counts) < 1:
        ap.error("--workers needs at least one count, each at least 1")

    p = st.Params(spans=args.spans, **st.shape_of(args), days=args.days, mix=args.mix, seed=args.seed)
    try:
        p.check()
    except ValueError as e:
        ap.error(str(e))
    if args.replicate < 0:
        ap.error("--replicate must be 0 (generate every span) or a number of spans")
    p = replicated(p, args.replicate)  # whole copies of the base: the figures count what is on disk
    if args.chunk_spans < p.spans_per_trajectory or args.row_group_spans < 1:
        ap.error("--chunk-spans must hold at least one trajectory; --row-group-spans must be positive")
    return args, p


def header(args: argparse.Namespace, p: st.Params) -> list[str]:
    import polars as pl
    import pyarrow as pa

    layouts = "mixed: Agent Lightning (OpenLLMetry <0.55 + token ids) / OpenInference / OTel GenAI JSON" if p.mix \
        else "Agent Lightning (OpenLLMetry <0.55 gen_ai.prompt.{i}.* + prompt/response token ids)"
    return [
        *harness.header("nightshift transform benchmark (`nightshift build`)", args,
                        versions=(f"pyarrow {pa.__version__}", f"polars {pl.__version__}")),
        f"workload: {p.trajectories:,} trajectories x ({p.calls} LLM calls + root + agent + reward) = {p.total_spans:,} spans "
        f"over {p.days} date(s); {layouts}; user message {p.prompt_chars} chars, completion {p.response_chars} chars, "
        f"token ids: prompt {p.prompt_tokens} +{p.prompt_step}/call, response {p.response_tokens}; "
        f"{p.attempts} attempts per task; seed {p.seed}",
    ]


@contextlib.contextmanager
def dataset_dir(args: argparse.Namespace) -> Iterator[Path]:
    """--data DIR, kept and reused; otherwise a temp dir, removed unless --keep."""
    if args.data is None:
        with harness.temp_dir("nightshift-bench-transform-", args.dir, args.keep) as tmp:
            yield tmp
        return
    root = args.data.resolve()
    root.mkdir(parents=True, exist_ok=True)
    yield root


def generator_lines(gen: Generated, root: Path) -> list[str]:
    if gen.reused:
        return [f"generator: reused {gen.files} files in {root} ({gen.bytes / MIB:,.0f} MiB, "
                f"{gen.bytes / max(gen.rows, 1):,.0f} bytes/span on disk)"]
    return [f"generator: {gen.rows:,} spans in {gen.seconds:.1f} s = {fmt(gen.rows / gen.seconds)} spans/s "
            f"({gen.jobs} process(es), {gen.files} files"
            + (f": a base of {gen.rows // gen.copies:,} spans and {gen.copies - 1} copies, new trace ids"
               if gen.copies > 1 else "") + f", {gen.bytes / MIB:,.0f} MiB zstd, "
            f"{gen.bytes / max(gen.rows, 1):,.0f} bytes/span on disk)"]


def measure_build(root: Path, args: argparse.Namespace) -> BuildRun:
    shutil.rmtree(root / "transitions", ignore_errors=True)
    log("running: " + " ".join(["python", "-m", "nightshift.cli", "build", "--data", str(root), "--settle", "0",
                                *args.build_arg]))
    rss_limit = args.rss_limit * MIB if args.rss_limit else 0.0
    run = run_build(root, args.build_arg, args.timeout, rss_limit)
    log(f"build exited {run.rc} after {run.wall:.1f} s")
    return run


def build_title(args: argparse.Namespace) -> list[str]:
    return ["", f"build: {' '.join(['python', '-m', 'nightshift.cli', 'build', '--data', '<dir>', '--settle', '0', *args.build_arg])}"
                f"  (files in the page cache)"]


def failure_lines(run: BuildRun, args: argparse.Namespace) -> list[str]:
    why = " (killed after --timeout)" if run.timed_out else ""
    if run.over_rss:
        why = f" (killed by the benchmark: its process tree went over --rss-limit {args.rss_limit:,.0f} MiB)"
    tail = (run.stderr.strip() or run.stdout.strip()).splitlines()[-25:]
    return [f"  FAILED: exit {run.rc}{why} after {run.wall:.1f} s; peak RSS {run.peak_rss_tree / MIB:,.0f} MiB",
            "  its output (last lines):", *("    " + x for x in tail)]


def build_lines(p: st.Params, run: BuildRun, res: Output, floor: Floor) -> list[str]:
    spans = p.total_spans
    floor_ratio = floor.cpu / run.cpu if run.cpu else float("nan")
    if spans >= T_RSS_SPANS:
        rss_target = f"({T_RSS}) {T_RSS.verdict(run.peak_rss_tree)}"
    else:
        rss_target = f"(target < 1 GiB applies at {T_RSS_SPANS // 1_000_000}M spans: --spans {T_RSS_SPANS})"
    out = harness.table([
        ("spans", f"{spans:,}"),
        ("transitions written", f"{res.rows:,} in {res.files} file(s), {res.bytes / MIB:,.0f} MiB"),
        ("wall", f"{run.wall:.2f} s"),
        ("CPU (user + sys)", f"{run.cpu:.2f} s ({run.cpu_user:.2f} + {run.cpu_sys:.2f}; "
                             f"{run.cpu / run.wall:.2f} cores on average)"),
        ("spans/s", fmt(spans / run.wall)),
        ("spans per CPU-second (per core)", fmt(per_core(p, run))),
        ("floor: read spans + write rows", f"{floor.wall:.2f} s wall, {floor.cpu:.2f} CPU-s (read {floor.read_s:.2f} s, "
                                           f"write {floor.write_s:.2f} s)"),
        ("build vs floor (CPU)", f"{floor_ratio:.2f}x the floor's speed  ({T_FLOOR}) {T_FLOOR.verdict(floor_ratio)}"),
        ("transitions/s", fmt(res.rows / run.wall)),
        ("peak RSS, process tree", f"{run.peak_rss_tree / MIB:,.0f} MiB  {rss_target}"),
        ("peak RSS, largest process", f"{run.maxrss_one / MIB:,.0f} MiB (wait4 ru_maxrss)"),
    ], align="<<")
    if run.other_cores > 0.25:
        out.append(f"  WARNING: other processes used {run.other_cores:.2f} cores during the build; the machine was not quiet")
    summary = [x for x in run.stdout.strip().splitlines() if x.strip()]
    if summary:
        out.append("  the build's summary:")
        out.extend("    " + x for x in summary[:12])
    out.append("checks (transitions read back, not timed):")
    out.extend("  " + x for x in res.checks)
    return out


def ray_runs(root: Path, args: argparse.Namespace) -> list[tuple[int, BuildRun]]:
    buckets = args.buckets or 4 * max(args.worker_counts)
    out = []
    for w in args.worker_counts:
        shutil.rmtree(root / "transitions", ignore_errors=True)
        extra = [*args.build_arg, "--build-engine", "ray", "--build-workers", str(w), "--build-buckets", str(buckets)]
        log(f"running on Ray, {w} worker(s): " + " ".join(["nightshift", "build", *extra]))
        run = run_build(root, extra, args.timeout, args.rss_limit * MIB if args.rss_limit else 0.0)
        log(f"  exited {run.rc} after {run.wall:.1f} s")
        out.append((w, run))
        if run.rc != 0:
            break
    return out


def ray_lines(p: st.Params, args: argparse.Namespace, runs: list[tuple[int, BuildRun]]) -> list[str]:
    """Each worker count's wall time and memory, the speed-up, and Amdahl's law fitted
    to the first and last counts (T(n) = serial + parallel / n) projected to N."""
    buckets = args.buckets or 4 * max(args.worker_counts)
    made = sorted({_buckets_built(run.stdout) for _, run in runs if run.rc == 0} - {0})
    out = ["", f"Ray: the same build on a local cluster of each worker count (--build-engine ray --build-buckets "
               f"{buckets}, at least that many buckets; the build made {' and '.join(map(str, made)) or '?'}, as its "
               f"memory budget sizes them; cluster start-up included in the wall time)"]
    if len(made) > 1:
        out.append("  the worker counts built different bucket counts: not the same work, the speed-up is not the target's")
    for w, run in runs:
        if run.rc != 0:
            out.extend(failure_lines(run, args))
            return out
    base_w, base = runs[0]
    rows = []
    for w, run in runs:
        workers = _ray_line(run.stdout)[0] or "?"
        rows.append((f"{w} worker(s)", f"{run.wall:.2f} s wall, {fmt(p.total_spans / run.wall)} spans/s, "
                                       f"speed-up {base.wall / run.wall:.2f}x; peak RSS: driver "
                                       f"{run.peak_rss_root / MIB:,.0f} MiB, each worker {workers}, "
                                       f"whole tree (Ray's own processes too) {run.peak_rss_tree / MIB:,.0f} MiB"))
    out.extend(harness.table(rows, align="<<"))
    if 1 in dict(runs) and 2 in dict(runs):
        ratio = dict(runs)[1].wall / dict(runs)[2].wall
        fixed = [max(r.wall - sum(v for k, v in _phases(r.stdout).items() if k in ("split", "buckets", "partitions")),
                     0.0) for r in (dict(runs)[1], dict(runs)[2])]
        where = ("the target's run" if p.total_spans >= T_RAY_SPANS else
                 f"the target is read at {T_RAY_SPANS:,} spans (--spans {T_RAY_SPANS}); this window is smaller")
        out.append(f"  2 workers vs 1: {ratio:.2f}x ({T_RAY}) {T_RAY.verdict(ratio)} at {p.total_spans:,} spans "
                   f"[{where}; the driver alone, whatever the workers (start-up, Ray's cluster, listing, advantages, "
                   f"commit): {fixed[0]:.1f} s of 1 worker's {dict(runs)[1].wall:.1f} s, {fixed[1]:.1f} s of 2 workers' "
                   f"{dict(runs)[2].wall:.1f} s]"
                   + (f"  [other processes used {max(r.other_cores for _, r in runs):.2f} cores meanwhile: "
                      "the workers did not have the cores to themselves]" if max(r.other_cores for _, r in runs) > 0.25
                      else ""))
    out.extend(_round_lines(runs))
    out.extend(_idle_lines(runs))
    out.extend(_process_lines(runs))
    phases = _phases(base.stdout)
    if phases:
        # on Ray the split, the buckets and the date partitions are tasks: more workers share the first two,
        # the partitions as far as there are dates; the rest (start-up, the cluster's, listing, the advantages,
        # the commit) stays in the driver
        work, split, parts = phases.get("work", 0.0), phases.get("split", 0.0), phases.get("partitions", 0.0)
        serial = max(base.wall - phases.get("buckets", 0.0) - split - parts, 0.0)
        dates = max(1, next((len(x.split(":", 1)[1].split(",")) for x in base.stdout.splitlines()
                             if x.startswith("partitions written:")), 1))

        def t(n: int) -> float:
            return serial + (split + work) / n + parts / min(n, dates)

        out.append(f"  {base_w} worker(s): {serial:.1f} s in the driver alone (start-up, Ray's cluster, listing, "
                   f"advantages {phases.get('advantages', 0.0):.1f} s) + tasks: split {split:.1f} s, buckets "
                   f"{work:.1f} s of work, {dates} date partition(s) {parts:.1f} s")
        out.append("  projected for N workers, each with a core (Amdahl: driver + (split + buckets) / N + partitions "
                   "/ min(N, dates)): " + ", ".join(f"N={n}: {t(1) / t(n):.1f}x" for n in (2, 4, 8, 16, 64)))
        out.append(f"  the same without the driver's fixed start-up (a window {10}x this size): " + ", ".join(
            f"N={n}: {(serial + 10 * (split + work + parts)) / (serial + 10 * ((split + work) / n + parts / min(n, dates))):.1f}x"
            for n in (2, 4, 8, 16, 64)))
        out.extend(_cpu_lines(runs))
        if os.cpu_count() and max(args.worker_counts) > os.cpu_count():
            out.append(f"  (this machine has {os.cpu_count()} cores: counts above it share them)")
    return out


#: Ray's processes by the program their command line (or process title) starts with, first match wins: the
#: raylet's arguments name the agents' scripts, so only the first three words are looked at
_RAY_KINDS = (("nightshift.cli", "driver"), ("raylet", "raylet"), ("gcs_server", "GCS"),
              ("DashboardAgent", "agents"), ("dashboard/agent", "agents"), ("RuntimeEnv", "agents"),
              ("runtime_env", "agents"), ("default_worker", "workers"), ("ray::", "workers"),
              ("log_monitor", "log monitor"), ("monitor.py", "autoscaler monitor"), ("dashboard.py", "API server"))


def _process_lines(runs: list[tuple[int, BuildRun]]) -> list[str]:
    """Where the CPU went in each run, process by process (sampled with the RSS, so a
    process's last 50 ms may be missed): the driver, the workers, and Ray's own
    processes, which on a 2-core machine take their CPU from the workers."""
    out = []
    for w, run in runs:
        kinds: dict[str, float] = {}
        for line, cpu in run.proc_cpu.values():
            head = " ".join(line.split()[:3])
            kind = next((k for marker, k in _RAY_KINDS if marker in head), "other")
            kinds[kind] = kinds.get(kind, 0.0) + cpu
        if not kinds:
            continue
        own = {k: v for k, v in kinds.items() if k not in ("driver", "workers")}
        out.append(f"  {w} worker(s), CPU-seconds by process: driver {kinds.get('driver', 0.0):.1f}, workers "
                   f"{kinds.get('workers', 0.0):.1f}, Ray's own {sum(own.values()):.1f} ("
                   + ", ".join(f"{k} {v:.1f}" for k, v in sorted(own.items(), key=lambda x: -x[1])) + ")")
    return out


def _buckets_built(stdout: str) -> int:
    """The buckets the build made (its summary's first line; 0 if absent): --build-buckets
    is a floor, and the memory budget makes more of a large window (67 of the 1M
    benchmark's, where the title said 8)."""
    import re

    m = re.search(r"\b(\d+) bucket\(s\)\)", next((x for x in stdout.splitlines() if x.startswith("transitions:")), ""))
    return int(m.group(1)) if m else 0


def _ray_line(stdout: str) -> tuple[str, list[float]]:
    """The build's `ray:` line: each worker's peak RSS (as printed) and the CPU-seconds of its tasks."""
    import re

    line = next((x for x in stdout.splitlines() if x.startswith("ray:")), "")
    rss = line.split("peak RSS ", 1)[1].split(";", 1)[0] if "peak RSS " in line else ""
    cpu = line.split("tasks' CPU ", 1)[1] if "tasks' CPU " in line else ""
    return rss, [float(x) for x in re.findall(r"([\d.]+) s", cpu)]


def _cpu_lines(runs: list[tuple[int, BuildRun]]) -> list[str]:
    """Amdahl's law in CPU-seconds, which other processes on a shared machine do not
    inflate as they do wall time: the driver's CPU-seconds stay serial, the tasks'
    (split, buckets, partitions) divide among the workers, and the busiest worker
    bounds the wall. Serial is counted two ways: the driver's whole process as wait4
    gives it (the CLI's imports and Ray's start-up included: fixed, whatever the
    window), and the driver's CPU inside the build alone (what grows with the window)."""
    out = []
    one = one_tasks = 0.0  # the 1-worker run's driver + tasks (its time on one core, had it had one), its tasks
    for w, run in runs:
        _, cpu = _ray_line(run.stdout)
        m = next((re.search(r"the driver's CPU: ([\d.]+) s", x) for x in run.stdout.splitlines()
                  if x.startswith("time: ")), None)
        if not cpu or not m:
            continue
        inside, tasks = float(m.group(1)), sum(cpu)
        whole = max(run.cpu, inside)
        if w == 1:
            one, one_tasks = whole + tasks, tasks
        out.append(f"  {w} worker(s), CPU-seconds: tasks {tasks:.1f} s (" + " + ".join(f"{c:.1f}" for c in cpu)
                   + f" by worker); driver {whole:.1f} s as wait4 counts its process (serial share "
                   f"{whole / (whole + tasks):.0%}), of which {inside:.1f} s inside the build "
                   f"({inside / (inside + tasks):.0%})")
        if w != max(x for x, _ in runs):
            continue
        # the longest worker bounds the wall time (its imbalance counts as serial too), and so do the cores: a
        # round of dates spread over more worker processes than cores (Engine.run spread) shares them
        busiest = max(max(cpu), tasks / w)
        got = (whole + tasks) / (whole + busiest)
        late = (inside + tasks) / (inside + busiest)
        out.append(f"  speed-up from CPU-seconds with {w} worker(s), (driver + tasks) / (driver + max(busiest worker, tasks / workers)): "
                   f"{got:.2f}x ({T_RAY}) {T_RAY.verdict(got) if w == 2 else ''}; {late:.2f}x without the driver's "
                   "fixed start-up (a window large enough that it does not count)"
                   + (f"; {one / (whole + busiest):.2f}x against the 1-worker run's own CPU-seconds (2 workers' tasks "
                      f"took {tasks / one_tasks - 1:+.0%} CPU-seconds against 1 worker's, each run under its own load)"
                      if one_tasks else ""))
        fixed = whole - inside
        out.append("  projected for N workers (Amdahl in CPU-seconds, serial = the driver): this window "
                   + ", ".join(f"N={n}: {(whole + tasks) / (whole + tasks / n):.1f}x" for n in (2, 4, 8, 16, 64))
                   + "; a window 10x this size " + ", ".join(
                       f"N={n}: {(fixed + 10 * (inside + tasks)) / (fixed + 10 * (inside + tasks / n)):.1f}x"
                       for n in (2, 4, 8, 16, 64)))
    return out


def _round_lines(runs: list[tuple[int, BuildRun]]) -> list[str]:
    """Each round's wall seconds by worker count, and the speed-up round by round:
    where the last count loses against a perfect split (a round's tail, a worker
    started late) and what stays in the driver alone (start-up, advantages, commit)."""
    got = {w: _phases(r.stdout) for w, r in runs}
    if len(got) < 2 or not all(got.values()):
        return []
    lo, hi = min(got), max(got)
    rounds = ("split", "buckets", "advantages", "partitions")
    alone = {w: max(r.wall - sum(got[w].get(k, 0.0) for k in rounds if k != "advantages"), 0.0) for w, r in runs}
    return [f"  rounds, {lo} -> {hi} worker(s), wall s (speed-up): " + ", ".join(
        f"{k} {got[lo].get(k, 0.0):.1f} -> {got[hi].get(k, 0.0):.1f} ({got[lo].get(k, 0.0) / got[hi][k]:.2f}x)"
        if got[hi].get(k) else f"{k} {got[lo].get(k, 0.0):.1f} -> {got[hi].get(k, 0.0):.1f}" for k in rounds)
        + f"; the driver alone (start-up, advantages, commit, stop) {alone[lo]:.1f} -> {alone[hi]:.1f}"]


#: the Ray rounds by the function their tasks run, as the build's summary names them
_ROUNDS = {"split_files": "split", "run_bucket": "buckets", "stage_day": "dates"}


def _idle_lines(runs: list[tuple[int, BuildRun]]) -> list[str]:
    """Each round's idle worker-seconds, from the build's own line: its task slots
    times its wall time less its tasks' seconds in the workers (the workers'
    imports before their first task, a process started late, the round's tail).
    Wall-based, so a loaded machine inflates them too; on a quiet one they are
    what keeps a round from its worker count's speed-up."""
    import re

    out = []
    for w, run in runs:
        line = next((x for x in run.stdout.splitlines() if x.startswith("ray idle worker-seconds by round:")), "")
        got = re.findall(r"(\w+) (-?[\d.]+) s", line.split(":", 1)[1]) if line else []
        if got:
            out.append(f"  {w} worker(s), idle worker-seconds by round (slots x wall - the tasks' own seconds: imports, "
                       "late processes, tails): " + ", ".join(f"{_ROUNDS.get(k, k)} {float(v):.2f}" for k, v in got))
    return out


def _phases(stdout: str) -> dict[str, float]:
    """The build's `time:` line: each phase's seconds, and the buckets' own work summed ('work')."""
    import re

    line = next((x for x in stdout.splitlines() if x.startswith("time: ")), "")
    out = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", line.split("(", 1)[0])}
    work = re.search(r"own work: ([\d.]+) s", line)
    if work:
        out["work"] = float(work.group(1))
    return out


def per_core(p: st.Params, run: BuildRun) -> float:
    """Spans per CPU-second of the build."""
    return p.total_spans / run.cpu if run.cpu else float("nan")


def peer_lines(p: st.Params, args: argparse.Namespace, run: BuildRun, res: Output) -> list[str]:
    """Agent Lightning on the first --peer-spans spans' worth of the same trajectories."""
    out = ["", f"peer: Agent Lightning, the first {args.peer_spans:,} spans' worth of the same trajectories"
               + (" (those in its layout; it reads no other)" if p.mix else "")]
    try:
        peer = peer_agl.run(p.to_json(), args.peer_spans)
    except peer_agl.PeerSkipped as e:
        return [*out, f"  skipped: {e}"]
    out.extend("  " + x for x in peer_agl.lines(peer))
    if peer.get("install_s"):
        out.append(f"  (installed into {peer['venv']} in {peer['install_s']:.0f} s)")
    ratio = per_core(p, run) / peer['spans_per_cpu_s']
    out.append(f"  nightshift / AGL, spans/s: {p.total_spans / run.wall / peer['spans_per_s']:.2f}x wall, "
               f"{ratio:.2f}x per CPU-second ({T_AGL}) {T_AGL.verdict(ratio)}; "
               f"transitions/s vs triplets/s: {res.rows / run.wall / peer['triplets_per_s']:.2f}x")
    out.append("  (not the same work: nightshift's figure is end to end, Parquet on disk to Parquet on disk, "
               "process start and imports included; AGL's is its adapter alone on Span objects already in memory. "
               "AGL's OTLP path, decoding included, is about 7x slower than its adapter: "
               "shared/research/agent-lightning.md section 6)")
    return out


def main() -> int:
    args, p = parse_args()
    rep = harness.Report()
    rep.extend(header(args, p))
    with harness.sigterm_as_interrupt(), dataset_dir(args) as root:
        try:
            gen = generate(p, root, args)
            rep.extend(generator_lines(gen, root))
            if args.generate_only:
                rep.print()
                return 0
            if args.engine == "ray":
                runs = ray_runs(root, args)
                rep.extend(ray_lines(p, args, runs))
                rep.print()
                return 0 if runs[-1][1].rc == 0 else 1
            run = measure_build(root, args)
            rep.extend(build_title(args))
            if run.rc != 0:
                rep.extend(failure_lines(run, args))
                rep.print()
                return 1
            res = inspect_output(p, root, args.replicate)
            log("measuring the floor: read the spans, write the transitions")
            floor = measure_floor(root)
            rep.extend(build_lines(p, run, res, floor))
            if args.peer == "agl":
                rep.extend(peer_lines(p, args, run, res))
            rep.print()
            return 0 if res.ok else 1
        except KeyboardInterrupt:
            log("interrupted")
            return 130


if __name__ == "__main__":
    sys.exit(main())
