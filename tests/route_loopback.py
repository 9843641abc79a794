"""A route proxy on loopback in front of a hand-written upstream protocol, for the
route tests that need to control the upstream's bytes one send at a time (what a
stand-in server cannot: a keep-alive close under a request, a first event held)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from nightshift.route.config import RouteConfig
from nightshift.route.server import serve
from nightshift.route.table import RouteTable
from hardening.proc import free_port


@contextlib.asynccontextmanager
async def proxy_before(protocol, tmp_path, **settings) -> AsyncIterator[int]:
    """The proxy's port, `protocol` serving as its upstream; both stopped on exit.
    `settings`: RouteConfig fields a test sets (e.g. a short read_timeout)."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol, "127.0.0.1", 0)
    listen = free_port()
    cfg = RouteConfig(listen=f"127.0.0.1:{listen}", upstream=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                      state=str(tmp_path / "routes.json"), **{"drain_timeout": 2.0, **settings})
    ready, stop = asyncio.Event(), asyncio.Event()
    task = loop.create_task(serve(cfg, RouteTable(tmp_path / "routes.json").load(), ready, stop))
    await ready.wait()
    try:
        yield listen
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        server.close()
