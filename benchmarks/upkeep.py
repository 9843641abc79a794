#!/usr/bin/env python
"""The lake's upkeep, what the nightly job does before it builds: what `nightshift
prune` costs on a lake like the build benchmark's (the oldest date pruned, with
traces that crossed its midnight), and, with --small-files N, what a lake of N
small files costs the build before and after `nightshift compact`.

    python benchmarks/transform.py --spans 1000000 --data /tmp/bench-1m --generate-only   # once
    python benchmarks/upkeep.py --data /tmp/bench-1m [--crossing 200]
    python benchmarks/upkeep.py --data /tmp/bench-200k --small-files 2000

Prune:
The lake is copied by hard links (nothing of it is changed). Setup, not timed:
--crossing traces of the oldest date get a copy of their spans appended to the
largest file of the next date (--crossing-dates: of more), the way a collector's
file written just after midnight holds the ends of traces that started before it;
the prune must rewrite each such file whole. Then, each a process (CPU and peak
RSS by wait4): a full `nightshift build` of the lake (so transitions are pruned
too, and for scale), one read of every span file (pyarrow, every column),
`nightshift prune --dry-run` and `nightshift prune`. Targets: the prune's peak
RSS within the build's memory budget (512 MiB), and its CPU under a tenth of
the build's: keeping a week must cost the nightly job little beside building it.

Compaction (--small-files N): every date's spans rewritten, not timed, as N files
in all (one row group each, in order, with the collector's Parquet options), the
files a quiet sidecar seals every 10 s.
Then, each a process: a full build of the lake as it came (big files), a full
build of the small files, `nightshift compact`, a full build of what it merged.
Targets: the build after compaction within 1.2x of the build of the big files,
and compaction plus that build cheaper than building the small files.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from harness import Target, log, measured  # noqa: E402

T_RSS = Target("<=", 512, "512 MiB (the build's memory_budget)", "peak RSS")
T_CPU = Target("<=", 0.1, "0.1x a full build of the same lake", "prune CPU")
T_MERGED = Target("<=", 1.2, "1.2x the build of the big files", "build after compaction")
T_PAYS = Target("<", 1.0, "1.0x the build of the small files", "compaction + build")


def parse_args():
    ap = harness.parser(__doc__, temp_dir=True, keep=True)
    ap.add_argument("--data", type=Path, required=True, help="a lake with spans in two dates or more (the build "
                                                             "benchmark's --data)")
    ap.add_argument("--crossing", type=int, default=200,
                    help="traces of the oldest date that went on past its midnight (default 200)")
    ap.add_argument("--small-files", type=int, default=0, metavar="N",
                    help="measure compaction instead: the lake's spans as N small files, built before and after "
                         "`nightshift compact`")
    ap.add_argument("--crossing-dates", type=int, default=1,
                    help="later dates the crossing traces reach, each in its largest file (default 1: the next day)")
    return ap.parse_args()


def dates(spans: Path) -> list[str]:
    return sorted(p.name.split("=", 1)[1] for p in spans.glob("date=*") if p.is_dir())


def link_copy(src: Path, dst: Path) -> None:
    for name in ("spans", "logs", "feedback"):
        if (src / name).is_dir():
            subprocess.run(["cp", "-al", str(src / name), str(dst / name)], check=True)


def add_crossing(lake: Path, first: str, later: list[str], n: int) -> int:
    """Copy the spans of `n` traces of date `first` into the largest file of each later
    date (a new file under the old name: the hard-linked original is untouched)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    old = sorted((lake / "spans" / f"date={first}").glob("*.parquet"))
    ids = pq.read_table(old[0], columns=["trace_id"]).column("trace_id")
    chosen = pc.unique(ids).slice(0, n)
    rows = pq.read_table(old[0]).filter(pc.is_in(pq.read_table(old[0], columns=["trace_id"]).column("trace_id"),
                                                 value_set=chosen))
    for d in later:
        big = max((lake / "spans" / f"date={d}").glob("*.parquet"), key=lambda p: p.stat().st_size)
        pf = pq.ParquetFile(big)
        codec = pf.metadata.row_group(0).column(0).compression.lower()
        group = max(pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups))
        table = pa.concat_tables([pf.read(), rows.cast(pf.schema_arrow)])
        tmp = big.with_suffix(".setup")
        pq.write_table(table, tmp, compression=codec, row_group_size=group)
        os.replace(tmp, big)
    return len(chosen)


READ = """
import sys, pyarrow.parquet as pq
from pathlib import Path
n = 0
for f in sorted(Path(sys.argv[1]).rglob("*.parquet")):
    n += pq.read_table(f).num_rows
print(n)
"""


def split(lake: Path, n: int) -> int:
    """Every date's span files rewritten as small files, `n` in all over the lake, in
    row order, each one row group (what a quiet collector seals). Returns the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nightshift.collector.datasets import parquet_options

    files = sorted((lake / "spans").glob("date=*/*.parquet"))
    total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    per = max(1, total // n)
    written = 0
    for part in sorted((lake / "spans").glob("date=*")):
        k = 0
        for f in sorted(part.glob("*.parquet")):
            t = pq.ParquetFile(f).read()
            f.unlink()  # a hard link: the original lake keeps its file
            options = parquet_options(t.schema)  # as the collector writes its files
            for start in range(0, t.num_rows, per):
                pq.write_table(t.slice(start, per), part / f"part-quiet-{k:06d}.parquet", row_group_size=per,
                               **options)
                k += 1
                written += 1
            del t
    return written


def compaction_main(args, head: list[str]) -> int:
    rep = harness.Report()
    rep.extend(head)
    cli = [sys.executable, "-m", "nightshift.cli"]
    with harness.temp_dir("nightshift-bench-compaction-", args.dir, args.keep) as root:
        big, small = root / "big", root / "small"
        for lake in (big, small):
            lake.mkdir()
            link_copy(args.data, lake)
        log(f"setup: the spans as {args.small_files} small files")
        files = int(subprocess.run([sys.executable, __file__, "_split", str(small), str(args.small_files)],
                                   check=True, capture_output=True, text=True).stdout)
        log("build of the big files")
        b = measured(cli + ["build", "--data", str(big), "--quiet"])
        log(f"build of {files} small files")
        s = measured(cli + ["build", "--data", str(small), "--quiet"])
        rows_small = _rows(small)
        log("nightshift compact")
        c = measured(cli + ["compact", "--data", str(small)])
        merged = len(list((small / "spans").glob("date=*/*.parquet")))
        log("build of the merged files")
        m = measured(cli + ["build", "--data", str(small), "--quiet"])
        same = _rows(small) == rows_small == _rows(big)
    rep.say("")
    rep.say(f"lake: {args.data}; its spans as {files:,} small files, {merged} once merged")
    rep.extend(harness.table([
        ("build, the big files as generated", f"{b[0]:.2f}", f"{b[1]:.2f}", f"{b[2]:.0f}"),
        (f"build, {files:,} small files", f"{s[0]:.2f}", f"{s[1]:.2f}", f"{s[2]:.0f}"),
        ("nightshift compact", f"{c[0]:.2f}", f"{c[1]:.2f}", f"{c[2]:.0f}"),
        (f"build, the {merged} merged files", f"{m[0]:.2f}", f"{m[1]:.2f}", f"{m[2]:.0f}"),
    ], header=("", "wall s", "CPU s", "peak RSS MiB")))
    rep.say("what compact printed:")
    rep.extend(c[3].strip().splitlines(), "  ")
    rep.say(f"transitions: the same rows from all three lakes: {'yes' if same else 'NO'}")
    rep.say(f"{T_MERGED.check(m[1] / b[1])} ({m[1] / b[1]:.2f}x: {m[1]:.2f} against {b[1]:.2f} CPU-s)")
    rep.say(f"{T_PAYS.check((c[1] + m[1]) / s[1])} ({(c[1] + m[1]) / s[1]:.2f}x: {c[1]:.2f} + {m[1]:.2f} against "
            f"{s[1]:.2f} CPU-s)")
    rep.print()
    return 0 if same else 1


def _rows(lake: Path) -> str:
    """The transitions, as a digest of their rows sorted by id (their order within a date follows the files)."""
    out = subprocess.run([sys.executable, "-c", ROWS, str(lake)], check=True, capture_output=True, text=True)
    return out.stdout.strip()


ROWS = """
import sys, hashlib, polars as pl
df = pl.read_parquet(sys.argv[1] + "/transitions/date=*/*.parquet", hive_partitioning=True).sort("transition_id")
print(df.height, hashlib.sha256(df.hash_rows().to_numpy().tobytes()).hexdigest())
"""


def main() -> int:
    args = parse_args()
    if args.small_files:
        return compaction_main(args, harness.header("nightshift lake upkeep benchmark: compaction", args))
    head = harness.header("nightshift lake upkeep benchmark: retention (nightshift prune)", args)
    spans = args.data / "spans"
    ds = dates(spans)
    if len(ds) < 2:
        raise SystemExit(f"{spans}: needs two dates or more, found {ds}")
    today = dt.datetime.now(dt.timezone.utc).date()
    days = (today - dt.date.fromisoformat(ds[1])).days  # the oldest date goes, the rest stays
    rep = harness.Report()
    rep.extend(head)
    with harness.temp_dir("nightshift-bench-retention-", args.dir, args.keep) as root:
        lake = root / "lake"
        lake.mkdir()
        link_copy(args.data, lake)
        log(f"setup: {args.crossing} trace(s) of {ds[0]} copied into the largest file of {len(ds) - 1} later date(s)")
        # in a process of its own: what it loads would otherwise count in every later child's peak RSS
        # (exec keeps the high-water mark of the memory a child started with, this process's)
        reach = ds[1:1 + args.crossing_dates]
        crossing = int(subprocess.run([sys.executable, __file__, "_setup", str(lake), str(args.crossing), ds[0], *reach],
                                      check=True, capture_output=True, text=True).stdout)
        log("nightshift build (full), so that transitions are pruned too and for scale")
        b_wall, b_cpu, b_rss, _ = measured([sys.executable, "-m", "nightshift.cli", "build", "--data", str(lake),
                                            "--quiet"])
        kept_bytes = sum(p.stat().st_size for d in ds[1:] for p in (spans / f"date={d}").glob("*.parquet"))
        log("one read of the lake's spans")
        r_wall, r_cpu, r_rss, r_out = measured([sys.executable, "-c", READ, str(lake / "spans")])
        prune = [sys.executable, "-m", "nightshift.cli", "prune", "--data", str(lake), "--days", str(days)]
        log("nightshift prune --dry-run")
        d_wall, d_cpu, d_rss, d_out = measured(prune + ["--dry-run"])
        log("nightshift prune")
        p_wall, p_cpu, p_rss, p_out = measured(prune)
        left = sorted(p.name for p in (lake / "spans").glob("date=*"))
        left_t = sorted(p.name for p in (lake / "transitions").glob("date=*"))
    rep.say("")
    rep.say(f"lake: {args.data} ({len(ds)} dates, {r_out.strip()} spans with the crossing copies); "
            f"--days {days}: {ds[0]} goes; {crossing} trace(s) crossed its midnight into {len(reach)} later date(s)")
    rep.extend(harness.table([
        ("nightshift build (full)", f"{b_wall:.2f}", f"{b_cpu:.2f}", f"{b_rss:.0f}"),
        ("one read of every span file (pyarrow)", f"{r_wall:.2f}", f"{r_cpu:.2f}", f"{r_rss:.0f}"),
        ("nightshift prune --dry-run", f"{d_wall:.2f}", f"{d_cpu:.2f}", f"{d_rss:.0f}"),
        ("nightshift prune", f"{p_wall:.2f}", f"{p_cpu:.2f}", f"{p_rss:.0f}"),
    ], header=("", "wall s", "CPU s", "peak RSS MiB")))
    rep.say("what the prune printed:")
    rep.extend(p_out.strip().splitlines(), "  ")
    rep.say(f"dates left: spans/ {', '.join(left)}; transitions/ {', '.join(left_t)}; the kept dates' span files were "
            f"{kept_bytes / 2**20:.0f} MiB")
    rep.say(f"{T_RSS.check(p_rss)} ({p_rss:.0f} MiB)")
    rep.say(f"{T_CPU.check(p_cpu / b_cpu)} ({p_cpu / b_cpu:.3f}x: {p_cpu:.2f} against {b_cpu:.2f} CPU-s)")
    rep.print()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_split"]:
        print(split(Path(sys.argv[2]), int(sys.argv[3])))
        sys.exit(0)
    if sys.argv[1:2] == ["_setup"]:
        lake, n, first, *later = sys.argv[2:]
        print(add_crossing(Path(lake), first, later, int(n)))
        sys.exit(0)
    sys.exit(main())
