"""benchmarks/route.py reads, per proxied phase, the collector passes route9's proxy
took with requests in flight (nightshift_route_gc_stall_seconds): the stalls of
every stream, their count, their time, how many were over 2 ms and the largest's
bucket. Passes at idle (the proxy's own, between its phases) are not stalls."""

from __future__ import annotations

import argparse

from nightshift.route.metrics import Metrics

from test_bench_harness import _load

route = _load("route")


def _metrics_text(stalls: list[float], idle: int) -> str:
    m = Metrics()
    busy = [1]
    watch = m.gc_watcher(lambda: busy[0])
    for took in stalls:
        m.gc_stalls.observe(took)  # as the watcher does for a pass with requests in flight
    busy[0] = 0
    for _ in range(idle):
        watch("start", {"generation": 2})
        watch("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
    return m.render().decode()


def test_the_stalls_are_read_apart_from_the_idle_passes():
    text = _metrics_text([0.0015, 0.004, 0.003], idle=5)
    s = route.gc_stalls(text)
    assert s["n"] == 3.0 and abs(s["s"] - 0.0085) < 1e-9
    assert s["n"] - s["le=0.002"] == 2.0  # over 2 ms
    assert route.largest_ms(s) == "<= 5 ms"
    assert route.gc_pauses(text)[2][0] == 5.0  # the idle passes: passes, not stalls
    assert route.gc_stalls("nightshift_route_requests_total 3.0\n") == {}  # a proxy from before route9
    assert route.largest_ms(route.gc_stalls(_metrics_text([], idle=1))) == "none"


def test_a_run_prints_the_stalls_and_no_longer_calls_every_pass_one():
    run = route.Measured([(0.010, 0.5)] * 10, 1.0, [route.Proxied(
        "proxied", [(0.011, 0.5, False)] * 10, secs=1.0, cpu=0.01, gc={2: [3.0, 0.003, 0.0]},
        stalls={"n": 1.0, "s": 0.0042, "le=0.002": 0.0, "le=0.005": 1.0, "le=0.01": 1.0})])
    args = argparse.Namespace(streams=10, requests=1, rounds=1, chunks=20, pace=0.025, prompt=None, baseline=None)
    lines = route.report(["title"], args, run)
    assert "  proxy collector passes in its phases: 3, 3.0 ms in all (gen2 3 / 3.0 ms), 0 of them over 2 ms" in lines
    assert ("  proxy collector passes with requests in flight (a stall of every stream): 1, 4.2 ms in all, 1 over "
            "2 ms, the largest <= 5 ms") in lines
