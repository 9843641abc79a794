"""benchmarks/route.py's harness: what it keeps out of the p99 it reports (the
stand-in's own stalls) and what it prints to say what set a run's p99 (each
round's added p99, bursts of slow first bytes, a pinned phase). The route
target's verdict rests on these, so they are tested like the proxy is: no
timing is asserted, only what the harness computes from the times it is given."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import psutil
import pytest

from test_bench_harness import _load
from test_route_writes import Transport as _Transport

route = _load("route")


def _next_tick(steady: bool, now: float) -> tuple[str, float]:
    """The call the stand-in makes for event 1 after sending event 0 at loop time
    `now`, its request having come at loop time 100."""
    calls = []

    async def go() -> None:
        loop = asyncio.get_running_loop()
        loop.call_at = lambda when, *a: calls.append(("at", when))
        loop.call_later = lambda delay, *a: calls.append(("later", delay))
        loop.time = lambda: now
        stub = route.Stub()
        stub.t, stub.steady, stub.pace = _Transport(), steady, 0.025
        stub.tick([b"e0", b"e1", b"e2"], 0, 100.0)
        assert stub.t.sent == [b"e0"]

    asyncio.run(go())
    return calls[0]


def test_a_stalled_stand_in_sends_its_next_event_on_the_clock_not_a_pace_after_the_stall():
    """The stand-in ran 80 ms late (a collection, a wait for a core): event 1 is still
    due at request + 2 paces. Before, it was due a pace after the late send, so each
    stall moved every later event of every stream in flight, direct or proxied, and
    the total p99 measured the stand-in."""
    assert _next_tick(True, 100.105) == ("at", pytest.approx(100.05))
    assert _next_tick(False, 100.105) == ("later", 0.025)  # --harness drifting: as before, to compare


def test_bursts_tell_one_stall_from_independent_waits():
    fast = [(0.025, 0.5, False, i * 0.010) for i in range(990)]
    stall = [(0.040, 0.5, False, 5.0 + i * 0.0001) for i in range(10)]  # ten first bytes held by one stall
    assert route.bursts(fast + stall) == (10, 1, 10)
    spread = [(0.040, 0.5, False, i * 0.5) for i in range(10)]  # ten slow ones, each on its own
    assert route.bursts(fast + spread) == (10, 10, 1)


def test_each_round_is_compared_with_its_own_direct_phase():
    """A run's pooled p99 mixes rounds; the per-round line shows a round whose direct
    phase alone moved (round 2: direct 30 ms, proxied 31 ms) apart from the proxy."""
    def xs(ttfb: float) -> list:
        return [(ttfb, 0.5, False, 0.001 * i) for i in range(100)]

    m = route.Measured([*xs(0.010), *xs(0.030)], 2.0, [route.Proxied("proxied", [*xs(0.011), *xs(0.031)], secs=2.0)],
                       phases=[route.Phase("direct", 0, 100, 1.0, stub=0.1, gen=0.2),
                               route.Phase("proxied", 0, 100, 1.0, 0.3, 0.1, 0.1, 0.2),
                               route.Phase("direct", 1, 100, 1.0, stub=0.1, gen=0.2),
                               route.Phase("proxied", 1, 100, 1.0, 0.3, 0.1, 0.1, 0.2)])
    assert [len(r) for r in route.by_round(m, "proxied")] == [100, 100]
    lines = route.spread(argparse.Namespace(), m, "")
    assert lines[0].endswith("against the same round's direct phase): +1.00 / +0.00, +1.00 / +0.00")
    assert "proxied phases: proxy 0.40 (user 0.30, system 0.10), stub 0.10, load generator 0.20" in lines[1]


def test_pinning_puts_the_proxy_alone_on_the_last_cpu_and_undoes_it():
    cpus = sorted(psutil.Process().cpu_affinity())
    if len(cpus) < 2:
        pytest.skip("one CPU: --pin refuses to run there")  # not counted as passing: it checks nothing
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in range(2)]
    try:
        stub, proxy = (psutil.Process(p.pid) for p in procs)
        route.pin([stub, proxy], [proxy], cpus, True)
        assert (stub.cpu_affinity(), proxy.cpu_affinity()) == (cpus[:-1], cpus[-1:])
        route.pin([stub, proxy], [proxy], cpus, False)
        assert stub.cpu_affinity() == proxy.cpu_affinity() == cpus
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_resampled_interval_says_when_one_run_cannot_be_a_verdict():
    """A steady 5 ms added reads 5 ms in every resample; a run whose direct side had
    one stall in one half-second (its slowest 1 % all in it) reads an interval that
    straddles the target, so it is no verdict either way."""
    direct = [(0.010, 0.5, False, i * 0.01) for i in range(2000)]
    assert route.resampled(direct, [(0.015, 0.5, False, t) for _, _, _, t in direct]) == (pytest.approx(5.0),
                                                                                        pytest.approx(5.0))
    stalled = [(0.030 if 10.0 <= t < 10.5 else 0.010, 0.5, False, t) for _, _, _, t in direct]
    lo, hi = route.resampled(stalled, [(0.014, 0.5, False, t) for _, _, _, t in direct])
    assert lo < 2.0 < hi


def test_the_slowest_first_bytes_say_how_many_were_a_connections_first_request():
    """Each client opens its connection as a phase starts: when the slowest 1 % are
    mostly first requests, the p99 measures connection set-up, not forwarding."""
    xs = [(0.010, 0.5, False, i * 0.01, i % 8 == 0) for i in range(1000)]
    xs += [(0.030, 0.5, False, 20.0 + i, i < 16) for i in range(20)]
    assert route.first(xs) == pytest.approx(80.0)


def test_direct_against_direct_again_reads_the_benchmarks_own_noise():
    """--aa: a second direct phase in every round, compared as a proxy would be: a
    figure the proxy cannot have caused (here 3 ms, all of it round 2's)."""
    def xs(ttfb: float) -> list:
        return [(ttfb, 0.5, False, 0.001 * i, False) for i in range(100)]

    m = route.Measured([*xs(0.010), *xs(0.010)], 2.0, [route.Proxied("proxied", [*xs(0.011), *xs(0.011)], secs=2.0)],
                       phases=[route.Phase(w, r, 100, 1.0) for r in (0, 1) for w in ("direct", "proxied", route.AGAIN)],
                       again=[*xs(0.010), *xs(0.013)])
    line = next(x for x in route.spread(argparse.Namespace(), m, "") if "direct again" in x)
    assert line.endswith("the benchmark's own noise on the target's figure): +3.00 ms; by round +0.00, +3.00")


def test_each_run_says_how_fast_its_hour_was_steal_and_a_fixed_probe(monkeypatch):
    """The same proxy read 0.85-0.97 and 1.07-1.21 ms of CPU a request in two quiet
    windows an hour apart: a run prints the VM's steal over its wall time (as a share
    of all CPUs) and a fixed CPU-bound probe at its start and end, so a slow hour
    reads as one; and the proxy's system calls per request, whose least is known."""
    steal, clock, probes = iter([100.0, 103.0]), iter([10.0, 40.0]), iter([48.0, 61.5])
    monkeypatch.setattr(route, "steal_s", lambda: next(steal))
    monkeypatch.setattr(route.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(route, "probe_ms", lambda: next(probes))
    monkeypatch.setattr(route.os, "cpu_count", lambda: 2)
    m = route.watch_machine()()
    assert (m.probe_start_ms, m.probe_end_ms, m.secs) == (48.0, 61.5, 30.0)
    assert m.steal == pytest.approx(3.0 / 60.0)  # 3 CPU-s stolen of 2 CPUs x 30 s
    assert "48.0 ms of CPU at the start and 61.5 at the end" in m.line() and "steal 5.0 % of the 2 CPUs" in m.line()

    run = route.Measured([(0.010, 0.5)] * 10, 1.0, [route.Proxied("proxied", [(0.011, 0.5, False)] * 10, secs=1.0,
                                                                  cpu=0.01, reads=220, writes=215)], machine=m)
    args = argparse.Namespace(streams=10, requests=1, rounds=1, chunks=20, pace=0.025, prompt=None, baseline=None)
    lines = route.report(["title"], args, run)
    assert m.line() in lines
    assert any(x.startswith("  proxy system calls: 22.0 reads and 21.5 writes per proxied request of 20 events")
               for x in lines)
    assert lines[-1].startswith("  p99 overhead at 10 streams: ")  # the target line stays the last, unchanged


def test_the_proxys_collector_passes_are_read_per_phase_from_its_metrics():
    """Each collector pass in the proxy stalls every stream in flight: the run prints
    how many passes fell in the proxied phases, their time, and how many were over
    2 ms (the target's size), from the histogram the proxy serves."""
    def text(n0: int, s0: float, short0: int) -> str:
        return (f'nightshift_route_gc_pause_seconds_bucket{{generation="0",le="0.001"}} {short0 - 1}.0\n'
                f'nightshift_route_gc_pause_seconds_bucket{{generation="0",le="0.002"}} {short0}.0\n'
                f'nightshift_route_gc_pause_seconds_count{{generation="0"}} {n0}.0\n'
                f'nightshift_route_gc_pause_seconds_sum{{generation="0"}} {s0}\n'
                'nightshift_route_gc_pause_seconds_count{generation="2"} 1.0\n'
                'nightshift_route_gc_pause_seconds_sum{generation="2"} 0.0167\n'
                'nightshift_route_gc_pause_seconds_bucket{generation="2",le="0.002"} 0.0\n')
    assert route.gc_pauses(text(10, 0.004, 9)) == {0: [10.0, 0.004, 1.0], 2: [1.0, 0.0167, 1.0]}
    assert route.gc_pauses("nightshift_route_requests_total 3.0\n") == {}  # a proxy from before route8

    run = route.Measured([(0.010, 0.5)] * 10, 1.0, [route.Proxied(
        "proxied", [(0.011, 0.5, False)] * 10, secs=1.0, cpu=0.01, gc={0: [12.0, 0.0361, 3.0], 1: [1.0, 0.0101, 1.0]})])
    args = argparse.Namespace(streams=10, requests=1, rounds=1, chunks=20, pace=0.025, prompt=None, baseline=None)
    assert ("  proxy collector passes in its phases: 13, 46.2 ms in all (gen0 12 / 36.1 ms, gen1 1 / 10.1 ms), 4 of "
            "them over 2 ms: each stalls every stream in flight") in route.report(["title"], args, run)
