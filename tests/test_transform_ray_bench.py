"""benchmarks/transform.py's Ray part: the rounds of one worker count against the
other's, read back from each build's `time:` line, so a quiet re-measure says which
round (the split, the buckets, the dates) or the driver alone keeps 2 workers from 2x."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    # by path, under its own name: `transform` is also the repository's package
    spec = importlib.util.spec_from_file_location("bench_transform_ray", _BENCH / "transform.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_transform_ray"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_each_round_is_compared_between_the_worker_counts(bench):
    def run(wall: float, split: float, buckets: float, partitions: float):
        return bench.BuildRun([], wall=wall, stdout=f"time: split {split} s, buckets {buckets} s, advantages 0.5 s, "
                                                    f"partitions {partitions} s (the buckets' own work: 40.0 s; "
                                                    "the driver's CPU: 1.6 s)")

    (line,) = bench._round_lines([(1, run(80.0, 20.0, 45.0, 10.0)), (2, run(50.0, 10.0, 25.0, 8.0))])
    assert "split 20.0 -> 10.0 (2.00x)" in line and "buckets 45.0 -> 25.0 (1.80x)" in line
    assert "partitions 10.0 -> 8.0 (1.25x)" in line
    assert line.endswith("the driver alone (start-up, advantages, commit, stop) 5.0 -> 7.0")
    assert bench._round_lines([(1, run(80.0, 20.0, 45.0, 10.0))]) == []  # one count: nothing to compare
