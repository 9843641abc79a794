"""What `nightshift route` adds to latency (issue 18: p99 overhead < 2 ms at 200
concurrent streams on this machine).

An upstream stub streams SSE chunks at a fixed pace, like vLLM decoding (the first
after one pace, as after prefill), and answers non-stream requests after the
same time. 200 concurrent streaming clients run against the stub directly, then
through a real `nightshift route` process (a route with a 50 % candidate, so
every request is parsed, keyed, chosen and rewritten, one log line each), in
alternating rounds of the same load. Printed: p50/p99 time to first byte and
total latency for both, the overhead (proxied minus direct) at p50 and p99,
requests/s, the proxy's CPU-seconds and peak RSS, and what else used the CPU.

    python benchmarks/route.py                        # 200 streams, 20 chunks 25 ms apart, 3 rounds
    python benchmarks/route.py --streams 50 --rounds 1
    python benchmarks/route.py --prompt 0.5           # and a prompt route on the agents' system prompt (issue 27)

With `--prompt SHARE` the proxy also holds a prompt route matching the requests'
system prompt: every request's prompt is folded and hashed, and SHARE of the
conversations get the candidate's text in its place and their answers marked
(`+p:<version>` on every streamed event's `model`), the work a prompt trial adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/hardening: the shared process helpers
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from hardening.proc import free_port  # noqa: E402  one helper for every harness
from harness import Target, log  # noqa: E402

#: Issue 18: what the proxy adds at p99 (the worse of time to first byte and total).
T_OVERHEAD = Target("<", 2.0, "2 ms")


# --- the upstream stub and the clients: raw asyncio protocols, so that the load generator's ---
# --- own cost (aiohttp's would be several times the proxy's) does not swamp what is measured ---


class Stub(asyncio.Protocol):
    """vLLM's shape at a fixed pace: SSE chunks `pace` apart, or the whole answer after
    `chunks * pace`; HTTP/1.1 keep-alive, one request at a time per connection."""

    chunks, pace, frames = 20, 0.025, {}

    def connection_made(self, transport) -> None:
        self.t, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        i = self.buf.find(b"\r\n\r\n")
        if i < 0:
            return
        n = int(re.search(rb"(?i)content-length: *(\d+)", self.buf[:i]).group(1))
        if len(self.buf) >= i + 4 + n:
            body, self.buf = json.loads(self.buf[i + 4:i + 4 + n]), self.buf[i + 4 + n:]
            loop = asyncio.get_running_loop()
            if body.get("stream"):
                self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                loop.call_later(self.pace, self.tick, self.sse(body["model"]), 0)
            else:
                out = json.dumps({"model": body["model"], "choices": [{"message": {"content": "tok " * self.chunks}}]})
                loop.call_later(self.chunks * self.pace, self.t.write, b"HTTP/1.1 200 OK\r\nContent-Type: "
                                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(out), out.encode()))

    def sse(self, model: str) -> list[bytes]:
        if model not in self.frames:
            head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": model}
            events = [b"data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"content": "tok "} if i else
                      {"role": "assistant", "content": ""}}]}).encode() + b"\n\n" for i in range(self.chunks)]
            events[-1] += b"data: [DONE]\n\n"
            self.frames[model] = [b"%x\r\n%s\r\n" % (len(e), e) for e in events]
            self.frames[model][-1] += b"0\r\n\r\n"
        return self.frames[model]

    def tick(self, frames: list[bytes], i: int) -> None:
        if not self.t.is_closing():
            self.t.write(frames[i])
            if i + 1 < len(frames):
                asyncio.get_running_loop().call_later(self.pace, self.tick, frames, i + 1)


def stub(port: int, chunks: int, pace: float) -> None:
    Stub.chunks, Stub.pace = chunks, pace

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Stub, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    asyncio.run(serve())


class Client(asyncio.Protocol):
    """One keep-alive connection: a request, then (time to first body byte, total) once
    the chunked answer's last chunk is in."""

    def connection_made(self, transport) -> None:
        self.t, self.done = transport, None

    async def call(self, request: bytes) -> tuple[float, float, bytes]:
        self.buf, self.ttfb, self.t0 = bytearray(), 0.0, time.perf_counter()
        self.done = asyncio.get_running_loop().create_future()
        self.t.write(request)
        return await self.done

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.ttfb and len(self.buf) > self.buf.find(b"\r\n\r\n") + 4 > 3:
            self.ttfb = time.perf_counter() - self.t0
        if self.buf.endswith(b"\r\n0\r\n\r\n"):
            self.done.set_result((self.ttfb, time.perf_counter() - self.t0, bytes(self.buf)))

    def connection_lost(self, exc) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost mid-answer: {bytes(self.buf[-200:])!r}"))


SYSTEM = "You are a careful assistant that uses tools. " * 20


def request_body(model: str, i: int) -> bytes:
    """An agent's call of typical size (~2.4 KB): a system prompt, a tool call and its
    result, two tools."""
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look a fact up. " * 8, "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
        "required": ["query"]}}}
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Task {i}: what colour is the lamp today? " * 4},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "lookup", "arguments": "{\"query\": \"lamp colour\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "The lamp is green today. " * 10}]
    body = json.dumps({"model": model, "messages": messages, "tools": [tool, tool], "stream": True,
                       "max_tokens": 64, "temperature": 0.7}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def one_client(port: int, model: str, cid: int, requests: int, out: list, spread: float) -> None:
    await asyncio.sleep(spread * ((cid * 0.618034) % 1.0))  # staggered arrivals, as agents' calls are, not one burst
    transport, client = await asyncio.get_running_loop().create_connection(Client, "127.0.0.1", port)
    try:
        for n in range(requests):
            ttfb, total, answer = await client.call(request_body(model, cid * 1000 + n))
            if not answer.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in answer:
                raise RuntimeError(f"a stream did not end well: {answer[:300]!r}")
            out.append((ttfb, total, b"+p:" in answer))
    finally:
        transport.close()


async def load(port: int, model: str, streams: int, requests: int, spread: float = 0.0) -> tuple[list, float]:
    out: list = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(port, model, c, requests, out, spread) for c in range(streams)))
    return out, time.perf_counter() - t0


# --- measuring ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--streams", type=int, default=200, help="concurrent streaming clients (default 200)")
    ap.add_argument("--requests", type=int, default=8, help="requests per client per round (default 8)")
    ap.add_argument("--rounds", type=int, default=3, help="direct/proxied rounds, alternating (default 3)")
    ap.add_argument("--chunks", type=int, default=20, help="SSE chunks per answer (default 20)")
    ap.add_argument("--pace", type=float, default=0.025, help="seconds between chunks (default 0.025)")
    ap.add_argument("--prompt", type=float, metavar="SHARE", help="also a prompt route on the system prompt, its "
                    "candidate on SHARE of the conversations (default: none)")
    ap.add_argument("--stub", type=int, metavar="PORT", help=argparse.SUPPRESS)
    return ap.parse_args()


def quantile(xs: list[float], q: float) -> float:
    """xs's q-quantile (0 < q < 1), index int(q * n) of the sorted values: the rank
    this benchmark's figures have always used (harness.pct's nearest rank sits one
    below it), so they compare with the earlier reports."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_s(*procs: psutil.Process) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def before_run() -> str:
    """The load average, and each core's busy share over one second, before anything starts."""
    per_core = psutil.cpu_percent(interval=1.0, percpu=True)
    return (f"before the run: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, per-core busy "
            f"{', '.join(f'{b:.0f} %' for b in per_core)} (over 1 s)")


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def start(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, subprocess.Popen, int, int]:
    """The stub, then `nightshift route` in front of it with a 50 % candidate route."""
    up_port, proxy_port = free_port(), free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--stub", str(up_port), "--chunks", str(args.chunks),
                                 "--pace", str(args.pace)])
    wait_port(up_port)
    env = {**os.environ, "NIGHTSHIFT_ROUTE_STATE": f"{tmp}/routes.json"}
    proxy = subprocess.Popen([sys.executable, "-m", "nightshift.cli.route_cmd", "route", "--listen",
                              f"127.0.0.1:{proxy_port}", "--upstream", f"http://127.0.0.1:{up_port}"],
                             env=env, stderr=open(f"{tmp}/proxy.log", "wb"))
    wait_port(proxy_port)
    put = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/nightshift/routes/agent", method="PUT", data=json.dumps(
        {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5}).encode())
    urllib.request.urlopen(put).read()
    if args.prompt is not None:
        from nightshift.schemas.prompt_identity import system_id

        candidate = SYSTEM + "Check each tool result before you answer."
        put = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/nightshift/routes/prompt:{system_id([SYSTEM])}",
                                     method="PUT", data=json.dumps({"kind": "prompt", "candidate": system_id([candidate]),
                                                                    "system": candidate, "share": args.prompt}).encode())
        urllib.request.urlopen(put).read()
    return upstream, proxy, up_port, proxy_port


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
        p.wait(30)


@dataclass
class Measured:
    """[(ttfb, total)] of each request and the seconds of each side's rounds, the
    proxy's CPU-seconds and peak RSS, and the CPU-seconds of everything else."""

    direct: list[tuple[float, float]]
    proxied: list[tuple[float, float]]
    direct_s: float
    proxied_s: float
    proxy_cpu: float
    others: float
    proxy_rss_mib: float = float("nan")


async def bench(args: argparse.Namespace, up_port: int, proxy_port: int, procs: list[psutil.Process]) -> Measured:
    """Alternating rounds, direct then proxied."""
    def phase(port: int, model: str, requests: int):
        return load(port, model, args.streams, requests, spread=args.chunks * args.pace)

    await phase(up_port, "agent@v0001", 1)  # warm-up: connections, caches
    await phase(proxy_port, "agent", 1)
    direct, proxied, secs, proxy_cpu, others = [], [], [0.0, 0.0], 0.0, 0.0
    for r in range(args.rounds):
        log(f"round {r + 1} of {args.rounds}", "route")
        xs, s = await phase(up_port, "agent@v0001", args.requests)
        direct, secs[0] = direct + xs, secs[0] + s
        c0, b0, all0 = cpu_s(procs[1]), busy_s(), cpu_s(*procs)
        xs, s = await phase(proxy_port, "agent", args.requests)
        proxied, secs[1] = proxied + xs, secs[1] + s
        proxy_cpu += cpu_s(procs[1]) - c0
        others += (busy_s() - b0) - (cpu_s(*procs) - all0)
    return Measured(direct, proxied, secs[0], secs[1], proxy_cpu, max(0.0, others))


def measure(args: argparse.Namespace, tmp: Path) -> Measured:
    """Start the stub and the proxy, run the rounds, read the proxy's peak RSS while
    it still runs, stop both."""
    upstream, proxy, up_port, proxy_port = start(args, tmp)
    try:
        procs = [psutil.Process(upstream.pid), psutil.Process(proxy.pid), psutil.Process()]
        m = asyncio.run(bench(args, up_port, proxy_port, procs))
        m.proxy_rss_mib = peak_rss_mib(proxy.pid)
        return m
    finally:
        stop(proxy, upstream)


def report(head: list[str], args: argparse.Namespace, m: Measured) -> list[str]:
    def row(name: str, xs: list[tuple[float, float]], secs: float) -> tuple[str, ...]:
        t, tot = [x[0] for x in xs], [x[1] for x in xs]
        ms = (f"{1000 * quantile(v, q):.2f} ms" for v in (t, tot) for q in (.5, .99))
        return (name, *ms, f"{len(xs) / secs:.0f}")

    def diff_ms(i: int, q: float) -> float:
        return 1000 * (quantile([x[i] for x in m.proxied], q) - quantile([x[i] for x in m.direct], q))

    over = {f"{k} p{int(100 * q)}": diff_ms(i, q) for k, i in (("TTFB", 0), ("total", 1)) for q in (.5, .99)}
    worst = max(over["TTFB p99"], over["total p99"])
    return [
        *head,
        f"load: {args.streams} concurrent streams x {args.requests} requests x {args.rounds} round(s), "
        f"{args.chunks} SSE chunks {1000 * args.pace:g} ms apart (~4 KB request bodies)"
        + (f"; a prompt route on {100 * args.prompt:g} % of the conversations: {sum(x[2] for x in m.proxied):,} of "
           f"{len(m.proxied):,} answers rewritten and marked" if args.prompt is not None else ""),
        *harness.table([row("direct", m.direct, m.direct_s), row("proxied", m.proxied, m.proxied_s)],
                       header=("", "TTFB p50", "TTFB p99", "total p50", "total p99", "req/s")),
        "  overhead: " + ", ".join(f"{k} {v:+.2f} ms" for k, v in over.items()),
        f"  proxy: {m.proxy_cpu:.2f} CPU-s for {len(m.proxied)} requests "
        f"({1000 * m.proxy_cpu / len(m.proxied):.2f} ms each), peak RSS {m.proxy_rss_mib:.0f} MiB",
        f"  others on this machine during the proxied rounds: {m.others:.2f} CPU-s "
        f"({100 * m.others / m.proxied_s / os.cpu_count():.0f} % of the CPUs)",
        f"  p99 overhead at {args.streams} streams: {worst:.2f} ms ({T_OVERHEAD.check(worst)})",
    ]


def main() -> int:
    args = parse_args()
    if args.stub:
        stub(args.stub, args.chunks, args.pace)
        return 0
    shown = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "stub"})
    head = [*harness.header("nightshift route overhead benchmark", shown), before_run()]
    with harness.sigterm_as_interrupt(), harness.temp_dir("nightshift-bench-route-") as tmp:
        m = measure(args, tmp)
    print("\n".join(report(head, args, m)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
