"""The interpreter's collector, run by the proxy where it costs least.

A collector pass stalls every stream in flight for as long as it walks what the
streams hold (~90 tracked objects a stream: coroutines, futures, transports,
headers; 200 streams ~18k objects), and the interpreter starts one every 700 net
allocations: per benchmark run (4,800 streamed requests at 200 streams) ~57 passes
in the proxied phases, 4-7 of them over 2 ms (gen1 2.4-4.2 ms each), each felt by
every stream at once (issue 27's p99). Yet a streamed request on a kept-alive
connection makes no cyclic garbage (route8, `gc.DEBUG_SAVEALL`): reference counting
frees it all, and those passes found nothing.

So while the proxy serves, the automatic collector is off and `IdleCollector`
takes full passes itself:

- when the last request in flight ends (nothing waits on it: the pass walks what
  the kept-alive connections hold, ~1 ms at 200 of them), at most every `min_gap`
  seconds (a proxy serving one request at a time is idle after each);
- with requests in flight all along, after `max_gap` seconds of serving since the
  last pass, and at the next `tick` once the tracked objects grew by `max_growth`
  (the interpreter's count of net allocations, never below the true growth): a
  proxy that is never idle still collects, one pass in `max_gap` seconds instead
  of several a second.

Why this cannot leak: what only a pass reclaims is cyclic garbage, and the error
paths make it (with the collector off, per request on a connection of its own: an
upstream unreachable ~47 objects, a malformed request ~29, a client gone
mid-stream ~28, a stream the upstream cuts or an upstream silent past
read_timeout ~27; a closed connection's 7 included), none of it holding the
request's body since route9 (`Proxy._failed`, `Connection.connection_lost`). A
pass comes before `max_gap` seconds of serving pass and before the tracked objects
grow by `max_growth`, so what waits for one is bounded by both
(tests/test_route_gc_idle.py sends errors of each kind and finds none left after
the proxy's idle pass). Everything else is freed by reference counting as before,
the moment it is let go.

The collector is the process's: `nightshift route` runs in a process of its own;
a process that runs `serve` beside other work (the tests) has it off meanwhile too,
and back as it was once the last proxy in it stops (`hold`, `release`).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable

_holders = [0, True]  # proxies serving in this process, and whether the collector was on before the first


def hold() -> None:
    """The automatic collector off, for as long as one proxy in this process serves."""
    if _holders[0] == 0:
        _holders[1] = gc.isenabled()
        gc.disable()
    _holders[0] += 1


def release() -> None:
    """The collector as it was before the first `hold`, once the last proxy stops."""
    _holders[0] -= 1
    if _holders[0] == 0 and _holders[1]:
        gc.enable()


class IdleCollector:
    """Full collector passes when the proxy has no request in flight, and bounded
    ones when it never has none (see the module's docstring). `begin`/`end` bracket
    every proxied request; `counted(why)` hears of each pass the proxy takes (idle,
    gap, growth). Inert until `start` (a `Proxy` built outside `serve` collects as
    the interpreter does)."""

    min_gap = 1.0  # seconds: idle passes at most this often (a proxy serving one request at a time)
    # seconds of serving after which a pass comes, requests in flight or not: at 200 streams a 4-6 ms stall
    # (measured); what waits for it is bounded by max_growth too (3-10 KB a failed request, measured: no
    # request body since route9), so it only says how long a cycle may wait; a longer one stalls less often
    max_gap = 30.0
    # net new tracked objects after which a pass comes (2,000-3,700 failed requests' cycles; 200 streams in flight
    # hold ~17,600, and at a steady load the count stays there: the streams that end free what new ones take)
    max_growth = 100_000
    tick = 0.5  # seconds between checks of the two bounds

    def __init__(self, counted: Callable[[str], None] = lambda why: None) -> None:
        self.counted = counted
        self.busy = 0  # proxied requests in flight
        self.last = time.monotonic()  # when the last pass ended
        self.since: float | None = None  # when the first request since then came: garbage is made while serving
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queued = False

    def start(self) -> None:
        """The automatic collector off and the bound's timer on, in the running loop."""
        self._loop = asyncio.get_running_loop()
        hold()
        self.last = time.monotonic()
        self._timer = self._loop.call_later(self.tick, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._loop is not None:
            self._loop = None
            release()

    def begin(self) -> None:
        self.busy += 1
        if self.since is None:
            self.since = time.monotonic()

    def end(self) -> None:
        self.busy -= 1
        if self.busy == 0 and not self._queued and self._loop is not None and time.monotonic() - self.last >= self.min_gap:
            self._queued = True  # after the handler's return: an answer it returns is sent first
            self._loop.call_soon(self._idle)

    def _idle(self) -> None:
        self._queued = False
        if self.busy == 0 and self._loop is not None:  # a request that came meanwhile: its end will ask again
            self.collect("idle")

    def _check(self) -> None:
        if self._loop is None:
            return
        now = time.monotonic()
        if self.since is not None and self.busy == 0 and now - self.last >= self.min_gap:
            self.collect("idle")  # a lull that began too soon after the last pass for `end` to take it
        elif self.since is not None and now - self.since >= self.max_gap:
            self.collect("gap")
        elif gc.get_count()[0] >= self.max_growth:  # >= the tracked objects' net growth since the last pass
            self.collect("growth")
        self._timer = self._loop.call_later(self.tick, self._check)

    def collect(self, why: str) -> None:
        gc.collect()
        self.last, self.since = time.monotonic(), None if self.busy == 0 else time.monotonic()
        self.counted(why)
