"""The routing proxy's settings (YAML section `route:`, `NIGHTSHIFT_ROUTE_*`, the
flags of `nightshift route`), declared once: loopback, in front of a vLLM on the
same machine, nothing to configure for a first try."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from nightshift.settings import SettingsError, invalid, listen_address, setting, validate

_ADDRESS = re.compile(r"\[?([0-9A-Za-z.:-]*?)\]?:([0-9]{1,5})")


@dataclass
class RouteConfig:
    """`nightshift route`: an OpenAI-compatible proxy in front of vLLM that sends each
    conversation asking for a stable name to its serving or candidate version."""

    data: str = setting("./nightshift-data", help="dataset root; the route table lives under it unless --state says "
                                                  "where", metavar="DIR")
    listen: str = setting("127.0.0.1:8100", help="where the agents reach the proxy (their OPENAI_BASE_URL is "
                                                 "http://HOST:PORT/v1)", metavar="HOST:PORT", check=listen_address)
    upstream: str = setting("http://127.0.0.1:8000", help="the vLLM server (or `nightshift serve`) behind it",
                            metavar="http(s)://HOST:PORT", pattern=r"https?://[^/\s]+/?")
    state: str = setting("", help="the route table's file, rewritten atomically on every change and read at start "
                                  "(default <data>/route/routes.json)", metavar="FILE")
    admin_token: str = setting("", help="require `Authorization: Bearer TOKEN` on the control API (/nightshift/*)",
                               metavar="TOKEN")
    upstream_api_key: str = setting("", help="send `Authorization: Bearer KEY` to the upstream in place of the "
                                             "client's (default: the client's Authorization goes through unchanged)",
                                    metavar="KEY", pattern=r"[\x21-\x7e]+")
    upstream_ca_file: str = setting("", help="PEM file of the CA(s) an https upstream's certificate is checked "
                                             "against (default: the system's)", metavar="FILE")
    allowed_hosts: list[str] = setting(factory=list, help="more names the control API answers to in the Host header "
                                                          "(besides loopback names, IP addresses and the listen host; "
                                                          "* for any, when an admin token guards it), e.g. "
                                                          "nightshift-route", metavar="NAME,...")
    connect_timeout: float = setting(5.0, help="seconds to connect to the upstream (then 502)", metavar="DURATION",
                                     bounds="(0, inf)")
    read_timeout: float = setting(600.0, help="longest silence from the upstream inside one response (then the "
                                              "response is cut off as broken)", metavar="DURATION", bounds="(0, inf)")
    missing_ttl: float = setting(30.0, help="how long a version the upstream said it does not have is skipped "
                                            "without asking again", metavar="DURATION", bounds="[0, inf)")
    max_body_bytes: int = setting(64 << 20, help="largest request body (413 beyond)", metavar="SIZE",
                                  bounds="[1, inf)")
    drain_timeout: float = setting(30.0, help="on SIGTERM, how long responses in flight may take to finish",
                                   metavar="DURATION", bounds="(0, inf)")
    loop: str = setting("auto", help="the event loop: uvloop (its transports in C: less CPU per request and per "
                                     "streamed event), asyncio, or auto (uvloop when installed)",
                        choices=("auto", "uvloop", "asyncio"))
    log_decisions: bool = setting(True, help="one DEBUG log line per routing decision (with log_level debug; "
                                             "nightshift_route_decisions counts them at any level)")
    log_level: str = setting("info", help="debug, info, warning, error", metavar="LEVEL",
                             pattern=r"(?i)debug|info|warning|error|critical")

    def host_port(self) -> tuple[str, int]:
        m = _ADDRESS.fullmatch(self.listen.strip())
        if not m:
            raise SettingsError(f"route.listen: {self.listen!r} is not HOST:PORT")
        return m.group(1) or "0.0.0.0", int(m.group(2))

    def state_path(self) -> Path:
        if self.state:
            return Path(self.state)
        if "://" in self.data:
            raise SettingsError(f"route.state: the data root {self.data} is not a local folder; give --state FILE "
                                "for the route table (it is small, local and fsync'd)")
        return Path(self.data) / "route" / "routes.json"

    def rules(self) -> None:
        if not self.state and "://" in self.data:
            raise invalid("data", "not a local folder, and the route table must be: give --state FILE (it is "
                                  "small, local and fsync'd)")
        try:
            port = urlsplit(self.upstream).port
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise invalid("upstream", f"{self.upstream!r}: the port must be in 1..65535")
        if self.upstream_ca_file and not self.upstream.startswith("https://"):
            raise invalid("upstream_ca_file", f"set, but the upstream {self.upstream} is not https://")
        if "*" in self.allowed_hosts and not self.admin_token:
            raise invalid("allowed_hosts", "* lets any page a browser opens reach the control API by DNS "
                                           "rebinding: set route.admin_token too, or list the names")

    def check(self) -> None:
        """Every value usable, or a SettingsError naming the setting (`load` runs it too)."""
        validate(self, "route")
