"""What `nightshift route` adds to latency (issue 18: p99 overhead < 2 ms at 200
concurrent streams on this machine).

An upstream stub streams SSE chunks at a fixed pace, like vLLM decoding (the first
after one pace, as after prefill), and answers non-stream requests after the
same time. 200 concurrent streaming clients run against the stub directly, then
through a real `nightshift route` process (a route with a 50 % candidate, so
every request is parsed, keyed, chosen and rewritten; each decision counted, its
log line at DEBUG), in alternating rounds of the same load. Printed: p50/p99 time to first byte and
total latency for both, the overhead (proxied minus direct) at p50 and p99,
requests/s, the proxy's CPU-seconds and peak RSS, and what else used the CPU.

    python benchmarks/route.py                        # 200 streams, 20 chunks 25 ms apart, 3 rounds
    python benchmarks/route.py --streams 50 --rounds 1
    python benchmarks/route.py --prompt 0.5           # and a prompt route on the agents' system prompt (issue 27)
    python benchmarks/route.py --baseline /tmp/wt-e0ac2ad   # and another checkout's proxy, in the same minutes
    python benchmarks/route.py --parts                # the prompt arm's CPU per part, in this process (seconds)
    python benchmarks/route.py --pin                  # and pinned phases: the proxy on a CPU of its own (extra line)
    python benchmarks/route.py --aa                   # and direct against direct: the benchmark's own noise

With `--baseline DIR` a second proxy runs from another checkout of this repository
(a worktree: `git worktree add /tmp/wt-e0ac2ad e0ac2ad`, imported as `nightshift`
through PYTHONPATH) in front of the same stub, and each round is direct, this
proxy, the baseline's: on a shared machine only figures taken in the same
minutes compare. With --prompt, the baseline holds the prompt route too when it
knows prompt routes (since issue 27).

With `--prompt SHARE` the proxy also holds a prompt route matching the requests'
system prompt: every request's prompt is folded and hashed, and SHARE of the
conversations get the candidate's text in its place and their answers marked
(`+p:<version>` on every streamed event's `model`), the work a prompt trial adds.
`--parts` times that work apart, step by step on the same request and stream, in
CPU microseconds (the best of 5 passes: on shared cores a figure less disturbed
than any p99), and what it adds per request at the share `--prompt` gives (0.5).

What moves a run's p99 is printed under the table: each round's added p99 against
the same round's direct phase, the cores each process held, and whether the
slowest 1 % came in bursts (one stall felt by many streams). The harness's own
stalls are kept out of it (`--harness steady`, the default): the stand-in paces
events on the clock and neither it nor the load generator collects garbage during
a phase; `--harness drifting` is the benchmark as it was before, to compare.
`--pin` adds, in every round, a direct and a proxied phase with the proxy alone on
one CPU: a named line of its own, never the target line.

Every run also says what hour it was taken in (the same proxy's CPU per request
moved 0.85-0.97 -> 1.07-1.21 ms between two quiet windows): the VM's steal over
the run and a fixed CPU-bound probe at its start and end; and the proxy's read
and write system calls per request (/proc/PID/io), whose least is one each per
streamed event plus the request's; and the proxy's collector passes in its phases
(from the pause histogram it serves at /metrics), each a stall of every stream.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
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
#: Others' share of the CPUs during a proxy's rounds above which its p99 measures them, not the proxy
#: (direct TTFB p99 moves by tens to hundreds of ms); its CPU per request still compares within a run.
QUIET = 0.10


# --- the upstream stub and the clients: raw asyncio protocols, so that the load generator's ---
# --- own cost (aiohttp's would be several times the proxy's) does not swamp what is measured ---


class Stub(asyncio.Protocol):
    """vLLM's shape at a fixed pace: SSE chunks `pace` apart, or the whole answer after
    `chunks * pace`; HTTP/1.1 keep-alive, one request at a time per connection.

    Steady (the default): event i is due `(i + 1) * pace` after the request, on the
    clock, as vLLM's engine (a process of its own) keeps decoding while its HTTP
    server stalls: a stall of the stand-in delays the events due during it, and the
    next ones are on time again. Drifting (`--harness drifting`, the benchmark before
    route7): each event `pace` after the previous one was sent, so every stall of the
    stand-in (a collection, a wait for a core) added itself to every later event of
    every stream in flight, and a run's total p99 measured the stand-in's stalls as
    much as the proxy."""

    chunks, pace, frames, steady = 20, 0.025, {}, True

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
                loop.call_later(self.pace, self.tick, self.sse(body["model"]), 0, loop.time())
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

    def tick(self, frames: list[bytes], i: int, t0: float) -> None:
        if not self.t.is_closing():
            self.t.write(frames[i])
            if i + 1 < len(frames):
                loop = asyncio.get_running_loop()
                if self.steady:
                    loop.call_at(t0 + (i + 2) * self.pace, self.tick, frames, i + 1, t0)
                else:
                    loop.call_later(self.pace, self.tick, frames, i + 1, t0)


def stub(port: int, chunks: int, pace: float, steady: bool = True) -> None:
    Stub.chunks, Stub.pace, Stub.steady = chunks, pace, steady
    if steady:  # the stand-in's own collections are not the proxy's latency: what it keeps is its connections
        gc.disable()

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
        end = self.buf.find(b"\r\n\r\n") + 4
        if not self.ttfb and len(self.buf) > end > 3:
            self.ttfb = time.perf_counter() - self.t0
        # chunked, or (a stream the proxy found complete before it answered, as a slow one does) a Content-Length
        n = re.search(rb"(?i)\r\ncontent-length: *(\d+)", self.buf[:end]) if end > 3 else None
        if self.buf.endswith(b"\r\n0\r\n\r\n") or (n and len(self.buf) >= end + int(n.group(1))):
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
            t0 = time.perf_counter()
            ttfb, total, answer = await client.call(request_body(model, cid * 1000 + n))
            if not answer.startswith(b"HTTP/1.1 200") or b"data: [DONE]" not in answer:
                raise RuntimeError(f"a stream did not end well: {answer[:300]!r}")
            out.append((ttfb, total, b"+p:" in answer, t0, n == 0))
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
    ap.add_argument("--baseline", metavar="DIR", help="also run another checkout's proxy (a worktree of an earlier "
                    "commit), alternating with this one in every round")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE", help="an environment "
                    "setting of the baseline's proxy only, e.g. --baseline /work/main --baseline-env "
                    "NIGHTSHIFT_ROUTE_LOOP=asyncio: this checkout on asyncio's loop in the same rounds")
    ap.add_argument("--parts", action="store_true", help="time the prompt arm's steps apart, in this process (CPU "
                    "us per request and per streamed event), instead of the load")
    ap.add_argument("--harness", choices=("steady", "drifting"), default="steady", help="steady (default): the "
                    "stand-in's events on the clock from each request, and no collection in the stand-in or, during "
                    "a phase, the load generator; drifting: as before route7, each event timed from the previous one "
                    "and both collected as they went (their stalls were in every p99)")
    ap.add_argument("--pin", action="store_true", help="also, in every round, a pinned direct and proxied phase: "
                    "the proxy alone on the last CPU, the stub and the load generator on the others (an extra, named "
                    "line: the target line stays the unpinned one)")
    ap.add_argument("--aa", action="store_true", help="also a second direct phase in every round, after the "
                    "proxies': the target's figure for direct against direct, the benchmark's own noise")
    ap.add_argument("--dump", metavar="FILE", help="also write every request's (start, TTFB, total) and every "
                    "phase's CPU by process to FILE (JSON), to see what set a run's p99")
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


def start_proxy(args: argparse.Namespace, tmp: Path, up_port: int, baseline: str = "") -> tuple[subprocess.Popen, int]:
    """`nightshift route` in front of the stub with a 50 % candidate route (from the
    checkout at `baseline`, when given, through PYTHONPATH)."""
    proxy_port, name = free_port(), "baseline" if baseline else "proxy"
    env = {**os.environ, "NIGHTSHIFT_ROUTE_STATE": f"{tmp}/{name}-routes.json"}
    if baseline:
        (tmp / "pp").mkdir()
        (tmp / "pp" / "nightshift").symlink_to(Path(baseline).resolve())
        env["PYTHONPATH"] = os.pathsep.join([str(tmp / "pp"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.update(kv.split("=", 1) for kv in args.baseline_env)
    proxy = subprocess.Popen([sys.executable, "-m", "nightshift.cli.route_cmd", "route", "--listen",
                              f"127.0.0.1:{proxy_port}", "--upstream", f"http://127.0.0.1:{up_port}"],
                             env=env, stderr=open(f"{tmp}/{name}.log", "wb"))
    wait_port(proxy_port)
    put = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/nightshift/routes/agent", method="PUT", data=json.dumps(
        {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5}).encode())
    urllib.request.urlopen(put).read()
    if args.prompt is not None:
        from nightshift.schemas.prompt_identity import system_id, version_id

        candidate = SYSTEM + "Check each tool result before you answer."
        route = {"kind": "prompt", "candidate": system_id([candidate]), "system": candidate, "share": args.prompt,
                 "version": version_id([candidate], [])}  # the trial's id, marked as given (no per-request hash)
        for body in (route, {k: v for k, v in route.items() if k != "version"}):
            put = urllib.request.Request(f"http://127.0.0.1:{proxy_port}/nightshift/routes/prompt:"
                                         f"{system_id([SYSTEM])}", method="PUT", data=json.dumps(body).encode())
            try:
                urllib.request.urlopen(put).read()
                args.baseline_prompt = bool(baseline)
                break
            except urllib.error.HTTPError:
                if not baseline:
                    raise  # a baseline from before `version` marks as it did; one from before prompt routes
    return proxy, proxy_port  # (issue 27) runs without one


def start(args: argparse.Namespace, tmp: Path) -> tuple[subprocess.Popen, list[tuple[subprocess.Popen, int]], int]:
    """The stub, then the proxy (and the baseline's) in front of it."""
    up_port = free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--stub", str(up_port), "--chunks", str(args.chunks),
                                 "--pace", str(args.pace), "--harness", args.harness])
    wait_port(up_port)
    proxies = [start_proxy(args, tmp, up_port)]
    if args.baseline:
        proxies.append(start_proxy(args, tmp, up_port, args.baseline))
    return upstream, proxies, up_port


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        p.terminate()
        p.wait(30)


@dataclass
class Proxied:
    """One proxy's rounds: [(ttfb, total, marked)] of each request, their seconds,
    the proxy's CPU-seconds (its process only), peak RSS, and the CPU-seconds of
    everything else on the machine while they ran."""

    name: str
    xs: list
    secs: float = 0.0
    cpu: float = 0.0
    others: float = 0.0
    rss_mib: float = float("nan")
    loop: str = "asyncio"  # the event loop its start-up line names (older proxies name none: asyncio)
    reads: int = 0  # its read and write system calls (/proc/PID/io syscr, syscw) over the same rounds
    writes: int = 0
    gc: dict = field(default_factory=dict)  # generation -> [passes, seconds, passes over 2 ms] in its phases
    stalls: dict = field(default_factory=dict)  # gc_stalls' figures summed over its phases (route9's proxy on)


@dataclass
class Phase:
    """One phase of one round (direct, or one proxy's): how many requests it added to
    the list of its kind (in order, so `by_round` can cut the list back into rounds),
    its seconds, and CPU-seconds by process: the proxy's user and system time, the
    stub's, the load generator's (this process) and everyone else's. A p99 is set by
    queueing for a core; these say who held the cores meanwhile."""

    who: str
    round: int
    n: int
    secs: float
    user: float = 0.0
    sys: float = 0.0
    stub: float = 0.0
    gen: float = 0.0
    others: float = 0.0


@dataclass
class Measured:
    """The direct rounds, each proxy's, and every phase's CPU; with --pin, the pinned
    phases' own Measured."""

    direct: list[tuple[float, float]]
    direct_s: float
    proxies: list[Proxied]
    phases: list[Phase] = field(default_factory=list)
    pinned: Measured | None = None
    again: list = field(default_factory=list)  # --aa: a second direct phase in every round
    machine: Machine | None = None  # the hour the run was taken in


#: --aa's second direct phase, after the proxies' in every round.
AGAIN = "direct again"

#: The CPU-bound probe's fixed work: ~50 ms of one core on this VM in a quiet hour.
PROBE_LOOPS = 500_000


def probe_ms(loops: int = PROBE_LOOPS, tries: int = 3) -> float:
    """CPU milliseconds of a fixed pure-Python loop, the best of `tries`: how fast a
    core runs this hour. The same code's proxy CPU per request moved 0.85-0.97 ->
    1.07-1.21 ms between two quiet windows an hour apart; this says whether the
    machine moved with it (a CPU time, so a wait for a core is not in it)."""
    best = float("inf")
    for _ in range(tries):
        t0, x = time.process_time(), 0
        for i in range(loops):
            x += i ^ (i >> 3)
        best = min(best, time.process_time() - t0)
    return 1000 * best


_GC_LINE = re.compile(r'nightshift_route_gc_pause_seconds_(count|sum|bucket)\{generation="(\d)"(?:,le="([^"]+)")?\} (\S+)')


def gc_pauses(text: str) -> dict[int, list[float]]:
    """The proxy's collector passes from its /metrics text: generation -> [passes,
    seconds, passes over 2 ms]; empty from a proxy that does not time them (before
    route8). Each pass stalls every stream in flight: a run that misses the target
    says whether such stalls were there."""
    out: dict[int, list[float]] = {}
    for kind, g, le, v in _GC_LINE.findall(text):
        d = out.setdefault(int(g), [0.0, 0.0, 0.0])
        if kind == "count":
            d[0] = float(v)
        elif kind == "sum":
            d[1] = float(v)
        elif le == "0.002":
            d[2] = float(v)  # passes of 2 ms or less (cumulative bucket)
    return {g: [n, sec, n - short] for g, (n, sec, short) in out.items()}


_STALL_LINE = re.compile(r'nightshift_route_gc_stall_seconds_(count|sum|bucket)(?:\{le="([^"]+)"\})? (\S+)')


def gc_stalls(text: str) -> dict[str, float]:
    """The passes of `gc_pauses` taken with proxied requests in flight (route9's proxy
    serves them apart: it takes its passes when none is): "n", "s" and, per bucket,
    "le=X" (cumulative). Empty from a proxy before route9's, where every pass in a
    phase is one."""
    out: dict[str, float] = {}
    for kind, le, v in _STALL_LINE.findall(text):
        out["n" if kind == "count" else "s" if kind == "sum" else f"le={le}"] = float(v)
    return out


def largest_ms(stalls: dict[str, float]) -> str:
    """The largest stall of a phase's bucket counts (their differences): the first
    bucket that holds them all bounds it."""
    bounds = sorted((float(k[3:]), v) for k, v in stalls.items() if k.startswith("le=") and k != "le=+Inf")
    if not stalls.get("n"):
        return "none"
    for le, v in bounds:
        if v >= stalls["n"]:
            return f"<= {1000 * le:g} ms"
    return f"> {1000 * bounds[-1][0]:g} ms" if bounds else "?"


def scrape(port: int) -> tuple[dict[int, list[float]], dict[str, float]]:
    """The proxy's collector passes and stalls, from one /metrics."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}, {}
    return gc_pauses(text), gc_stalls(text)


def steal_s() -> float:
    """CPU-seconds the hypervisor gave to others while this VM wanted them (/proc/stat's
    steal, all CPUs)."""
    return psutil.cpu_times().steal


@dataclass
class Machine:
    """The VM over one run: the probe at the start and the end, and the steal's share
    of all CPUs over the run's wall time."""

    probe_start_ms: float
    probe_end_ms: float = float("nan")
    steal: float = float("nan")
    secs: float = 0.0

    def line(self) -> str:
        return (f"  the machine this run: a fixed CPU-bound probe took {self.probe_start_ms:.1f} ms of CPU at the start "
                f"and {self.probe_end_ms:.1f} at the end ({PROBE_LOOPS:,} loops, best of 3; larger is a slower "
                f"hour); steal {100 * self.steal:.1f} % of the {os.cpu_count()} CPUs over the run's "
                f"{self.secs:.0f} s (time the hypervisor gave to other VMs)")


def watch_machine() -> Callable[[], Machine]:
    """Start watching: the probe now, the steal counter now; the call ends it."""
    m, s0, t0 = Machine(probe_ms()), steal_s(), time.perf_counter()

    def end() -> Machine:
        m.secs = time.perf_counter() - t0
        m.steal = (steal_s() - s0) / (m.secs * (os.cpu_count() or 1))
        m.probe_end_ms = probe_ms()
        return m

    return end


def pin(procs: list[psutil.Process], proxies: list[psutil.Process], cpus: list[int], on: bool) -> None:
    """The proxies alone on the last of `cpus`, the stub and this process on the
    others; or every process on all of `cpus` again."""
    for p in procs:
        p.cpu_affinity(cpus if not on else cpus[-1:] if p in proxies else cpus[:-1])


async def bench(args: argparse.Namespace, up_port: int, ports: list[int], procs: list[psutil.Process]) -> Measured:
    """Alternating rounds: direct, then each proxy in turn (and with --pin, the same
    again pinned). procs: the stub, the proxies, this process. This process does not
    collect during a phase (`--harness steady`): a collection here stalls every
    stream's clock at once, direct or proxied, and is not the proxy's."""
    def phase(port: int, model: str, requests: int):
        return load(port, model, args.streams, requests, spread=args.chunks * args.pace)

    def times() -> tuple[list[tuple[float, float]], float]:
        return [tuple(p.cpu_times()[:2]) for p in procs], busy_s()

    async def timed(m: Measured, who: str, r: int, port: int, model: str, proxy: psutil.Process | None = None):
        gc0, st0 = scrape(port) if proxy is not None else ({}, {})  # outside the phase's CPU and time
        (t0, b0), i = times(), procs.index(proxy) if proxy is not None else -1
        io0 = proxy.io_counters() if proxy is not None else None
        if args.harness == "steady":
            gc.collect()
            gc.disable()
        try:
            xs, s = await phase(port, model, args.requests)
        finally:
            gc.enable()
        t1, b1 = times()
        io1 = proxy.io_counters() if proxy is not None else None
        d = [(u1 - u0, s1 - s0) for (u0, s0), (u1, s1) in zip(t0, t1)]
        ph = Phase(who, r, len(xs), s, *(d[i] if proxy is not None else (0.0, 0.0)), sum(d[0]), sum(d[-1]),
                   max(0.0, (b1 - b0) - sum(sum(x) for x in d)))
        m.phases.append(ph)
        if who == AGAIN:
            m.again += xs
        elif proxy is None:
            m.direct, m.direct_s = m.direct + xs, m.direct_s + s
        else:
            p = m.proxies[procs.index(proxy) - 1]
            p.xs, p.secs = p.xs + xs, p.secs + s
            p.cpu += ph.user + ph.sys
            p.others += ph.others
            p.reads += io1.read_count - io0.read_count
            p.writes += io1.write_count - io0.write_count
            gc1, st1 = scrape(port)
            for g, after in gc1.items():
                before = gc0.get(g, [0.0, 0.0, 0.0])
                p.gc[g] = [a + x - b for a, x, b in zip(p.gc.get(g, [0.0, 0.0, 0.0]), after, before)]
            for k, after in st1.items():
                p.stalls[k] = p.stalls.get(k, 0.0) + after - st0.get(k, 0.0)

    def new(suffix: str = "") -> Measured:
        return Measured([], 0.0, [Proxied(("proxied" if i == 0 else "baseline") + suffix, []) for i in range(len(ports))])

    m = new()
    m.pinned = new(", pinned") if args.pin else None
    proxies, cpus = procs[1:1 + len(ports)], sorted(os.sched_getaffinity(0))
    await phase(up_port, "agent@v0001", 1)  # warm-up: connections, caches
    for port in ports:
        await phase(port, "agent", 1)
    try:
        for r in range(args.rounds):
            log(f"round {r + 1} of {args.rounds}", "route")
            for mm in (m, m.pinned) if m.pinned is not None else (m,):
                pin(procs, proxies, cpus, mm is m.pinned)
                await timed(mm, "direct", r, up_port, "agent@v0001")
                for i, port in enumerate(ports):
                    await timed(mm, mm.proxies[i].name, r, port, "agent", proxies[i])
                if args.aa:
                    await timed(mm, AGAIN, r, up_port, "agent@v0001")
    finally:
        if m.pinned is not None:
            pin(procs, proxies, cpus, False)
    return m


def measure(args: argparse.Namespace, tmp: Path) -> Measured:
    """Start the stub and the proxy, run the rounds, read the proxy's peak RSS while
    it still runs, stop both."""
    machine = watch_machine()
    upstream, proxies, up_port = start(args, tmp)
    try:
        procs = [psutil.Process(upstream.pid), *(psutil.Process(p.pid) for p, _ in proxies), psutil.Process()]
        m = asyncio.run(bench(args, up_port, [port for _, port in proxies], procs))
        m.machine = machine()
        for p, (proc, _) in zip(m.proxies, proxies):
            p.rss_mib = peak_rss_mib(proc.pid)
            said = re.search(r"event loop: ([^;)]+)", (tmp / f"{p.name.replace('proxied', 'proxy')}.log").read_text(
                errors="replace"))
            p.loop = said.group(1) if said else p.loop
        for p, q in zip(m.pinned.proxies if m.pinned is not None else [], m.proxies):
            p.rss_mib, p.loop = q.rss_mib, q.loop
        return m
    finally:
        stop(*(p for p, _ in proxies), upstream)


def by_round(m: Measured, who: str) -> list[list]:
    """`who`'s requests, one list per round (from the phases' counts, in order)."""
    xs = m.direct if who == "direct" else m.again if who == AGAIN else next(p.xs for p in m.proxies if p.name == who)
    out, i = [], 0
    for ph in m.phases:
        if ph.who == who:
            out.append(xs[i:i + ph.n])
            i += ph.n
    return out


def bursts(xs: list, q: float = 0.99, gap: float = 0.005) -> tuple[int, int, int]:
    """(how many requests, in how many bursts, the largest) of the TTFBs at or above
    the q-quantile, a burst being first bytes less than `gap` apart: one stall felt by
    many streams at once shows as one large burst, a p99 of independent waits as many."""
    cut = quantile([x[0] for x in xs], q)
    firsts = sorted(x[3] + x[0] for x in xs if x[0] >= cut)
    sizes: list[int] = []
    for i, t in enumerate(firsts):
        if i and t - firsts[i - 1] < gap:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return len(firsts), len(sizes), max(sizes, default=0)


def first(xs: list, q: float = 0.99) -> float:
    """The share (%) of the TTFBs at or above the q-quantile that were the first
    request on a client's connection (its TCP handshake and the server's set-up of
    it in the same wait)."""
    cut = quantile([x[0] for x in xs], q)
    slow = [x[4] for x in xs if x[0] >= cut]
    return 100 * sum(slow) / len(slow)


def worst_p99_ms(direct: list, proxied: list) -> float:
    """The target's figure: the worse of the added TTFB p99 and the added total p99."""
    return 1000 * max(quantile([x[i] for x in proxied], .99) - quantile([x[i] for x in direct], .99) for i in (0, 1))


def resampled(direct: list, proxied: list, block: float = 0.5, n: int = 200, seed: int = 0) -> tuple[float, float]:
    """The 5th and 95th percentiles of the target's figure over `n` block bootstraps:
    each side's requests grouped by the `block` seconds they started in (a stall's
    victims stay together), blocks drawn with replacement. How far another run of the
    same code on the same machine could read from this one, from this run's data
    alone: when the interval straddles the target, one run cannot be a verdict."""
    rng = random.Random(seed)

    def blocks(xs: list) -> list[list]:
        out: dict[int, list] = {}
        for x in xs:
            out.setdefault(int(x[3] // block), []).append(x)
        return list(out.values())

    bd, bp = blocks(direct), blocks(proxied)
    draws = sorted(worst_p99_ms([x for b in rng.choices(bd, k=len(bd)) for x in b],
                                [x for b in rng.choices(bp, k=len(bp)) for x in b]) for _ in range(n))
    return draws[int(0.05 * n)], draws[int(0.95 * n) - 1]


def spread(args: argparse.Namespace, m: Measured, label: str) -> list[str]:
    """What moves a run's p99: each round's added p99 against the same round's direct
    phase, who held the cores, and whether the slowest requests came in bursts."""
    if not m.phases or len(m.direct[0]) < 4:
        return []
    lines = []
    direct = by_round(m, "direct")
    for p in m.proxies:
        added = []
        for d, x in zip(direct, by_round(m, p.name)):
            t, tot = (1000 * (quantile([a[i] for a in x], .99) - quantile([a[i] for a in d], .99)) for i in (0, 1))
            added.append(f"{t:+.2f} / {tot:+.2f}")
        lines.append(f"  {p.name}: p99 added by round (TTFB / total, against the same round's direct phase): "
                     + ", ".join(added))
    cores = {}
    for who in ("direct", m.proxies[0].name):
        phs = [ph for ph in m.phases if ph.who == who]
        secs = sum(ph.secs for ph in phs)
        cores[who] = {k: sum(getattr(ph, k) for ph in phs) / secs for k in ("user", "sys", "stub", "gen", "others")}
    c, d = cores[m.proxies[0].name], cores["direct"]
    lines.append(f"  cores held{label}, proxied phases: proxy {c['user'] + c['sys']:.2f} (user {c['user']:.2f}, "
                 f"system {c['sys']:.2f}), stub {c['stub']:.2f}, load generator {c['gen']:.2f}, others "
                 f"{c['others']:.2f}; direct phases: stub {d['stub']:.2f}, load generator {d['gen']:.2f}, others "
                 f"{d['others']:.2f}")
    (n, k, big), (n2, k2, big2) = bursts(m.direct), bursts(m.proxies[0].xs)
    lines.append(f"  the slowest 1 % of TTFBs{label}: direct {n} in {k} bursts (largest {big}), {m.proxies[0].name} "
                 f"{n2} in {k2} (largest {big2}); a burst: first bytes < 5 ms apart, one stall felt by many streams")
    if len(m.direct[0]) > 4:
        new = [f"{first(xs):.0f} %" for xs in (m.direct, m.proxies[0].xs)]
        lines.append(f"  a connection's first request{label}: {100 * sum(x[4] for x in m.direct) / len(m.direct):.0f} % of "
                     f"the requests, {new[0]} of the direct side's slowest 1 % of TTFBs, {new[1]} of the proxied side's "
                     f"(the proxy accepts each client's connection, ~0.2 ms of its CPU)")
    if m.again:
        by = [f"{worst_p99_ms(d, a):+.2f}" for d, a in zip(direct, by_round(m, AGAIN))]
        lines.append(f"  direct against direct again{label} (the same stand-in in the same rounds: the benchmark's own "
                     f"noise on the target's figure): {worst_p99_ms(m.direct, m.again):+.2f} ms; by round "
                     + ", ".join(by))
    lo, hi = resampled(m.direct, m.proxies[0].xs)
    lines.append(f"  the p99 overhead{label}, resampled (200 bootstraps of 0.5 s blocks of requests): 90 % between "
                 f"{lo:.2f} and {hi:.2f} ms; a run is a verdict on the target only when both are on one side of it")
    return lines


def report(head: list[str], args: argparse.Namespace, m: Measured) -> list[str]:
    def row(name: str, xs: list[tuple[float, float]], secs: float) -> tuple[str, ...]:
        t, tot = [x[0] for x in xs], [x[1] for x in xs]
        ms = (f"{1000 * quantile(v, q):.2f} ms" for v in (t, tot) for q in (.5, .99))
        return (name, *ms, f"{len(xs) / secs:.0f}")

    def diff_ms(mm: Measured, p: Proxied, i: int, q: float) -> float:
        return 1000 * (quantile([x[i] for x in p.xs], q) - quantile([x[i] for x in mm.direct], q))

    def overhead(mm: Measured, p: Proxied) -> tuple[dict[str, float], float]:
        over = {f"{k} p{int(100 * q)}": diff_ms(mm, p, i, q) for k, i in (("TTFB", 0), ("total", 1)) for q in (.5, .99)}
        return over, max(over["TTFB p99"], over["total p99"])

    proxied, pinned = m.proxies[0], m.pinned
    rows = [row("direct", m.direct, m.direct_s), *(row(p.name, p.xs, p.secs) for p in m.proxies)]
    if pinned is not None:
        rows += [row("direct, pinned", pinned.direct, pinned.direct_s), *(row(p.name, p.xs, p.secs)
                                                                          for p in pinned.proxies)]
    lines = [
        *head,
        f"load: {args.streams} concurrent streams x {args.requests} requests x {args.rounds} round(s), "
        f"{args.chunks} SSE chunks {1000 * args.pace:g} ms apart (~4 KB request bodies)"
        + (f"; a prompt route on {100 * args.prompt:g} % of the conversations: {sum(x[2] for x in proxied.xs):,} of "
           f"{len(proxied.xs):,} answers rewritten and marked" if args.prompt is not None else "")
        + (f"; baseline: the proxy of {args.baseline}, "
           + ("with the same prompt route" if getattr(args, "baseline_prompt", False) else "no prompt route")
           if args.baseline else "")
        + (f"; harness {args.harness}" if hasattr(args, "harness") else ""),
        *harness.table(rows, header=("", "TTFB p50", "TTFB p99", "total p50", "total p99", "req/s")),
        *spread(args, m, ""),
        *([m.machine.line()] if m.machine is not None else []),
    ]
    if pinned is not None:
        over, worst = overhead(pinned, pinned.proxies[0])
        cpus = sorted(os.sched_getaffinity(0))
        lines += [*spread(args, pinned, ", pinned"),
                  "  pinned overhead: " + ", ".join(f"{k} {v:+.2f} ms" for k, v in over.items()),
                  f"  pinned p99 overhead at {args.streams} streams (the proxy alone on CPU {cpus[-1]}, the stub and "
                  f"the load generator on the others; not the target line): {worst:.2f} ms ({T_OVERHEAD.check(worst)})"
                  + (f"; others used {100 * busy:.0f} % of the CPUs meanwhile: contended, not a verdict"
                     if (busy := pinned.proxies[0].others / pinned.proxies[0].secs / os.cpu_count()) > QUIET else "")]
    for p in m.proxies[1:] + m.proxies[:1]:  # this proxy's lines last, its target line the report's last
        over, worst = overhead(m, p)
        who = "" if p is proxied else "baseline "
        rewriting = ("" if args.prompt is None or (p is not proxied and not getattr(args, "baseline_prompt", False))
                     else f", prompt rewriting on {100 * args.prompt:g} % of the conversations")
        lines += [
            f"  {who}overhead: " + ", ".join(f"{k} {v:+.2f} ms" for k, v in over.items()),
            f"  {who or 'proxy '}CPU: {1000 * p.cpu / len(p.xs):.3f} ms per proxied request (its process only: "
            f"{p.cpu:.2f} CPU-s for {len(p.xs)} requests), peak RSS {p.rss_mib:.0f} MiB, event loop {p.loop}",
            *([f"  {who or 'proxy '}system calls: {p.reads / len(p.xs):.1f} reads and {p.writes / len(p.xs):.1f} writes "
               f"per proxied request of {args.chunks} events (/proc/PID/io; the least is a read and a write per "
               f"event, plus the request's)"] if p.reads else []),
            *([f"  {who or 'proxy '}collector passes in its phases: {sum(v[0] for v in p.gc.values()):.0f}, "
               f"{1000 * sum(v[1] for v in p.gc.values()):.1f} ms in all ("
               + ", ".join(f"gen{g} {v[0]:.0f} / {1000 * v[1]:.1f} ms" for g, v in sorted(p.gc.items()))
               + f"), {sum(v[2] for v in p.gc.values()):.0f} of them over 2 ms"
               + (": each stalls every stream in flight" if not p.stalls else "")]
              if p.gc else []),
            *([f"  {who or 'proxy '}collector passes with requests in flight (a stall of every stream): "
               f"{p.stalls['n']:.0f}, {1000 * p.stalls.get('s', 0.0):.1f} ms in all, "
               f"{p.stalls['n'] - p.stalls.get('le=0.002', 0.0):.0f} over 2 ms, the largest {largest_ms(p.stalls)}"]
              if p.stalls else []),
            f"  others on this machine during the {who}proxied rounds: {p.others:.2f} CPU-s "
            f"({100 * p.others / p.secs / os.cpu_count():.0f} % of the CPUs)",
            f"  {who}p99 overhead at {args.streams} streams{rewriting}: {worst:.2f} ms ({T_OVERHEAD.check(worst)})"
            + (f"; others used {100 * busy:.0f} % of the CPUs meanwhile: contended, not a verdict (re-run on a "
               f"quiet machine)" if (busy := p.others / p.secs / os.cpu_count()) > QUIET else ""),
        ]
    return lines


# --- the prompt arm's parts, apart ----------------------------------------------------------


def cpu_us(steps: dict, n: int, passes: int = 5) -> dict[str, float]:
    """CPU microseconds per call of each step f(i), i in range(n): the best of
    `passes`, the steps taking turns in each pass so that a burst of others' work
    lands on one pass of each, not on every pass of one."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(passes):
        for name, (f, k) in steps.items():
            t0 = time.process_time()
            for i in range(k):
                f(i)
            best[name] = min(best[name], (time.process_time() - t0) / k)
    return {name: 1e6 * v for name, v in best.items()}


def parts(args: argparse.Namespace, tmp: Path) -> list[str]:
    """What a prompt route adds per request, step by step, with this checkout's route
    code on the load's own request (its system prompt matched) and stream (the stub's
    events): the decision as the proxy makes it (`Proxy._plan`: body read, prompt
    matched, sticky key, both choices, edits, log lines as configured) with and
    without the prompt route, the edit's splice, and the mark on every event."""
    import logging
    from types import SimpleNamespace

    from multidict import CIMultiDict

    from nightshift.route.choose import choose, sticky_key
    from nightshift.route.config import RouteConfig
    from nightshift.route.mark import StreamMarker, tag
    from nightshift.route.metrics import Metrics
    from nightshift.route.proxy import Proxy
    from nightshift.route.rewrite import edited, read
    from nightshift.route.table import RouteTable, parse
    from nightshift.schemas.prompt_identity import system_id, version_id

    share = 0.5 if args.prompt is None else args.prompt
    handler = logging.StreamHandler(open(os.devnull, "w"))  # formatted and written, as the proxy's lines are
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log_ = logging.getLogger("nightshift.route")
    log_.addHandler(handler)
    log_.setLevel(logging.INFO)
    log_.propagate = False
    n = 2000
    bodies = [(r := request_body("agent", i))[r.index(b"\r\n\r\n") + 4:] for i in range(n)]
    request = SimpleNamespace(method="POST", headers=CIMultiDict())
    candidate = SYSTEM + "Check each tool result before you answer."

    def proxy(prompt_share: float | None) -> Proxy:
        table = RouteTable(tmp / f"routes-{prompt_share}.json")
        table.put("agent", parse("agent", {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5}))
        if prompt_share is not None:
            table.put(f"prompt:{system_id([SYSTEM])}", parse(f"prompt:{system_id([SYSTEM])}", {
                "kind": "prompt", "candidate": system_id([candidate]), "system": candidate, "share": prompt_share,
                "version": version_id([candidate], [])}))
        return Proxy(RouteConfig(state=str(table.path)), table, Metrics())

    plain, serving, cand = proxy(None), proxy(0.0), proxy(1.0)
    plans = [cand._plan(request, b) for b in bodies]
    assert all(p[4] for p in plans), "the candidate arm made no edits"
    route = cand.table.prompts[system_id([SYSTEM])]
    parsed = [read(b) for b in bodies]
    match = cand.prompts.find(parsed[0], cand.table.prompts)
    keys = [sticky_key(request.headers, p.obj)[1] for p in parsed]
    Stub.chunks = args.chunks
    events = [f.split(b"\r\n", 1)[1].removesuffix(b"0\r\n\r\n")[:-2] for f in Stub().sse("agent@v0002")]
    marks = f"the answer's mark, {len(events)} events"

    def stream(_: int) -> None:
        m = StreamMarker(tag(route.version))
        for e in events:
            m.feed(e)
        m.flush()

    t = cpu_us({
        "decision, no prompt route (Proxy._plan)": (lambda i: plain._plan(request, bodies[i]), n),
        "decision, prompt route, serving arm": (lambda i: serving._plan(request, bodies[i]), n),
        "decision, prompt route, candidate arm": (lambda i: cand._plan(request, bodies[i]), n),
        "  of which: body read (every routed request)": (lambda i: read(bodies[i]), n),
        "  of which: prompt matched (PromptRouter.find)": (lambda i: cand.prompts.find(parsed[i],
                                                                                    cand.table.prompts), n),
        "  of which: the prompt route's choice": (lambda i: choose(route, keys[i]), n),
        "  of which: the candidate's edits": (lambda i: cand.prompts.edits(match, parsed[i]), n),
        "the body spliced (model and prompt)": (lambda i: edited(bodies[i], [(*parsed[i].model_span(),
                                                                              b'"agent@v0002"'), *plans[i][4]]), n),
        marks: (stream, n // 4),
    }, n)
    added = (t["decision, prompt route, serving arm"] * (1 - share) + t["decision, prompt route, candidate arm"]
             * share - t["decision, no prompt route (Proxy._plan)"]
             + share * t[marks])
    log_.removeHandler(handler)
    return [*(f"  {k:55s} {v:7.1f} us per request" for k, v in t.items()),
            f"  {'  = per marked event':55s} {t[marks] / len(events):7.2f} us",
            f"  prompt route on {100 * share:g} % of the conversations: +{added:.1f} us of CPU per request "
            f"(decisions at that share, less the decision without it, plus the share's marks)"]


def main() -> int:
    args = parse_args()
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        print("--pin needs at least 2 CPUs (the proxy on one, the stub and the load generator on the rest)",
              file=sys.stderr)
        return 2
    if args.stub:
        stub(args.stub, args.chunks, args.pace, args.harness == "steady")
        return 0
    shown = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "stub"})
    head = [*harness.header("nightshift route overhead benchmark", shown), before_run()]
    with harness.sigterm_as_interrupt(), harness.temp_dir("nightshift-bench-route-") as tmp:
        if args.parts:
            print("\n".join([*head, *parts(args, tmp)]), flush=True)
            return 0
        m = measure(args, tmp)
    if args.dump:
        Path(args.dump).write_text(json.dumps({"direct": m.direct, "proxies": {p.name: p.xs for p in m.proxies},
                                               "again": m.again,
                                               "phases": [vars(ph) for ph in m.phases]}))
    print("\n".join(report(head, args, m)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
