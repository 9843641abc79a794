"""Several collectors, a WAL each, writing one lake with no coordination (issue 28,
item 5): a sidecar per agent pod, or otelcol's load-balancing exporter in front of
N collectors (recipes/otelcol-loadbalancing.yaml). Real `nightshift collect`
processes on a folder and on S3 (moto's server on loopback); each trace's spans
split across the collectors, requests resent to the same collector and to
another one, and `nightshift build` run in a loop while they write.

What must hold: no file name is written by two collectors (the WAL's instance id
is in every name), each collector drops its own retries, a retry that went to
another collector is two rows in the lake and one in the build (it dedups on
read), every trace is one trajectory, and no build, however it falls between
the flushes, sees a half-written file or fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hardening.proc import Collector, counted, drained, free_port
from traces import T0, Trace, genai_call, request

CALLS = 3  # chat calls per trace, under one agent span


def trace(i: int) -> Trace:
    t = Trace(f"side-by-side-{i}")
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=20)
    for k in range(CALLS):
        t.span("chat m1", genai_call(f"task {i} step {k}", f"answer {k}"), parent=root, start=1 + 2 * k, end=2 + 2 * k)
    return t


def part(t: Trace, keep) -> bytes:
    """The request of the spans of `t` that `keep(position)` picks."""
    one = Trace(t.seed)
    one.spans = [s for k, s in enumerate(t.spans) if keep(k)]
    return request([one]).SerializeToString()


def post(c: Collector, body: bytes) -> int:
    req = urllib.request.Request(f"{c.http_url}/v1/traces", data=body, method="POST",
                                 headers={"Content-Type": "application/x-protobuf"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status


@dataclass
class Lake:
    """Where the collectors write, as each process is told and as the test reads it."""

    url: str
    env: dict[str, str] = field(default_factory=dict)  # the collectors' and the build's storage options
    fs: object = None

    def files(self, dataset: str) -> list[str]:
        root = self.url.split("://", 1)[-1]
        return sorted(self.fs.glob(f"{root}/{dataset}/date=*/*.parquet"))

    def read(self, dataset: str, columns: list[str]):
        import pyarrow as pa

        tables = []
        for f in self.files(dataset):
            with self.fs.open(f, "rb") as fh:
                tables.append(pq.read_table(fh, columns=columns))
        return pa.concat_tables(tables) if tables else None


class BuildLoop(threading.Thread):
    """`nightshift build` again and again until stopped: every outcome kept."""

    def __init__(self, lake: Lake):
        super().__init__(daemon=True)
        self.lake, self.runs, self.halt = lake, [], threading.Event()
        self.read_spans = 0  # builds that began with span files in the lake and ended before the load did

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                began_with_files = bool(self.lake.files("spans"))
            except FileNotFoundError:
                began_with_files = False
            self.runs.append(build(self.lake))
            self.read_spans += began_with_files and not self.halt.is_set()


def build(lake: Lake) -> subprocess.CompletedProcess:
    env = {**os.environ, "NIGHTSHIFT_TRANSFORM_SETTLE": "0", **lake.env}
    return subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", lake.url, "--quiet"],
                          capture_output=True, text=True, env=env, timeout=300)


def side_by_side(tmp_path: Path, lake: Lake, n: int, per_round: int = 4, max_rounds: int = 100) -> None:
    """Rounds of traces, split across `n` collectors, until a build has read the lake
    while they wrote (at least 3 rounds; the first one before any retry goes to
    another collector)."""
    collectors = [Collector(lake.url, tmp_path / f"wal-{i}", tmp_path / f"collector-{i}.log",
                            env={k.replace("TRANSFORM", "COLLECTOR"): v for k, v in lake.env.items()})
                  for i in range(n)]
    loop = BuildLoop(lake)
    try:
        for c in collectors:
            c.start(wait=False)
        for c in collectors:
            c.wait_healthy(60)
        same_retries = cross_retries = 0
        traces = []
        for r in range(max_rounds):  # a round every few tenths of a second: flushes land while builds read
            if r >= 3 and loop.read_spans:
                break
            if r == 1:  # each collector's index of the lake loaded (at its first flush), so the
                for c in collectors:  # retries sent elsewhere from now on are found by no collector
                    drained(c, 120)
                loop.start()  # and the builds begin, with files in the lake
            for i in range(r * per_round, (r + 1) * per_round):
                t = trace(i)
                traces.append(t)
                for c in range(n):  # span k of trace i goes to collector (i + k) % n: every trace is split
                    body = part(t, lambda k, c=c: (i + k) % n == c)
                    assert post(collectors[c], body) == 200
                    if i % 3 == 0:  # an exporter's retry after a lost answer: the same collector
                        assert post(collectors[c], body) == 200
                        same_retries += sum((i + k) % n == c for k in range(len(t.spans)))
                    if i % 4 == 1 and c == 0 and r >= 1:  # a retry the load balancer sent elsewhere
                        assert post(collectors[1], body) == 200
                        cross_retries += sum((i + k) % n == 0 for k in range(len(t.spans)))
            time.sleep(0.3)
        else:
            pytest.fail(f"no build read the lake while {max_rounds} rounds of traces were sent")
        dropped = 0
        for c in collectors:
            m = drained(c, 120)
            assert counted(m, "nightshift_flushed") + m.get("nightshift_duplicates_dropped", 0) >= \
                counted(m, "nightshift_accepted_total")
            dropped += m.get("nightshift_duplicates_dropped", 0)
        loop.halt.set()
        if loop.ident:  # started
            loop.join(300)
        with ThreadPoolExecutor(n) as pool:  # SIGTERM to all at once, and the last build meanwhile:
            stopping = [pool.submit(c.stop) for c in collectors]  # every acknowledged span is in the lake
            final = build(lake)
            for c, rc in zip(collectors, stopping):
                assert rc.result() == 0, c.log_tail()
    finally:
        loop.halt.set()
        for c in collectors:
            if c.proc and c.proc.poll() is None:
                c.kill9()

    # no build failed or read a half-written file, and some ran while files were being added
    assert loop.runs, "no build ran beside the collectors"
    for run in loop.runs:
        assert run.returncode in (0, 1) and "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:]
        assert run.returncode == 0 or "no spans dataset" in run.stderr + run.stdout, run.stderr[-3000:]
    assert loop.read_spans >= 1

    # each collector dropped its own retries; one sent to another collector is two rows in the lake
    # (a collector reads the lake's keys once, at its first flush of a date, and then knows only its own)
    spans_per_trace = 1 + CALLS
    assert dropped == same_retries
    lake_rows = lake.read("spans", ["trace_id", "span_id"])
    keys = Counter(zip(lake_rows["trace_id"].to_pylist(), lake_rows["span_id"].to_pylist()))
    assert len(keys) == len(traces) * spans_per_trace
    assert sum(keys.values()) - len(keys) == cross_retries > 0
    # every collector wrote files of its own: its WAL's instance id in each name, never another's
    ids = [(tmp_path / f"wal-{i}" / "instance").read_text().strip() for i in range(n)]
    names = [f.rsplit("/", 1)[-1] for f in lake.files("spans")]
    assert len(set(ids)) == n and all(sum(f"-{x}-" in name for x in ids) == 1 for name in names)
    assert {x for x in ids if any(f"-{x}-" in name for name in names)} == set(ids)

    # the last build, once everything acknowledged was in the lake: one trajectory per trace, each call once
    assert final.returncode == 0, final.stderr[-3000:]
    rows = lake.read("transitions", ["trajectory_id", "trace_id", "span_id"])
    assert rows.num_rows == len(traces) * CALLS
    assert len(set(zip(rows["trace_id"].to_pylist(), rows["span_id"].to_pylist()))) == rows.num_rows
    by_trajectory: dict[str, set] = {}
    for traj, tid in zip(rows["trajectory_id"].to_pylist(), rows["trace_id"].to_pylist()):
        by_trajectory.setdefault(traj, set()).add(tid)
    assert len(by_trajectory) == len(traces)
    assert sorted(tuple(v) for v in by_trajectory.values()) == sorted((t.hex,) for t in traces)


def test_three_collectors_one_data_folder_with_a_build_in_a_loop(tmp_path):
    import fsspec

    lake = Lake(str(tmp_path / "data"), fs=fsspec.filesystem("file"))
    side_by_side(tmp_path, lake, n=3)


@pytest.fixture
def s3_lake():
    """A bucket on moto's S3 server on loopback, and the storage options that reach it."""
    import logging

    import boto3
    import fsspec
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log
    endpoint = {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"}
    boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing", **endpoint) \
        .create_bucket(Bucket="lake")
    options = {"key": "testing", "secret": "testing", "client_kwargs": endpoint}
    fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False, **options)
    try:
        yield Lake("s3://lake/data", {"NIGHTSHIFT_TRANSFORM_STORAGE_OPTIONS": json.dumps(options)}, fs)
    finally:
        server.stop()


def test_two_collectors_one_s3_bucket_with_a_build_in_a_loop(tmp_path, s3_lake):
    side_by_side(tmp_path, s3_lake, n=2)
