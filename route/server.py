"""Running the proxy: the route table read back, the listener, the one handler
that sends each path where it belongs, and a SIGTERM that stops taking requests
and lets the ones in flight finish (up to `drain_timeout`; streams still open
then are cut off, so their clients see an error, never a short answer)."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import signal

from aiohttp import web

from .config import RouteConfig
from .control import Control
from .metrics import Metrics
from .proxy import Proxy
from .table import RouteTable, TableError

log = logging.getLogger("nightshift.route")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class App:
    """The proxy's parts, wired: `handle` is the one request handler."""

    def __init__(self, cfg: RouteConfig, table: RouteTable) -> None:
        self.metrics = Metrics()
        self.proxy = Proxy(cfg, table, self.metrics)
        self.control = Control(self.proxy, self.metrics, cfg.admin_token)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith("/nightshift/"):
            return await self.control.handle(request)
        if path == "/healthz":
            return web.Response(body=json.dumps({"status": "ok", "routes": len(self.proxy.table.routes),
                                                 "upstream": self.proxy.base}).encode(), content_type="application/json")
        if path == "/metrics":
            return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})
        return await self.proxy.forward(request)


async def serve(cfg: RouteConfig, table: RouteTable, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT when none is given)."""
    host, port = cfg.host_port()
    app = App(cfg, table)
    server = web.Server(app.handle, handler_cancellation=True, access_log=None)
    runner = web.ServerRunner(server, shutdown_timeout=cfg.drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if not _loopback(host) and not cfg.admin_token:
        log.warning("listening on non-loopback %s WITHOUT an admin token: anyone who can reach it can move traffic "
                    "between versions. Set NIGHTSHIFT_ROUTE_ADMIN_TOKEN or route.admin_token.", cfg.listen)
    routes = "; ".join(f"{n}: {r.describe()}" for n, r in sorted(table.routes.items())) or "none yet"
    log.warning("routing proxy on http://%s:%d/v1 in front of %s (agents: OPENAI_BASE_URL=http://%s:%d/v1); "
                "routes (%s): %s", host, port, app.proxy.base, host, port, table.path, routes)
    # What start-up built lives as long as the process: out of the collector's sight, so
    # that a full collection (20 ms measured mid-load) does not land on a request.
    gc.collect()
    gc.freeze()
    if ready is not None:
        ready.set()
    await stop.wait()
    log.warning("stopping: no new requests; %d in flight get up to %g s", len(server.connections), cfg.drain_timeout)
    await runner.cleanup()
    await app.proxy.close()


def run(cfg: RouteConfig) -> int:
    """`nightshift route`: 0 after a clean stop, 2 when the table cannot be read."""
    try:
        table = RouteTable(cfg.state_path()).load()
    except TableError as e:
        log.error("%s", e)
        return 2
    asyncio.run(serve(cfg, table))
    return 0
