"""Running the proxy: the route table read back, the listener, the one handler
that sends each path where it belongs, and a SIGTERM that stops taking requests
and lets the ones in flight finish (up to `drain_timeout`; streams still open
then are cut off, so their clients see an error, never a short answer).

Start-up that cannot go on (the address taken or not this machine's, the route
table unreadable, the upstream's CA file unreadable) is one sentence and exit 2,
never a traceback: whoever started it reads what to change."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import json
import logging
import re
import signal
import ssl
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from nightshift.settings import SettingsError

from .config import RouteConfig
from .control import Control
from .metrics import Metrics
from .paths import PathError, parse
from .proxy import Proxy, error
from .table import RouteTable, TableError

log = logging.getLogger("nightshift.route")


class StartupError(RuntimeError):
    """The proxy cannot start; the message says why, in one sentence."""


_QUOTED = re.compile(r"""\s*:?\s*b?(['"]).*""", re.DOTALL)
_HEADER = re.compile(r"""b?['"]([A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}):""")


def why_malformed(message: str) -> str:
    """aiohttp's reason for refusing a request, without the bytes it quotes: they are
    the client's (an agent's `Authorization: Bearer sk-...` with a stray control
    character was written to the log whole); the header's name is kept."""
    text = " ".join(str(message).split())
    m = _QUOTED.search(text)
    if m is None:
        return text[:200]
    name = _HEADER.match(text[m.start():].lstrip(": "))
    return text[:m.start()][:200] + (f" (in the {name.group(1)} header; what was sent is not logged)" if name
                                     else " (what was sent is not logged)")


class _ClientErrorsInOneLine(logging.Filter):
    """aiohttp logs a malformed request (a bad request line, a header too long, a
    path that is not UTF-8) with a traceback at ERROR, though it is the client's
    error and already answered 400: one line at INFO says it, and a traceback in
    the log stays the sign of a bug in the proxy. The line says why, never what the
    client sent (`why_malformed`): that may be its credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and (exc.code or 400) < 500:
            record.msg, record.args = "refused a malformed request from %s: %s", (
                record.args[0] if isinstance(record.args, tuple) and record.args else "?",
                why_malformed(exc.message))
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return record.levelno >= logging.getLogger().getEffectiveLevel()


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
        self.control = Control(self.proxy, self.metrics, cfg.admin_token, cfg.host_port()[0], cfg.allowed_hosts)

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            target = parse(request.raw_path)
        except PathError as e:
            self.metrics.refused.labels("400").inc()
            return error(400, "BadRequestError", f"nightshift route: {e}")
        path = target.path
        if path == "/nightshift" or path.startswith("/nightshift/"):
            return await self.control.handle(request, path)
        if path == "/healthz":
            return web.Response(body=json.dumps({"status": "ok", "routes": len(self.proxy.table.routes),
                                                 "upstream": self.proxy.base}).encode(), content_type="application/json")
        if path == "/metrics":
            return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})
        return await self.proxy.forward(request, target)


async def serve(cfg: RouteConfig, table: RouteTable, ready: asyncio.Event | None = None,
                stop: asyncio.Event | None = None, loop_name: str = "asyncio") -> None:
    """Serve until `stop` is set (or SIGTERM/SIGINT when none is given)."""
    host, port = cfg.host_port()
    try:
        app = App(cfg, table)
    except (OSError, ssl.SSLError) as e:
        raise StartupError(f"cannot read the upstream's CA file {cfg.upstream_ca_file} (route.upstream_ca_file): "
                           f"{getattr(e, 'strerror', None) or e}") from None
    logging.getLogger("aiohttp.server").addFilter(_ClientErrorsInOneLine())
    # auto_decompress off: a compressed upload is refused (headers.py), never inflated unasked
    server = web.Server(app.handle, handler_cancellation=True, access_log=None, auto_decompress=False)
    runner = web.ServerRunner(server, shutdown_timeout=cfg.drain_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    try:
        await site.start()
    except (OSError, OverflowError) as e:
        await runner.cleanup()
        await app.proxy.close()
        why = getattr(e, "strerror", None) or str(e)
        raise StartupError(f"cannot listen on {cfg.listen} (route.listen): {why}") from None
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if not _loopback(host) and not cfg.admin_token:
        log.warning("listening on non-loopback %s WITHOUT an admin token: anyone who can reach it can move traffic "
                    "between versions. Set NIGHTSHIFT_ROUTE_ADMIN_TOKEN or route.admin_token.", cfg.listen)
    routes = "; ".join(f"{n}: {r.describe()}" for n, r in sorted(table.routes.items())) or "none yet"
    log.warning("routing proxy on http://%s:%d/v1 in front of %s (agents: OPENAI_BASE_URL=http://%s:%d/v1; "
                "event loop: %s); routes (%s): %s", host, port, app.proxy.base, host, port, loop_name, table.path,
                routes)
    # What start-up built lives as long as the process: out of the collector's sight, so
    # that a full collection (20 ms measured mid-load) does not land on a request.
    gc.collect()
    gc.freeze()
    watch = app.metrics.gc_watcher(lambda: app.proxy.gc.busy)
    gc.callbacks.append(watch)
    app.proxy.gc.start()  # and from here on no automatic pass: the proxy takes them when idle (gcidle.py)
    try:
        if ready is not None:
            ready.set()
        await stop.wait()
        log.warning("stopping: no new requests; %d in flight get up to %g s", len(server.connections),
                    cfg.drain_timeout)
        await runner.cleanup()
        await app.proxy.close()
    finally:
        app.proxy.gc.stop()
        gc.callbacks.remove(watch)


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """The event loop `route.loop` asks for, and its name for the start-up line.
    uvloop where it can be had: its transports read, write and call back in C, which
    is most of what the proxy does per streamed event. `auto` without uvloop installed
    is asyncio's own loop (it is an optional speed-up, not a requirement)."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise StartupError("route.loop is uvloop but uvloop is not installed (pip install uvloop, or "
                                   "route.loop auto)") from None
        else:
            return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"
    return asyncio.new_event_loop, "asyncio"


def run(cfg: RouteConfig) -> int:
    """`nightshift route`: 0 after a clean stop, 2 when it cannot start."""
    try:
        table = RouteTable(cfg.state_path()).load()
        factory, name = loop_factory(cfg.loop)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(cfg, table, loop_name=name))
    except (TableError, StartupError, SettingsError) as e:
        log.error("%s", e)
        return 2
    return 0
