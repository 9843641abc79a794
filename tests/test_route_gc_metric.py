"""The proxy's collector passes are timed into /metrics (nightshift_route_gc_pause_seconds,
by generation): each pass stalls every stream in flight, the kind of stall the
route's p99 target is missed by, and the route benchmark prints them per phase.
The watcher goes when the proxy stops, so a process that ran one leaves no
callback behind."""

from __future__ import annotations

import asyncio
import gc
import re
import urllib.request

from nightshift.route.config import RouteConfig
from nightshift.route.metrics import Metrics
from nightshift.route.server import serve
from nightshift.route.table import RouteTable
from hardening.proc import free_port


def _count(text: str, generation: int) -> float:
    m = re.search(r'nightshift_route_gc_pause_seconds_count\{generation="%d"\} (\S+)' % generation, text)
    return float(m.group(1)) if m else -1.0


def test_each_collector_pass_is_timed_by_generation():
    m = Metrics()
    watch = m.gc_watcher()
    watch("start", {"generation": 1})
    watch("stop", {"generation": 1, "collected": 0, "uncollectable": 0})
    text = m.render().decode()
    assert _count(text, 1) == 1.0 and _count(text, 0) == 0.0 and _count(text, 2) == 0.0


def test_a_running_proxy_serves_its_collector_passes_and_stops_watching(tmp_path):
    before = list(gc.callbacks)

    async def go() -> tuple[str, str]:
        listen = free_port()
        cfg = RouteConfig(listen=f"127.0.0.1:{listen}", upstream="http://127.0.0.1:9",
                          state=str(tmp_path / "routes.json"), drain_timeout=1.0)
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.get_running_loop().create_task(serve(cfg, RouteTable(tmp_path / "routes.json").load(), ready,
                                                            stop))
        await ready.wait()
        url = f"http://127.0.0.1:{listen}/metrics"
        first = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
        gc.collect()  # a full pass, timed as generation 2
        second = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
        stop.set()
        await asyncio.wait_for(task, 10)
        return first, second

    first, second = asyncio.run(go())
    assert _count(second, 2) == _count(first, 2) + 1
    assert gc.callbacks == before
