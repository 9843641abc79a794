"""The wire campaign: fuzz cases and malformed HTTP framing sent to a real
`nightshift collect` process over loopback sockets (HTTP/1.1 through
`http.client` and raw sockets, gRPC through a real channel). Afterwards the
collector must still be healthy, every acknowledged record must reach Parquet
(stored, or found a duplicate of a stored one), and SIGTERM must drain it to
exit 0."""

from __future__ import annotations

import http.client
import random
import select
import socket
import tempfile
import time
from pathlib import Path

import cases as C
from proc import Collector, counted, drained, stored_rows

STALL_S = 1.0  # the collector's request_timeout in this campaign


def _framing(rng: random.Random, port: int) -> tuple[str, frozenset[int] | None, bytes]:
    """One malformed HTTP exchange on a raw socket: (name, allowed codes, bytes sent)."""
    body = C.trace_request(rng, spans=2).SerializeToString()
    head = f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: {C.PB}\r\n"
    what = rng.randrange(9)
    if what == 0:  # http.server answers a request line it cannot read HTTP/0.9-style: no status line
        return "bad-request-line", frozenset({400, None}), rng.choice([b"GARBAGE\r\n\r\n", b"POST\r\n\r\n", b"\x16\x03\x01\x02\x00\r\n\r\n"])
    if what == 1:
        return "long-header", frozenset({400, 431}), (head + "X-Long: " + "a" * 70000 + "\r\n\r\n").encode()
    if what == 2:
        return "many-headers", frozenset({431}), (head + "".join(f"X-{i}: v\r\n" for i in range(150)) + "\r\n").encode()
    if what == 3:
        return "negative-length", frozenset({400}), (head + "Content-Length: -5\r\n\r\n").encode() + body
    if what == 4:
        return "bad-length", frozenset({400}), (head + "Content-Length: 12abc\r\n\r\n").encode() + body
    if what == 5:  # the body ends (the client half-closes) before Content-Length
        return "short-body", frozenset({400}), (head + f"Content-Length: {len(body) + 100}\r\n\r\n").encode() + body
    if what == 6:
        return "bad-chunk", frozenset({400}), (head + "Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n").encode()
    if what == 7:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 50]), body[i:i + 50]) for i in range(0, len(body), 50))
        return "chunked", frozenset({200}), (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + chunks + b"0\r\n\r\n"
    # stalls mid-body: cut after request_timeout with 408 (or just closed)
    return "stall", frozenset({408}), (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body[: len(body) // 2]


def _raw(port: int, data: bytes, stall: bool, limit_s: float = STALL_S * 10) -> int | str | None:
    """Sends `data`; returns the status code, None if the server closed without
    one, or "no answer" if nothing came within `limit_s` (a hang: a failure)."""
    deadline = time.monotonic() + limit_s
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        try:
            s.sendall(data)
            if not stall:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        buf = b""
        while b"\r\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([s], [], [], left)[0]:
                return "no answer"
            try:
                got = s.recv(4096)
            except OSError:
                return None
            if not got:
                break
            buf += got
    if not buf.startswith(b"HTTP/1."):
        return None
    return int(buf.split(b" ", 2)[1])


def campaign(n: int, seed: int = 1) -> dict:
    import grpc
    import psutil

    root = Path(tempfile.mkdtemp(prefix="nightshift-wire-"))
    c = Collector(root / "data", root / "wal", root / "collector.log",
                  env={"NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES": str(C_LIMIT), "NIGHTSHIFT_COLLECTOR_REQUEST_TIMEOUT": str(STALL_S),
                       "NIGHTSHIFT_COLLECTOR_CLIENT_MAX_INFLIGHT": "0"}).start()
    proc = psutil.Process(c.proc.pid)
    rss0 = proc.memory_info().rss
    out = {"cases": 0, "grpc_cases": 0, "framing": 0, "crashes": 0, "wrong_code": 0, "unsendable": 0,
           "failures": [], "by_code": {}}
    t0 = time.time()
    conn = http.client.HTTPConnection("127.0.0.1", c.http_port, timeout=30)
    channel = grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}", options=[("grpc.max_send_message_length", 64 << 20)])
    services = {"traces": "opentelemetry.proto.collector.trace.v1.TraceService",
                "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
                "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService"}
    calls = {k: channel.unary_unary(f"/{v}/Export") for k, v in services.items()}

    def note(code, expect, kind, transport):
        key = f"{transport}:{code}"
        out["by_code"][key] = out["by_code"].get(key, 0) + 1
        if code in (500, "INTERNAL", "UNKNOWN"):
            out["crashes"] += 1
        elif code not in expect:
            out["wrong_code"] += 1
        else:
            return
        if len(out["failures"]) < 20:
            out["failures"].append({"kind": kind, "transport": transport, "expected": sorted(map(str, expect)), "got": str(code)})

    try:
        for i in range(n):
            rng = random.Random(seed * 7_000_003 + i)
            if rng.random() < 0.1:
                name, expect, data = _framing(rng, c.http_port)
                code = _raw(c.http_port, data, stall=name == "stall")
                out["framing"] += 1
                note(code, expect, name, "http-raw")
                continue
            case = C.generate(rng, C_LIMIT)
            out["cases"] += 1
            for attempt in (0, 1):
                fresh = conn.sock is None
                try:
                    conn.request("POST", case.path, body=case.body, headers=case.headers())
                    r = conn.getresponse()
                    r.read()
                    note(r.status, case.expect, case.kind, "http")
                except (ValueError, http.client.InvalidURL):  # a header http.client will not send
                    out["unsendable"] += 1
                    conn.close()
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    if not fresh and attempt == 0:  # the server let an idle kept-alive connection go: reconnect
                        continue
                    note(f"connection error {type(e).__name__}", case.expect, case.kind, "http")
                break
            signal_name = case.path.rsplit("/", 1)[-1]
            if case.grpc and case.encoding is None and case.content_type == C.PB and signal_name in calls:
                out["grpc_cases"] += 1
                try:
                    calls[signal_name](case.body, timeout=30)
                    got = "OK"
                except grpc.RpcError as e:
                    got = e.code().name
                note(got, {C.grpc_code_for(x) for x in case.expect}, case.kind, "grpc")
        out["healthy_after"] = bool(c.health())
        m = drained(c)
        out["acknowledged"] = int(counted(m, "nightshift_accepted_total"))
        out["flusher_read"] = int(counted(m, "nightshift_flushed") + m.get("nightshift_duplicates_dropped", 0))
        out["stored_per_metrics"] = int(counted(m, "nightshift_flushed"))
        out["rss_mib_before"] = rss0 / 2**20
        out["rss_mib_after"] = proc.memory_info().rss / 2**20
        conn.close()
        channel.close()
        out["exit_code"] = c.stop()
        rows = stored_rows(c.data)
        out["rows_in_parquet"] = sum(rows.values())
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
    out["wall_s"] = time.time() - t0
    out["log"] = str(c.log_path)
    return out


C_LIMIT = 4 << 20


def ok(w: dict) -> bool:
    return (not w["crashes"] and not w["wrong_code"] and w["healthy_after"] and w["exit_code"] == 0
            and w["acknowledged"] == w["flusher_read"] and w["rows_in_parquet"] == w["stored_per_metrics"])


def report(w: dict) -> str:
    lines = [
        f"requests: {w['cases']:,} fuzz cases over HTTP, {w['grpc_cases']:,} over gRPC, {w['framing']:,} malformed "
        f"HTTP exchanges on raw sockets ({w['wall_s']:.0f} s; {w['unsendable']} cases http.client refused to send)",
        f"crashes (500 / INTERNAL / UNKNOWN): {w['crashes']}; wrong status code: {w['wrong_code']}",
        f"healthy afterwards: {w['healthy_after']}; SIGTERM exit code: {w['exit_code']}",
        f"records acknowledged: {w['acknowledged']:,}; read by the flusher: {w['flusher_read']:,}; rows in Parquet: "
        f"{w['rows_in_parquet']:,} (the rest were resent duplicates)",
        f"collector RSS: {w['rss_mib_before']:.0f} MiB at start, {w['rss_mib_after']:.0f} MiB at the end",
        "answers: " + ", ".join(f"{k} {v:,}" for k, v in sorted(w["by_code"].items())),
    ]
    for f in w["failures"][:10]:
        lines.append(f"  FAILURE {f['kind']} over {f['transport']}: expected {f['expected']}, got {f['got']}")
    return "\n".join(lines)
