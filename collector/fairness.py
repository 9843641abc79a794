"""Per-client limits, so that one noisy agent cannot starve the others.

A collector shared by several agents (a gateway, a node-level daemon) has two
things a single client can take from everybody: request slots (`max_inflight`,
shared) and write bandwidth into the log. Each client, identified by its peer
address, gets at most `max_inflight` requests at once and, when `bytes_per_s`
is set, a token bucket of payload bytes. Past either, the request is refused
with `Throttled` (HTTP 429 + Retry-After, gRPC RESOURCE_EXHAUSTED + RetryInfo),
which every OTLP exporter retries; the other clients never notice.

The bucket may go into debt: a request is admitted while the client's balance
is not negative and charged its real size afterwards (known only once the body
is decompressed), so one large request is never refused for being larger than
the burst, and the debt is what sets the next Retry-After.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .errors import Throttled

#: Idle clients are forgotten once more than this many are known, so a scan from
#: many addresses cannot grow the table without bound.
MAX_CLIENTS = 4096


@dataclass
class _Client:
    inflight: int = 0
    balance: float = 0.0  # bytes; negative = in debt
    stamp: float = field(default_factory=time.monotonic)


class ClientLimits:
    """`max_inflight` <= 0 or `bytes_per_s` <= 0 turns that limit off."""

    def __init__(self, max_inflight: int, bytes_per_s: float = 0.0, burst_bytes: float = 64 << 20):
        self.max_inflight = max_inflight
        self.rate = bytes_per_s
        self.burst = max(burst_bytes, 1.0)
        self._clients: dict[str, _Client] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_inflight > 0 or self.rate > 0

    def _refill(self, c: _Client, now: float) -> None:
        if self.rate > 0:
            c.balance = min(self.burst, c.balance + (now - c.stamp) * self.rate)
        c.stamp = now

    def acquire(self, client: str) -> None:
        """Takes one of the client's slots, or raises Throttled at once."""
        if not self.enabled:
            return
        now = time.monotonic()
        with self._lock:
            c = self._clients.get(client)
            if c is None:
                if len(self._clients) >= MAX_CLIENTS:
                    self._forget_idle(now)
                c = self._clients[client] = _Client(balance=self.burst, stamp=now)
            self._refill(c, now)
            if self.max_inflight > 0 and c.inflight >= self.max_inflight:
                raise Throttled(f"client {client} has {c.inflight} requests in flight, its limit; retry later",
                                retry_after=1.0)
            if self.rate > 0 and c.balance < 0:
                raise Throttled(f"client {client} is over its {self.rate:.0f} bytes/s write rate; retry later",
                                retry_after=min(30.0, max(1.0, -c.balance / self.rate)))
            c.inflight += 1

    def charge(self, client: str, nbytes: int) -> None:
        """Bills a request's payload bytes to its client's bucket."""
        if self.rate <= 0:
            return
        with self._lock:
            c = self._clients.get(client)
            if c is not None:
                c.balance -= nbytes

    def release(self, client: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            c = self._clients.get(client)
            if c is not None:
                c.inflight = max(0, c.inflight - 1)

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, c in self._clients.items() if c.inflight == 0]:
            c = self._clients[key]
            self._refill(c, now)
            if c.balance >= self.burst or self.rate <= 0:
                del self._clients[key]


def peer_host(peer: str) -> str:
    """The client part of a gRPC peer string, port removed:
    `ipv4:10.0.0.7:51234` -> `10.0.0.7`, `ipv6:%5B::1%5D:51234` -> `::1`."""
    from urllib.parse import unquote

    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    host = unquote(rest).rpartition(":")[0] or unquote(rest)
    return host.strip("[]")
