"""A TCP proxy that misbehaves on command, put between the flusher and an object
store to make the store fail or hang mid-flush:

- `pass`: forwards both ways;
- `refuse`: resets every connection, new and open (a store that is down);
- `stall`: accepts and holds every connection, forwarding nothing (a store, or a
  network, that hangs: only timeouts get the client out);
- `reset`: forwards `reset_after` bytes of each upload, then resets it (a
  connection cut in the middle of a PUT).

Changing the mode applies to connections already open, as a real outage would.
"""

from __future__ import annotations

import socket
import struct
import threading


class ToxicProxy:
    def __init__(self, upstream_port: int, reset_after: int = 4096):
        self.upstream = ("127.0.0.1", upstream_port)
        self.mode = "pass"
        self.reset_after = reset_after
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def set(self, mode: str) -> None:
        assert mode in ("pass", "refuse", "stall", "reset")
        self.mode = mode
        if mode != "pass":
            with self._lock:
                victims = list(self._open) if mode == "refuse" else []
            for s in victims:
                _reset(s)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in list(self._open):
                _reset(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self.mode == "refuse":
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        with self._lock:
            self._open |= {client, upstream}
        sent = [0]
        threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()
        self._pump(client, upstream, sent)

    def _pump(self, src: socket.socket, dst: socket.socket, sent: list | None) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.mode == "stall" and not self._closed:
                    threading.Event().wait(0.05)  # hold: the bytes go nowhere until the mode changes
                if self.mode in ("refuse",):
                    break
                if self.mode == "reset" and sent is not None:
                    room = self.reset_after - sent[0]
                    if room <= 0:
                        break
                    data = data[:room]
                    sent[0] += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _reset(s)
            with self._lock:
                self._open -= {src, dst}


def _reset(s: socket.socket) -> None:
    """Close with RST, not FIN: the peer sees `connection reset`, as when a store dies."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
