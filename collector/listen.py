"""Where the receivers listen, and the one sentence said when they cannot.

A receiver that cannot bind (a port another collector holds, an address this
machine does not have) must stop the start-up before anything else runs, with
one line an operator can act on, not a socket library's traceback followed by
the flusher's. gRPC binds inside its C core and says only "Failed to bind", so
its address is tried with a plain socket first, which gives the reason.
"""

from __future__ import annotations

import errno
import socket

from nightshift.settings import split_address


class CannotListen(Exception):
    """A receiver's address cannot be listened on, and why, in words."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address, self.reason = address, reason


def host_port(address: str) -> tuple[str, int]:
    """(host, port) of a checked HOST:PORT (`settings.split_address`), the host
    without IPv6 brackets."""
    try:
        return split_address(address)
    except ValueError as e:
        raise CannotListen(address, str(e)) from None


def why(address: str, e: OSError) -> str:
    """Why `address` could not be bound, in words."""
    port = host_port(address)[1]
    if isinstance(e, socket.gaierror):
        reason = f"unknown host ({e.strerror})"
    elif e.errno == errno.EADDRINUSE:
        reason = "address already in use (another collector?)"
    elif e.errno == errno.EADDRNOTAVAIL:
        reason = "no interface of this machine has that address"
    elif e.errno == errno.EACCES:
        reason = "permission denied" + (" (ports below 1024 need privileges)" if port < 1024 else "")
    else:
        reason = (e.strerror or str(e)).lower()
    return reason


def try_bind(address: str) -> None:
    """Binds and releases `address` as a server would (SO_REUSEADDR, every address
    the host resolves to, one success enough); CannotListen with the reason if no
    address can be bound."""
    host, port = host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CannotListen(address, why(address, e)) from None
    first: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
                return
            except OSError as e:
                first = first or e
    raise CannotListen(address, why(address, first or OSError(errno.EADDRNOTAVAIL, "no address")))
