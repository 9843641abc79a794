"""The trainer benchmark runs (tiny model, CPU): every run it compares trains and
reports its figures. Its numbers are printed, never asserted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_train_benchmark_runs_at_tiny_size():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), "--tiny", "--steps", "4",
                        "--warmup", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    tps, steps = {}, {}
    for run in ("nightshift pg", "nightshift sft", "trl sft default"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(run))
        # columns are two spaces apart (benchmarks/harness.py: table); "1.2 GiB" on a GPU is one cell
        name, tokens_s, _mfu, _peak, n_steps, _notes = re.split(r"\s{2,}", line.strip())
        assert name == run, line
        tps[run], steps[run] = float(tokens_s.replace(",", "")), int(n_steps)
        assert tps[run] > 0, line  # tokens/s measured
    # every run did the steps asked (3 timed after 1 warm-up are still 4 steps), and the
    # printed ratios are those of the printed figures, not figures of their own
    assert set(steps.values()) == {4}, steps
    for run in ("nightshift pg", "nightshift sft"):
        ratio = float(out.split(f"{run} / trl defaults, tokens/s:")[1].split("x")[0])
        assert ratio == pytest.approx(tps[run] / tps["trl sft default"], abs=0.011), (run, ratio, tps)
    assert "CPU, tiny model" in out
