#!/usr/bin/env python
"""Fuzzing campaign: the collector's request handling against generated and
mutated requests, each checked against the status code the OTLP spec demands.

    python tests/hardening/fuzz.py                      # 1,000,000 cases, in process, every core
    python tests/hardening/fuzz.py --cases 20000 --wire 3000   # and 3,000 over real sockets
    python tests/hardening/fuzz.py --replay 17:4242     # one case again, printed
    python tests/hardening/fuzz.py --write-docs         # the figures into docs/RELIABILITY.md

In process, each case goes through exactly what the servers run, minus the socket:
the HTTP POST handler (`http_server.make_post`: path, token, content type,
decompression with its size cap, protobuf or OTLP/JSON, per-record validation,
redaction, the write-ahead log) and, for protobuf bodies, the gRPC Export handler
(`grpc_server.make_export`, with a stand-in for grpc's ServicerContext). Every
`--flush-every` cases the log is sealed and flushed to Parquet by the flusher's own
code, so a request that is acknowledged but cannot be stored (a poison record that
would stall the flusher) is found too.

Checked on every case: the answer is in the set the spec allows for what was
sent (never 500 or an exception), partial success rejects exactly the records
the generator broke, no case takes longer than `--hang-s`; per worker: the
records the flusher read equal the records acknowledged, and memory after the
last chunk against after the first. `--wire N` sends N cases (and malformed HTTP
framing) to a real `nightshift collect` process over loopback, then checks it is
still healthy, drains on SIGTERM with exit 0, and stored what it acknowledged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases as C  # noqa: E402

LIMIT = 4 << 20  # the size cap in the campaign: small, so bombs and huge counts reach it cheaply


@dataclass
class Failure:
    case_id: str
    kind: str
    transport: str
    expected: str
    got: str
    detail: str = ""


@dataclass
class ChunkResult:
    cases: int = 0
    grpc_cases: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_code: dict[str, int] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    crashes: int = 0  # 500, INTERNAL or UNKNOWN, or an exception out of a handler
    wrong_code: int = 0
    wrong_rejected: int = 0
    hangs: int = 0
    slowest_s: float = 0.0
    slowest_kind: str = ""
    acknowledged: int = 0
    flushed: int = 0  # rows written + duplicates dropped by the flusher
    flush_errors: int = 0
    rss_mib: float = 0.0
    pid: int = 0
    seconds: float = 0.0


class _Abort(RuntimeError):
    """What StandInContext.abort raises, as grpc's real context raises an exception to end the call."""


class StandInContext:
    """The part of grpc.ServicerContext the Export handler uses (named as a stand-in:
    the wire campaign runs the real one)."""

    def __init__(self) -> None:
        self.code = None
        self.trailers: tuple = ()

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, md) -> None:
        self.trailers = md

    def abort(self, code, details) -> None:
        self.code = code
        raise _Abort(details)


class _Hang(Exception):
    pass


def _on_alarm(*_):
    raise _Hang()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rejected_in(body: bytes, content_type: str, path: str) -> int:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceResponse
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

    if content_type == C.JS:
        ps = json.loads(body).get("partialSuccess", {})
        return int(ps.get("rejectedSpans", ps.get("rejectedLogRecords", 0)))
    if path.endswith("traces"):
        return ExportTraceServiceResponse.FromString(body).partial_success.rejected_spans
    if path.endswith("logs"):
        return ExportLogsServiceResponse.FromString(body).partial_success.rejected_log_records
    return 0


class Target:
    """A real pipeline over a real write-ahead log (fsync off: the campaign is about
    parsing, not disks), with the default redaction presets."""

    def __init__(self, root: Path):
        from nightshift.collector import grpc_server, http_server, wal
        from nightshift.collector.metrics import Metrics
        from nightshift.collector.pipeline import Pipeline
        from nightshift.collector.redact import DEFAULT_PRESETS, Redactor

        self.root = root
        self.wal_dir = root / "wal"
        self._wal = wal
        self.log = wal.WriteAheadLog(self.wal_dir, segment_bytes=64 << 20, roll_interval=3600, cap_bytes=1 << 40, sync=False)
        self.log.open()
        self.pipeline = Pipeline(self.log, Redactor.from_config(list(DEFAULT_PRESETS), [], []), Metrics(), 64)
        self.post = http_server.make_post(self.pipeline, token="", limit=LIMIT)
        self.exports = {s: grpc_server.make_export(s, self.pipeline, "", LIMIT) for s in ("traces", "logs", "metrics")}

    def acknowledged(self) -> int:
        acc = self.pipeline.metrics.accepted
        return int(sum(acc.labels(s)._value.get() for s in ("traces", "logs", "feedback")))

    def flush(self) -> tuple[int, str]:
        """Seals the log and runs the flusher's code on every segment into a fresh
        dataset folder. Returns (records read, error or '')."""
        from nightshift.collector.datasets import DatasetStore
        from nightshift.collector.flusher import flush_segment

        self.log.close()
        data = self.root / "data"
        n, err = 0, ""
        try:
            store = DatasetStore(str(data))
            for seg in self._wal.sealed_segments(self.wal_dir):
                r = flush_segment(seg, store)
                n += r.spans + r.logs + r.feedback + r.duplicates
                seg.unlink()
        except Exception as e:  # noqa: BLE001 - a poison record: reported
            err = f"{type(e).__name__}: {e}"[:300]
            for seg in self._wal.sealed_segments(self.wal_dir):
                shutil.copy(seg, self.root.parent / f"poison-{os.getpid()}-{seg.name}")
                seg.unlink()
        shutil.rmtree(data, ignore_errors=True)
        self.log = self._wal.WriteAheadLog(self.wal_dir, segment_bytes=64 << 20, roll_interval=3600, cap_bytes=1 << 40,
                                           sync=False)
        self.log.open()
        self.pipeline.log = self.log
        return n, err

    def close(self) -> None:
        self.log.close()


def run_case(t: Target, case: C.Case, case_id: str, res: ChunkResult, hang_s: float) -> None:
    import grpc

    res.cases += 1
    res.by_kind[case.kind] = res.by_kind.get(case.kind, 0) + 1
    t0 = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        try:
            r = t.post(case.path, case.headers(), lambda: case.body, "fuzz")
            code, detail = r.code, r.body[:200].decode("utf-8", "replace")
        except _Hang:
            res.hangs += 1
            res.failures.append(Failure(case_id, case.kind, "http", sorted(case.expect).__str__(), "hang"))
            return
        except Exception as e:  # noqa: BLE001 - the handler must never raise
            code, detail = -1, f"{type(e).__name__}: {e}"
        res.by_code[str(code)] = res.by_code.get(str(code), 0) + 1
        if code in (500, -1):
            res.crashes += 1
            res.failures.append(Failure(case_id, case.kind, "http", str(sorted(case.expect)), str(code), detail))
        elif code not in case.expect:
            res.wrong_code += 1
            res.failures.append(Failure(case_id, case.kind, "http", str(sorted(case.expect)), str(code), detail))
        elif code == 200 and case.rejected is not None and not case.path.endswith(("metrics", "feedback")):
            got = _rejected_in(r.body, r.content_type, case.path)
            if got != case.rejected:
                res.wrong_rejected += 1
                res.failures.append(Failure(case_id, case.kind, "http", f"rejected {case.rejected}", f"rejected {got}"))
        signal_name = case.path.rsplit("/", 1)[-1]
        if case.grpc and case.encoding is None and case.content_type == C.PB and signal_name in t.exports:
            res.grpc_cases += 1
            ctx = StandInContext()
            want = {C.grpc_code_for(c) for c in case.expect}
            try:
                t.exports[signal_name](case.body, ctx)
                got_g = "OK"
            except _Abort:
                got_g = ctx.code.name if isinstance(ctx.code, grpc.StatusCode) else str(ctx.code)
            except _Hang:
                res.hangs += 1
                res.failures.append(Failure(case_id, case.kind, "grpc", str(sorted(want)), "hang"))
                return
            except Exception as e:  # noqa: BLE001
                got_g = f"exception {type(e).__name__}: {e}"
            res.by_code["grpc:" + got_g.split(":")[0]] = res.by_code.get("grpc:" + got_g.split(":")[0], 0) + 1
            if got_g in ("INTERNAL", "UNKNOWN") or got_g.startswith("exception"):
                res.crashes += 1
                res.failures.append(Failure(case_id, case.kind, "grpc", str(sorted(want)), got_g))
            elif got_g not in want:
                res.wrong_code += 1
                res.failures.append(Failure(case_id, case.kind, "grpc", str(sorted(want)), got_g))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        dt = time.perf_counter() - t0
        if dt > res.slowest_s:
            res.slowest_s, res.slowest_kind = dt, case.kind


def case_for(seed: int, index: int) -> C.Case:
    return C.generate(random.Random(seed * 1_000_003 + index), LIMIT)


def run_chunk(args: tuple[int, int, int, float, str]) -> ChunkResult:
    """Cases `seed:0` .. `seed:n-1` against a fresh target."""
    seed, n, flush_every, hang_s, tmp = args
    signal.signal(signal.SIGALRM, _on_alarm)
    root = Path(tempfile.mkdtemp(prefix=f"chunk-{seed}-", dir=tmp))
    res = ChunkResult(pid=os.getpid())
    t0 = time.perf_counter()
    t = Target(root)
    try:
        since = 0
        for i in range(n):
            run_case(t, case_for(seed, i), f"{seed}:{i}", res, hang_s)
            since += 1
            if since >= flush_every or i == n - 1:
                since = 0
                read, err = t.flush()
                res.flushed += read
                if err:
                    res.flush_errors += 1
                    res.failures.append(Failure(f"{seed}:<={i}", "flush", "flusher", "stored", err))
        res.acknowledged = t.acknowledged()
    finally:
        t.close()
        shutil.rmtree(root, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    res.rss_mib = _rss_mib()
    return res


def campaign(cases: int, seed: int = 1, jobs: int = 1, chunk: int = 2000, flush_every: int = 500,
             hang_s: float = 10.0, progress: bool = True) -> dict:
    """Runs `cases` cases in chunks over `jobs` processes; returns the summary."""
    tmp = tempfile.mkdtemp(prefix="nightshift-fuzz-")
    n_chunks = max(1, -(-cases // chunk))
    work = [(seed * 100_000 + k, min(chunk, cases - k * chunk), flush_every, hang_s, tmp) for k in range(n_chunks)]
    t0 = time.time()
    results: list[ChunkResult] = []
    try:
        if jobs <= 1:
            it = map(run_chunk, work)
            pool = None
        else:
            # spawn, not fork: the parent goes on to use sockets, threads and grpc afterwards
            pool = mp.get_context("spawn").Pool(jobs, maxtasksperchild=None)
            it = pool.imap_unordered(run_chunk, work)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, total=len(work), unit="chunk", desc=f"fuzz ({chunk} cases/chunk)", file=sys.stderr)
        for r in it:
            results.append(r)
        if pool:
            pool.close()
            pool.join()
        poison = sorted(Path(tmp).glob("poison-*"))
        for p in poison:  # kept for replay
            shutil.copy(p, Path.cwd() / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarize(results, time.time() - t0, jobs)


def summarize(results: list[ChunkResult], wall: float, jobs: int) -> dict:
    out = {"cases": sum(r.cases for r in results), "grpc_cases": sum(r.grpc_cases for r in results),
           "crashes": sum(r.crashes for r in results), "wrong_code": sum(r.wrong_code for r in results),
           "wrong_rejected": sum(r.wrong_rejected for r in results), "hangs": sum(r.hangs for r in results),
           "flush_errors": sum(r.flush_errors for r in results),
           "acknowledged": sum(r.acknowledged for r in results), "flushed": sum(r.flushed for r in results),
           "slowest_s": max((r.slowest_s for r in results), default=0.0),
           "slowest_kind": max(results, key=lambda r: r.slowest_s).slowest_kind if results else "",
           "wall_s": wall, "jobs": jobs}
    kinds: dict[str, int] = {}
    codes: dict[str, int] = {}
    for r in results:
        for k, v in r.by_kind.items():
            kinds[k] = kinds.get(k, 0) + v
        for k, v in r.by_code.items():
            codes[k] = codes.get(k, 0) + v
    out["by_kind"] = dict(sorted(kinds.items()))
    out["by_code"] = dict(sorted(codes.items()))
    by_pid: dict[int, list[ChunkResult]] = {}
    for r in results:
        by_pid.setdefault(r.pid, []).append(r)
    # results arrive in completion order, which per worker is its own order
    out["rss_mib"] = {str(pid): {"after_first_chunk": rs[0].rss_mib, "after_last_chunk": rs[-1].rss_mib, "chunks": len(rs)}
                      for pid, rs in by_pid.items()}
    out["rss_growth_mib"] = max((v["after_last_chunk"] - v["after_first_chunk"] for v in out["rss_mib"].values()), default=0.0)
    out["failures"] = [asdict(f) for r in results for f in r.failures][:50]
    out["lost"] = out["acknowledged"] - out["flushed"]
    return out


def report(s: dict) -> str:
    rss = ", ".join(f"{v['after_first_chunk']:.0f}->{v['after_last_chunk']:.0f} MiB over {v['chunks']} chunks"
                    for v in s["rss_mib"].values())
    lines = [
        f"cases: {s['cases']:,} over HTTP's handler, {s['grpc_cases']:,} of them also over gRPC's "
        f"({s['wall_s']:.0f} s, {s['jobs']} process(es), {s['cases'] / max(s['wall_s'], 1e-9):,.0f} cases/s)",
        f"crashes (500 / INTERNAL / exception): {s['crashes']}",
        f"wrong status code: {s['wrong_code']}",
        f"wrong partial-success count: {s['wrong_rejected']}",
        f"hangs (> hang limit): {s['hangs']}; slowest case {s['slowest_s'] * 1000:.0f} ms ({s['slowest_kind']})",
        f"records acknowledged: {s['acknowledged']:,}; read back by the flusher: {s['flushed']:,} "
        f"(lost: {s['lost']}); flush failures (poison records): {s['flush_errors']}",
        f"memory: RSS growth from first to last chunk, worst worker: {s['rss_growth_mib']:+.1f} MiB "
        f"({rss})",
        "answers: " + ", ".join(f"{k} {v:,}" for k, v in s["by_code"].items()),
        "cases by generator: " + ", ".join(f"{k} {v:,}" for k, v in s["by_kind"].items()),
    ]
    for f in s["failures"][:10]:
        lines.append(f"  FAILURE {f['case_id']} {f['kind']} over {f['transport']}: expected {f['expected']}, got "
                     f"{f['got']} {f['detail'][:160]}")
    return "\n".join(lines)


def ok(s: dict) -> bool:
    return not (s["crashes"] or s["wrong_code"] or s["wrong_rejected"] or s["hangs"] or s["flush_errors"] or s["lost"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cases", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunk", type=int, default=5000, help="cases per fresh target (and per progress step)")
    ap.add_argument("--flush-every", type=int, default=1000)
    ap.add_argument("--hang-s", type=float, default=10.0)
    ap.add_argument("--wire", type=int, default=0, help="also send this many cases to a real collector process")
    ap.add_argument("--replay", help="SEED:INDEX of one case: run it alone and print what happened")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--write-docs", action="store_true", help="put the figures into docs/RELIABILITY.md")
    args = ap.parse_args()
    os.environ.setdefault("NIGHTSHIFT_LOG_LEVEL", "error")
    import logging

    logging.basicConfig(level=logging.CRITICAL)
    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        case = case_for(seed, index)
        print(f"{case.kind}: POST {case.path} {case.headers()} {len(case.body)} bytes, expect {sorted(case.expect)}"
              f"{'' if case.rejected is None else f', {case.rejected} rejected'}")
        print(repr(case.body[:400]))
        res = ChunkResult()
        signal.signal(signal.SIGALRM, _on_alarm)
        with tempfile.TemporaryDirectory() as d:
            t = Target(Path(d))
            run_case(t, case, args.replay, res, args.hang_s)
            print("flusher:", t.flush())
            t.close()
        print(json.dumps([asdict(f) for f in res.failures], indent=1) if res.failures else "as expected")
        return 1 if res.failures else 0
    s = campaign(args.cases, args.seed, args.jobs, args.chunk, args.flush_every, args.hang_s)
    print("in-process campaign (hardening/fuzz.py)")
    print(report(s))
    summary = {"in_process": s}
    good = ok(s)
    if args.wire:
        import wire

        w = wire.campaign(args.wire, args.seed)
        print("\nwire campaign (a real `nightshift collect` over loopback)")
        print(wire.report(w))
        summary["wire"] = w
        good = good and wire.ok(w)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.write_docs:
        import docs

        docs.write_section("fuzz", docs.fuzz_section(summary, args))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
