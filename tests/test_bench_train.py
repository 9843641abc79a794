"""The trainer benchmark runs (tiny model, CPU): every run it compares trains and
reports its figures. Its numbers are printed, never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_train_benchmark_runs_at_tiny_size():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), "--tiny", "--steps", "4",
                        "--warmup", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for run in ("nightshift pg", "nightshift sft", "trl sft default"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(run))
        assert float(line.strip()[len(run):].split()[0].replace(",", "")) > 0, line  # tokens/s measured
    assert "nightshift pg / trl defaults, tokens/s:" in out
    assert "CPU, tiny model" in out
