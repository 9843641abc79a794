"""The routing proxy's settings (YAML section `route:`, `NIGHTSHIFT_ROUTE_*`, the
flags of `nightshift route`), declared once: loopback, in front of a vLLM on the
same machine, nothing to configure for a first try."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from nightshift.settings import SettingsError, setting

_ADDRESS = re.compile(r"\[?([0-9A-Za-z.:-]*?)\]?:([0-9]{1,5})")


@dataclass
class RouteConfig:
    """`nightshift route`: an OpenAI-compatible proxy in front of vLLM that sends each
    conversation asking for a stable name to its serving or candidate version."""

    data: str = setting("./nightshift-data", help="dataset root; the route table lives under it unless --state says "
                                                  "where", metavar="DIR")
    listen: str = setting("127.0.0.1:8100", help="where the agents reach the proxy (their OPENAI_BASE_URL is "
                                                 "http://HOST:PORT/v1)", metavar="HOST:PORT")
    upstream: str = setting("http://127.0.0.1:8000", help="the vLLM server (or `nightshift serve`) behind it",
                            metavar="URL")
    state: str = setting("", help="the route table's file, rewritten atomically on every change and read at start "
                                  "(default <data>/route/routes.json)", metavar="FILE")
    admin_token: str = setting("", help="require `Authorization: Bearer TOKEN` on the control API (/nightshift/*)",
                               metavar="TOKEN")
    upstream_api_key: str = setting("", help="send `Authorization: Bearer KEY` to the upstream in place of the "
                                             "client's (default: the client's Authorization goes through unchanged)",
                                    metavar="KEY")
    connect_timeout: float = setting(5.0, help="seconds to connect to the upstream (then 502)", metavar="DURATION")
    read_timeout: float = setting(600.0, help="longest silence from the upstream inside one response (then the "
                                              "response is cut off as broken)", metavar="DURATION")
    missing_ttl: float = setting(30.0, help="how long a version the upstream said it does not have is skipped "
                                            "without asking again", metavar="DURATION")
    max_body_bytes: int = setting(64 << 20, help="largest request body (413 beyond)", metavar="SIZE")
    drain_timeout: float = setting(30.0, help="on SIGTERM, how long responses in flight may take to finish",
                                   metavar="DURATION")
    log_decisions: bool = setting(True, help="one log line per routing decision")
    log_level: str = setting("info", help="debug, info, warning, error", metavar="LEVEL")

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

    def check(self) -> None:
        """Every value usable, or a SettingsError naming the setting."""
        self.host_port()
        if not re.fullmatch(r"https?://[^/\s]+/?", self.upstream):
            raise SettingsError(f"route.upstream: {self.upstream!r} is not http(s)://HOST:PORT")
        for name in ("connect_timeout", "read_timeout", "drain_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise SettingsError(f"route.{name} must be a positive duration, got {v!r}")
        if not (math.isfinite(self.missing_ttl) and self.missing_ttl >= 0):
            raise SettingsError(f"route.missing_ttl must be a duration >= 0, got {self.missing_ttl!r}")
        if self.max_body_bytes < 1:
            raise SettingsError(f"route.max_body_bytes must be at least 1, got {self.max_body_bytes}")
        self.state_path()
