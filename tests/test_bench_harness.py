"""The benchmarks' shared harness (benchmarks/harness.py): targets judged the same
way on both sides of their threshold, the table printer's columns, the shared
flags; and the benchmark scripts' imports: no cycle, the workload in a module of
its own, nothing but the standard library where a peer's virtualenv imports it."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
#: The scripts moved onto the harness (issue 17).
SCRIPTS = ("ingest", "transform", "train_gpu", "publish", "learning", "peer_agl", "peer_phoenix", "route", "upkeep", "prompts")


def _load(name: str):
    """A benchmarks module by its path, under a name no other test uses."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


@pytest.fixture(scope="module")
def h():
    return _load("harness")


# --------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op, threshold, met, not_met", [
    (">=", 100_000, [100_000, 100_001, 1e9], [99_999, 0, -1]),
    (">", 0.3, [0.31, 5], [0.3, 0.29]),
    ("<", 20.0, [19.9, 0, -3], [20.0, 20.1]),  # lower is better
    ("<=", 0, [0, -1], [1, 0.001]),
])
def test_target_verdicts_on_both_sides(h, op, threshold, met, not_met):
    t = h.Target(op, threshold)
    for v in met:
        assert t.met(v) and t.verdict(v) == "[met]", (op, threshold, v)
    for v in not_met:
        assert not t.met(v) and t.verdict(v) == "[NOT met]", (op, threshold, v)


def test_target_not_measured_is_not_met(h):
    for op in (">=", ">", "<=", "<"):
        assert h.Target(op, 1.0).verdict(float("nan")) == "[NOT met]"


def test_target_reads_as_printed(h):
    t = h.Target(">=", 100_000, "100,000 per core")
    assert str(t) == "target >= 100,000 per core"
    assert t.check(120_000) == "target >= 100,000 per core: [met]"
    assert t.check(99_000) == "target >= 100,000 per core: [NOT met]"
    assert h.Target(">=", 0.3).check(0.2) == "target >= 0.3: [NOT met]"
    named = h.Target(">=", 5, "acknowledged (5 spans/s)", name="sustained")
    assert named.check(4) == "sustained >= acknowledged (5 spans/s): [NOT met]"
    assert h.verdict(True) == "[met]" and h.verdict(False) == "[NOT met]"


def test_target_refuses_an_unknown_comparison(h):
    with pytest.raises(ValueError, match="op"):
        h.Target("=>", 1)


# --------------------------------------------------------------------------------------
# Table
# --------------------------------------------------------------------------------------


def test_table_columns_as_wide_as_their_widest_cell(h):
    lines = h.table([("nightshift pg", "54,885", "4"), ("trl sft default", "7", "12")],
                    header=("run", "tokens/s", "steps"))
    assert lines == [
        "  run              tokens/s  steps",
        "  nightshift pg      54,885      4",
        "  trl sft default         7     12",
    ]
    # every column starts and ends at the same place on every line
    ends = {len(x) for x in lines}
    assert ends == {len(lines[0])}


def test_table_alignment_and_unpadded_last_column(h):
    lines = h.table([("spans", "20,000"), ("transitions written", "12,500 in 3 file(s)")], align="<<")
    assert lines == ["  spans                20,000", "  transitions written  12,500 in 3 file(s)"]
    right = h.table([("a", "1", "x"), ("bbb", "22", "long note")], align="<><", indent="", sep=" ")
    assert right == ["a    1 x", "bbb 22 long note"]


def test_table_rejects_a_wrong_alignment(h):
    with pytest.raises(ValueError, match="align"):
        h.table([("a", "b")], align="<")
    with pytest.raises(ValueError, match="align"):
        h.table([("a", "b")], align="<^")
    assert h.table([]) == []


def test_report_helpers(h):
    assert h.fmt(1234567.4) == "1,234,567" and h.fmt(float("nan")) == "n/a"
    values = [float(i) for i in range(1, 101)]
    assert (h.pct(values, 50), h.pct(values, 99), h.pct(values, 100)) == (50.0, 99.0, 100.0)
    assert h.pct([], 50) != h.pct([], 50)  # NaN


def test_header_names_the_machine_and_the_run(h):
    lines = h.header("nightshift x benchmark", argparse.Namespace(seconds=2.0, peer=None), versions=("polars 1",),
                     busy_seconds=0.05)
    assert lines[0] == "nightshift x benchmark"
    assert lines[1].startswith("date: ") and ", commit " in lines[1]
    assert lines[2].startswith("host: ") and "logical CPUs" in lines[2] and "GiB RAM" in lines[2]
    assert lines[3].startswith("python: ") and lines[3].endswith(", polars 1")
    assert lines[4] == "args: seconds=2.0 peer=None"
    assert lines[5].startswith("CPU busy before start (other processes): ")
    assert h.busy_cores(0.05) >= 0.0


# --------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------


def test_parser_adds_only_the_flags_asked_for(h):
    bare = h.parser("Title line.\n\nMore text.")
    assert bare.description == "Title line."
    assert vars(bare.parse_args([])) == {}
    ap = h.parser("Doc.", seed=7, temp_dir=True, keep=True, peer={"phoenix": "Arize Phoenix"})
    assert vars(ap.parse_args([])) == {"seed": 7, "dir": None, "keep": False, "peer": None}
    got = ap.parse_args(["--seed", "3", "--dir", "/x", "--keep", "--peer", "phoenix"])
    assert (got.seed, got.dir, got.keep, got.peer) == (3, "/x", True, "phoenix")
    with pytest.raises(SystemExit):
        ap.parse_args(["--peer", "nope"])


def test_workload_flags_keep_their_defaults():
    import argparse as _argparse

    load, st = _load("otlp_load"), _load("synth_traces")
    ap = _argparse.ArgumentParser()
    load.add_load_flags(ap)
    assert vars(ap.parse_args([])) == {"seconds": 10.0, "senders": 4, "spans_per_request": 512, "templates": 8}
    ap = _argparse.ArgumentParser()
    st.add_shape_flags(ap)
    args = ap.parse_args(["--prompt-chars", "60"])
    d = st.Params()
    assert st.shape_of(args) == {**{k: getattr(d, k) for k in st.SHAPE_FLAGS}, "prompt_chars": 60}


def test_sender_tally_sums_and_sorts():
    import array

    load = _load("otlp_load")
    sent = load.Sent()
    reply = {"acked_spans": 10, "acked_reqs": 2, "refused": 1, "errors": 0, "rejected": 0, "late": 0, "sent": 3,
             "cpu": 0.5, "last_done": 7.0, "lat": array.array("d", [3.0, 1.0]).tobytes(), "sched": b""}
    sent.add_all([reply, {**reply, "last_done": 9.0, "lat": array.array("d", [2.0]).tobytes()}])
    assert (sent.acked_spans, sent.acked_reqs, sent.refused, sent.sent) == (20, 4, 2, 6)
    assert sent.sender_cpu == 1.0 and sent.last_done == 9.0 and sent.lat == [1.0, 2.0, 3.0]


def test_templates_get_fresh_ids_every_send():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    load = _load("otlp_load")
    a, b = load.build_templates(2, 6)
    assert a.data != b.data and (a.spans, b.spans) == (6, 6)
    assert load.build_templates(1, 6)[0].span_sizes == a.span_sizes  # same seeds, same content (times aside)

    def ids(body: bytes) -> set:
        req = ExportTraceServiceRequest.FromString(body)
        return {(s.trace_id, s.span_id) for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans}

    buf = bytearray(a.data)
    first, second = ids(a.fresh(buf)), ids(a.fresh(buf))
    assert len(first) == len(second) == 6 and not first & second


def test_route_keeps_its_flags_rank_and_report(monkeypatch):
    """benchmarks/route.py on the harness: the flags it always had, the rank its
    percentiles always used (its figures compare with earlier reports), its target
    through Target and its table through harness.table."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ and the repo first
    route = _load("route")
    monkeypatch.setattr(sys, "argv", ["route.py"])
    assert vars(route.parse_args()) == {"streams": 200, "requests": 8, "rounds": 3, "chunks": 20, "pace": 0.025,
                                        "stub": None, "prompt": None, "baseline": None, "baseline_env": [],
                                        "parts": False, "harness": "steady", "pin": False, "aa": False, "dump": None}
    values = [float(i) for i in range(100, 0, -1)]
    assert (route.quantile(values, .5), route.quantile(values, .99)) == (51.0, 100.0)
    assert str(route.T_OVERHEAD) == "target < 2 ms"
    assert route.T_OVERHEAD.met(1.99) and not route.T_OVERHEAD.met(2.0)

    m = route.Measured(direct=[(0.010, 0.500)] * 10, direct_s=1.0, proxies=[route.Proxied(
        "proxied", [(0.011, 0.503, False)] * 10, secs=2.0, cpu=0.02, others=0.0, rss_mib=40.0)])
    args = argparse.Namespace(streams=10, requests=1, rounds=1, chunks=20, pace=0.025, prompt=None, baseline=None)
    lines = route.report(["title"], args, m)
    assert lines[0] == "title" and lines[1].startswith("load: 10 concurrent streams x 1 requests x 1 round(s)")
    assert lines[2].split() == ["TTFB", "p50", "TTFB", "p99", "total", "p50", "total", "p99", "req/s"]
    assert lines[3].split() == ["direct", "10.00", "ms", "10.00", "ms", "500.00", "ms", "500.00", "ms", "10"]
    assert lines[4].split() == ["proxied", "11.00", "ms", "11.00", "ms", "503.00", "ms", "503.00", "ms", "5"]
    assert len({len(x) for x in lines[2:5]}) == 1  # one column grid
    assert lines[-1] == "  p99 overhead at 10 streams: 3.00 ms (target < 2 ms: [NOT met])"
    assert "  proxy CPU: 2.000 ms per proxied request (its process only: 0.02 CPU-s for 10 requests), peak RSS 40 MiB, event loop asyncio" \
        in lines

    m.proxies.append(route.Proxied("baseline", [(0.0105, 0.501, False)] * 10, secs=2.0, cpu=0.01, rss_mib=30.0))
    args.baseline = "/tmp/wt-e0ac2ad"
    lines = route.report(["title"], args, m)
    assert lines[5].split()[:2] == ["baseline", "10.50"]  # a row of its own, measured in the same rounds
    assert "  baseline p99 overhead at 10 streams: 1.00 ms (target < 2 ms: [met])" in lines
    assert lines[-1] == "  p99 overhead at 10 streams: 3.00 ms (target < 2 ms: [NOT met])"  # this proxy's, still last


# --------------------------------------------------------------------------------------
# Imports
# --------------------------------------------------------------------------------------


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(every module a file imports, anywhere in it; those imported at its top level)."""
    tree = ast.parse(path.read_text())
    every, top = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = {node.module.split(".")[0]}
        else:
            continue
        every |= names
        if node in tree.body:
            top |= names
    return every, top


def _graph() -> dict[str, set[str]]:
    files = {p.stem: p for p in BENCH.glob("*.py")}
    return {name: _imports(p)[0] & set(files) - {name} for name, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_finds_one():
    assert _cycle({"ingest": {"peer_phoenix"}, "peer_phoenix": {"ingest"}}) == ["ingest", "peer_phoenix", "ingest"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_benchmark_imports_another_in_a_cycle():
    graph = _graph()
    assert {"harness", "otlp_load", "ingest", "peer_phoenix"} <= set(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert "ingest" not in graph["peer_phoenix"]  # the peer's workload comes from otlp_load
    assert graph["harness"] == set() and graph["otlp_load"] == set()


def test_scripts_stand_on_the_harness():
    graph = _graph()
    for name in SCRIPTS:
        assert "harness" in graph[name], name
    assert "otlp_load" in graph["ingest"] and "otlp_load" in graph["peer_phoenix"]


@pytest.mark.parametrize("name", ["harness", "peer_venv", "synth_traces"])
def test_imported_inside_a_peer_venv_with_the_standard_library_only(name):
    _, top = _imports(BENCH / f"{name}.py")
    outside = {m for m in top if m not in sys.stdlib_module_names and m != "__future__"}
    assert not outside, f"{name}.py imports {outside} at its top; benchmarks/peer_agl.py runs it in Agent Lightning's venv"
