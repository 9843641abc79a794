"""The control API under /nightshift/: what the nightly job (or a person with
curl) calls to move traffic. Each change is checked, written to the state file
and fsync'd, then logged, and only then answered 200.

    GET    /nightshift/routes          {"routes": [...], "missing": {version: seconds left}, "upstream": url,
                                        "prompts": {"prompt:<match>": {"matched", "rewritten", "skipped", "changed"}}}
    GET    /nightshift/routes/<name>   {"route": {...}}                       404 when absent
    PUT    /nightshift/routes/<name>   {"serving", "candidate", "share"}  ->  {"route": {...}, "previous": {...}|null}
    DELETE /nightshift/routes/<name>   {"deleted": {...}}                     404 when absent

A prompt route is named `prompt:<match>`, the 12-hex system id of the agent's prompt
(`nightshift prompts`' system_hash), and PUT with {"kind": "prompt", "candidate":
<the candidate's system id>, "system": <its text, or list of texts>, "share": 0.1,
"agent": <a name for logs>, "model": <the model the agent asks for: how a changed
prompt is noticed>, "match_system": <the agent's prompt as a template, needed when
it has alignment slots {{var}}>}; the text is checked against its id. Its route
reads back as {"name", "kind": "prompt", "match", "agent", "model",
"match_system", "candidate", "system", "share", "updated"}; "matched"/"rewritten"
count requests since the proxy started, "changed" is a prompt id the agent's
model was asked with after the route matched (the agent changed its prompt).

Guarded by `Authorization: Bearer <admin_token>` when one is set (401 otherwise),
and open only to requests addressed to this proxy by a name it answers to (403
otherwise): its listen host, a loopback name, an IP address, or one of
`route.allowed_hosts`. A page in a browser can otherwise reach a proxy on
127.0.0.1 by DNS rebinding (its own name, re-pointed at 127.0.0.1, in the Host
header) and move traffic when no token is set; a request with a browser's
cross-origin marks (an `Origin` other than the proxy's own, `Sec-Fetch-Site:
cross-site`) is refused the same way. Bad input is a 400 whose message names
every problem.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from dataclasses import asdict
from urllib.parse import urlsplit

from aiohttp import web

from .metrics import Metrics
from .prompt import Seen
from .proxy import Proxy, error
from .table import TableError, parse

log = logging.getLogger("nightshift.route")

PREFIX = "/nightshift/routes"


def _json(obj, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj, indent=1).encode() + b"\n", content_type="application/json")


def host_name(host: str) -> str:
    """The name in a Host header's value (`[::1]:8100` -> `::1`), lower case, without
    a trailing dot ("" when there is none to read)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else ""
    name, _, port = host.rpartition(":") if host.count(":") == 1 else (host, "", "")
    return (name if port.isdigit() or not port else host).rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Control:
    def __init__(self, proxy: Proxy, metrics: Metrics, token: str, listen_host: str = "127.0.0.1",
                 allowed_hosts: list[str] | tuple[str, ...] = ()) -> None:
        self.proxy, self.table, self.metrics = proxy, proxy.table, metrics
        self.expected = f"Bearer {token}".encode() if token else b""
        self.names = {"localhost", host_name(listen_host)} | {host_name(h) for h in allowed_hosts}
        self.any_name = "*" in allowed_hosts
        for name, r in self.table.routes.items():
            self._gauge(name, None, r)

    def _foreign(self, request: web.BaseRequest) -> str:
        """Why a request is not for this proxy's control API ("" when it is): a Host
        by a name it does not answer to, or a browser's cross-origin request."""
        raw = [v for k, v in request.raw_headers if k.lower() == b"host"]
        try:
            host = raw[0].decode("ascii") if raw else ""
        except UnicodeDecodeError:
            return "the Host header is not ASCII"
        name = host_name(host)
        if host and not (self.any_name or name in self.names or _is_ip(name)):
            return (f"the Host {host[:100]!r} is not a name this proxy answers its control API to (a loopback name, "
                    "an IP address, its listen host, or route.allowed_hosts)")
        origin = request.headers.get("Origin")
        if origin is not None:
            o = urlsplit(origin.strip())
            if origin.strip() == "null" or o.netloc.lower() != host.strip().lower():
                return f"a browser's cross-origin request (Origin {origin[:100]!r})"
        if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
            return "a browser's cross-site request (Sec-Fetch-Site: cross-site)"
        return ""

    def _authorized(self, request: web.BaseRequest) -> bool:
        """The token, compared as the bytes that came (a header that is not UTF-8 is
        simply not the token), and only when it came once."""
        if not self.expected:
            return True
        given = [v for k, v in request.raw_headers if k.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0].strip(), self.expected)

    async def handle(self, request: web.BaseRequest, path: str) -> web.Response:
        foreign = self._foreign(request)
        if foreign:
            self.metrics.refused.labels("403").inc()
            log.warning("control API: refused %s %s: %s", request.method, path[:100], foreign)
            return error(403, "PermissionDeniedError", f"nightshift route: {foreign}")
        if not self._authorized(request):
            return error(401, "Unauthorized", "the control API needs `Authorization: Bearer <admin token>` "
                         "(route.admin_token)")
        if path in (PREFIX, PREFIX + "/"):
            if request.method != "GET":
                return error(405, "MethodNotAllowed", f"{request.method} {path}: use GET (or PUT/DELETE on "
                             f"{PREFIX}/<stable name>)")
            seen = self.proxy.prompts.seen
            return _json({"routes": self.table.public(), "missing": self.proxy.missing_now(),
                          "upstream": self.proxy.base,
                          "prompts": {f"prompt:{m}": asdict(seen.get(m) or Seen()) for m in sorted(self.table.prompts)}})
        if not path.startswith(PREFIX + "/"):
            return error(404, "NotFound", f"no such control path {path} (known: {PREFIX}, {PREFIX}/<stable name>)")
        name = path[len(PREFIX) + 1:]
        if request.method == "GET":
            r = self.table.entry(name)
            if r is None:
                return error(404, "NotFound", f"no route for {name!r}")
            extra = {"seen": asdict(self.proxy.prompts.seen.get(r.serving) or Seen())} if r.kind == "prompt" else {}
            return _json({"route": r.public(name), **extra})
        if request.method == "PUT":
            return await self._put(request, name)
        if request.method == "DELETE":
            return await self._delete(name)
        return error(405, "MethodNotAllowed", f"{request.method} {path}: use GET, PUT or DELETE")

    async def _put(self, request: web.BaseRequest, name: str) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return error(400, "BadRequestError", f"the body is not JSON ({e}); send {{\"serving\": \"agent@v0003\", "
                         "\"candidate\": \"agent@v0004\", \"share\": 0.1}")
        except RecursionError:
            return error(400, "BadRequestError", "the body nests JSON too deeply to be a route; send {\"serving\": "
                         "\"agent@v0003\", \"candidate\": \"agent@v0004\", \"share\": 0.1}")
        try:
            route = parse(name, body)
        except TableError as e:
            return error(400, "BadRequestError", f"route {name!r}: {e}")
        # a task of its own: a client that hangs up mid-change cannot leave it half done
        return await asyncio.shield(asyncio.ensure_future(self._change(name, route)))

    async def _change(self, name: str, route) -> web.Response:
        try:
            before = await asyncio.to_thread(self.table.put, name, route)
        except OSError as e:
            log.error("route %s: the change could not be written to %s (%s); nothing changed", name, self.table.path, e)
            return error(500, "InternalServerError", f"cannot write the route table {self.table.path}: {e}")
        self.proxy.forget_missing(route.serving, route.candidate)
        self._gauge(name, before, route)
        log.info("route %s: %s (was: %s)", name, route.describe(), before.describe() if before else "no route")
        return _json({"route": route.public(name), "previous": before.public(name) if before else None})

    async def _delete(self, name: str) -> web.Response:
        if self.table.entry(name) is None:
            return error(404, "NotFound", f"no route for {name!r}")
        return await asyncio.shield(asyncio.ensure_future(self._remove(name)))

    async def _remove(self, name: str) -> web.Response:
        try:
            before = await asyncio.to_thread(self.table.delete, name)
        except OSError as e:
            log.error("route %s: the deletion could not be written to %s (%s); nothing changed", name, self.table.path, e)
            return error(500, "InternalServerError", f"cannot write the route table {self.table.path}: {e}")
        if before is None:
            return error(404, "NotFound", f"no route for {name!r}")
        self._gauge(name, before, None)
        log.info("route %s: deleted (was: %s); requests for it now pass through untouched", name, before.describe())
        return _json({"deleted": before.public(name)})

    def _gauge(self, name: str, before, after) -> None:
        if before is not None and before.candidate and (after is None or after.candidate != before.candidate):
            self.metrics.share.labels(name, before.candidate).set(0)
        if after is not None and after.candidate:
            self.metrics.share.labels(name, after.candidate).set(after.share)
