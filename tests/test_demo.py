"""README's first command, `make demo`, runs end to end: collector, an instrumented
program, delayed feedback, nightshift build, nightshift train."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_demo_runs_from_spans_to_transitions(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NIGHTSHIFT_"))}
    env["NIGHTSHIFT_DATA"] = str(tmp_path / "data")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "collector_demo.py")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "5/6 transitions" in r.stdout and "rewards by source: feedback 5" in r.stdout
    assert "6/6 training" in r.stdout and "train: pg on" in r.stdout
    assert (tmp_path / "data" / "checkpoints" / "v0001" / "adapter_model.safetensors").exists()
    t = pl.read_parquet(tmp_path / "data" / "transitions")
    assert t.height == 5 and t["reward"].null_count() == 0
    assert t["output_message"].struct.field("content").str.starts_with("answer").all()
