"""benchmarks/prompts.py on a small lake: it runs the listing commands as processes,
prints their figures and judges the targets, and compares a baseline's output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from transitions_data import msg, row, write

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.py"


def test_the_benchmark_prints_each_commands_figures_and_the_targets(tmp_path):
    write(tmp_path / "lake", [row([msg("system", f"Prompt {i % 2}."), msg("user", f"q{i}")], "a", float(i % 3 == 0),
                                  trajectory=f"t{i:030d}", agent="solver") for i in range(12)])
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "nightshift").symlink_to(Path(__file__).resolve().parent.parent)  # this checkout as its own baseline
    out = subprocess.run([sys.executable, str(BENCH), "--data", str(tmp_path / "lake"), "--rounds", "1",
                          "--build-cpu", "1000", "--baseline", str(pkg)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "12 calls in its transitions" in text
    for name in ("nightshift prompts", "nightshift prompts --json", "nightshift versions"):
        assert f"{name}: the same output as the baseline: yes" in text
    assert "`nightshift prompts` peak RSS <= 512 MiB (the build's memory_budget): [" in text
    assert "`nightshift prompts` CPU <= 0.1x a full build of the same lake: [met]" in text  # a second against 1000
