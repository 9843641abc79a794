#!/usr/bin/env python
"""What listing prompt versions costs on a lake of the build benchmark's size:
`nightshift prompts` (every agent's prompt versions with their reward, what a
person and the nightly job's proposer read) and, beside it, `nightshift versions`
(the adapters' own listing, which reads no message).

    python benchmarks/transform.py --spans 1000000 --data /tmp/bench-1m      # once: spans and transitions
    python benchmarks/prompts.py --data /tmp/bench-1m [--baseline /tmp/old-pkg]

Each command is a process of its own (CPU and peak RSS by wait4), run --rounds
times; the figures are the rounds' minimum. --baseline PKGDIR runs the same
commands with PYTHONPATH=PKGDIR in the same rounds (a folder whose `nightshift` is
another checkout, e.g. a symlink to a worktree), and says whether its output was
the same. Targets: peak RSS within the build's memory budget (512 MiB), and CPU
within a tenth of a full build of the same lake (--build-cpu, or measured with
--with-build): a listing a person waits for, run every night before proposing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from harness import Target, log, measured  # noqa: E402

T_RSS = Target("<=", 512, "512 MiB (the build's memory_budget)", "`nightshift prompts` peak RSS")
T_CPU = Target("<=", 0.1, "0.1x a full build of the same lake", "`nightshift prompts` CPU")


def parse_args():
    ap = harness.parser(__doc__)
    ap.add_argument("--data", type=Path, required=True, help="a lake with transitions (the build benchmark's --data)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each command; the minimum is reported (default 2)")
    ap.add_argument("--baseline", type=Path, default=None, metavar="PKGDIR",
                    help="a folder holding another `nightshift` package, run in the same rounds for comparison")
    ap.add_argument("--build-cpu", type=float, default=None, metavar="S",
                    help="CPU seconds of a full build of this lake, for the CPU target (default: not judged)")
    ap.add_argument("--with-build", action="store_true",
                    help="measure a full build of a hard-linked copy of the lake first (its CPU is the yardstick)")
    return ap.parse_args()


def calls_in(data: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(f).metadata.num_rows for f in (data / "transitions").glob("date=*/*.parquet"))


def build_cpu(data: Path, parent: str | None) -> float:
    import subprocess

    with harness.temp_dir("nightshift-bench-prompts-", parent, False) as root:
        (root / "lake").mkdir()
        subprocess.run(["cp", "-al", str(data / "spans"), str(root / "lake" / "spans")], check=True)
        return measured([sys.executable, "-m", "nightshift.cli", "build", "--data", str(root / "lake"), "--quiet"])[1]


def main() -> int:
    args = parse_args()
    rep = harness.Report()
    rep.extend(harness.header("nightshift prompt versions benchmark (nightshift prompts)", args))
    if not any((args.data / "transitions").glob("date=*/*.parquet")):
        raise SystemExit(f"{args.data}: no transitions; run `python benchmarks/transform.py --data {args.data}` first")
    n = calls_in(args.data)
    ref = args.build_cpu
    if args.with_build:
        log("a full build of the lake, for the CPU yardstick")
        ref = build_cpu(args.data, None)
    cli = [sys.executable, "-m", "nightshift.cli"]
    commands = {"nightshift prompts": cli + ["prompts", "--data", str(args.data)],
                "nightshift prompts --json": cli + ["prompts", "--data", str(args.data), "--json"],
                "nightshift versions": cli + ["versions", "--data", str(args.data)]}
    sides = {"this checkout": None}
    if args.baseline:
        sides[f"baseline {args.baseline}"] = {**os.environ, "PYTHONPATH": str(args.baseline)}
    best: dict[tuple[str, str], tuple[float, float, float]] = {}
    outputs: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        for name, cmd in commands.items():
            for side, env in sides.items():
                log(f"round {r + 1}: {name} ({side})")
                wall, cpu, rss, out = measured(cmd, env)
                old = best.get((name, side))
                best[(name, side)] = (wall, cpu, rss) if old is None else tuple(map(min, old, (wall, cpu, rss)))
                outputs[(name, side)] = out
    rep.say("")
    rep.say(f"lake: {args.data}, {n:,} calls in its transitions"
            + (f"; a full build of it: {ref:.1f} CPU-s" if ref else ""))
    rows = []
    for (name, side), (wall, cpu, rss) in best.items():
        rows.append((name, side, f"{wall:.2f}", f"{cpu:.2f}", f"{rss:.0f}", f"{n / cpu:,.0f}"))
    rep.extend(harness.table(rows, header=("command", "code", "wall s", "CPU s", "peak RSS MiB", "calls per CPU-s")))
    if args.baseline:
        base = next(s for s in sides if s != "this checkout")
        for name in commands:
            same = outputs[(name, "this checkout")] == outputs[(name, base)]
            rep.say(f"{name}: the same output as the baseline: {'yes' if same else 'NO'}")
    _, cpu, rss = best[("nightshift prompts", "this checkout")]
    rep.say(T_RSS.check(rss) + f" ({rss:.0f} MiB)")
    if ref:
        rep.say(T_CPU.check(cpu / ref) + f" ({cpu / ref:.3f}x: {cpu:.2f} against {ref:.1f} CPU-s)")
    else:
        rep.say(f"{T_CPU}: not judged (give --build-cpu or --with-build)")
    rep.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
