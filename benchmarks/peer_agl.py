#!/usr/bin/env python
"""Peer measurement for the transform benchmark: Agent Lightning 0.3's
`TracerTraceToTriplet` on the same trajectories.

Used by `benchmarks/transform.py --peer agl`, or on its own (from any Python; it
re-runs itself inside the peer's virtualenv):

    python benchmarks/peer_agl.py [--spans 16000] [--calls 5] [--prompt-chars 2000] [--seed 0] ...

What it does:

1. Makes sure Agent Lightning is installed in its own virtualenv (default
   ~/.cache/nightshift-bench/agl-venv, or $NIGHTSHIFT_BENCH_AGL_VENV): reused if
   `import agentlightning` works there, otherwise created with `python -m venv` and
   `pip install agentlightning==0.3.0` (about 40 s, ~790 MB). If that fails, the
   peer is skipped and the report says why.
2. Inside that venv: rebuilds the first trajectories of the benchmark's dataset
   (`synth_traces.trajectory`, same parameters and seed, so the same ids, texts and
   token ids as the Parquet files) in Agent Lightning's layout (with `--mix`, the
   first ones that use it: AGL 0.x reads no other layout), as `Span` objects
   (`Span.from_attributes`, as `shared/research/agent-lightning-bench/bench.py`),
   then times `TracerTraceToTriplet().adapt(spans)` once per trajectory.
3. Prints spans/s and triplets/s of the adapter alone (in memory: no decoding, no
   storage, no output), the cost of building the `Span` objects separately, and
   one JSON line with the figures for transform.py.

LITELLM_LOCAL_MODEL_COST_MAP=True stops litellm fetching a price map at import.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
import peer_venv  # noqa: E402
import synth_traces as st  # noqa: E402
from peer_venv import PeerSkipped  # noqa: E402,F401  (transform.py catches it from here)

DEFAULT_VENV = Path(os.environ.get("NIGHTSHIFT_BENCH_AGL_VENV", Path.home() / ".cache" / "nightshift-bench" / "agl-venv"))
PACKAGE = "agentlightning==0.3.0"
RESULT_PREFIX = "AGL_RESULT "


def log(msg: str) -> None:
    harness.log(msg, "agl peer")


def _clean_env(venv: Path) -> dict:
    return peer_venv.clean_env(venv, LITELLM_LOCAL_MODEL_COST_MAP="True")


def ensure_venv(venv: Path = DEFAULT_VENV) -> tuple[str, float]:
    """(version, seconds spent installing: 0 when reused). Raises PeerSkipped."""
    code = "import importlib.metadata as m, agentlightning.adapter; print(m.version('agentlightning'))"
    version = peer_venv.version(venv, code, timeout=300, env=_clean_env(venv))
    if version:
        return version, 0.0
    log(f"installing {PACKAGE} into {venv} (first time only; about a minute)")
    t0 = time.perf_counter()
    log_path = venv.parent / "agl-install.log"
    peer_venv.install(venv, (PACKAGE,), log_path, env=_clean_env(venv))
    version = peer_venv.version(venv, code, timeout=300, env=_clean_env(venv))
    if not version:
        raise PeerSkipped(f"installed into {venv}, but `import agentlightning.adapter` fails there (log: {log_path})")
    took = time.perf_counter() - t0
    log(f"installed agentlightning {version} in {took:.0f} s")
    return version, took


def run(params: dict, spans: int, venv: Path = DEFAULT_VENV, timeout: float = 1800) -> dict:
    """Install if needed, measure in the venv, return the result dict (see measure()).
    Raises PeerSkipped."""
    version, install_s = ensure_venv(venv)
    cmd = [str(peer_venv.python(venv)), str(Path(__file__).resolve()), "--inside", "--params", json.dumps(params),
           "--spans", str(spans)]
    log(f"agentlightning {version}: adapting about {spans:,} spans (in {venv})")
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout,
                           env=_clean_env(venv), cwd=str(HERE))
    except subprocess.TimeoutExpired:
        raise PeerSkipped(f"the peer run took longer than {timeout:.0f} s") from None
    for line in reversed(r.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            res = json.loads(line[len(RESULT_PREFIX):])
            res["install_s"] = install_s
            res["venv"] = str(venv)
            res["output"] = [x for x in r.stdout.splitlines() if not x.startswith(RESULT_PREFIX)]
            return res
    tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
    raise PeerSkipped(f"the peer run failed (exit {r.returncode}): " + " | ".join(tail))


# --------------------------------------------------------------------------------------
# Inside the venv: measure
# --------------------------------------------------------------------------------------


def measure(params: dict, spans: int) -> dict:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import logging

    logging.disable(logging.WARNING)
    p = st.Params.from_json(params)
    p.check()
    want = max(1, spans // p.spans_per_trajectory)

    t = time.perf_counter()
    import importlib.metadata

    import agentlightning  # noqa: F401
    from agentlightning import Span
    from agentlightning.adapter import TracerTraceToTriplet

    import_s = time.perf_counter() - t

    # The first `want` trajectories of the dataset in Agent Lightning's layout.
    t = time.perf_counter()
    picked, i = [], 0
    while len(picked) < want and i < p.trajectories:
        if st.convention_of(p, i) == st.AGL:
            picked.append(i)
        i += 1
    trajs = [(i, st.trajectory(p, i)) for i in picked]
    synth_s = time.perf_counter() - t

    t = time.perf_counter()
    agl_trajs = []
    for i, tr in trajs:
        rid, aid = f"ro-{i:08d}", f"at-{i:08d}"
        agl_trajs.append([
            Span.from_attributes(rollout_id=rid, attempt_id=aid, sequence_id=seq, trace_id=s["trace_id"],
                                 span_id=s["span_id"], parent_id=s["parent_span_id"], name=s["name"],
                                 attributes={k: v for k, _, v in s["attributes"]},
                                 start_time=s["start_ns"] / 1e9, end_time=s["end_ns"] / 1e9)
            for seq, s in enumerate(tr, 1)
        ])
    spans_s = time.perf_counter() - t
    del trajs
    n_spans = sum(len(x) for x in agl_trajs)

    adapter = TracerTraceToTriplet()
    c0, t0 = time.process_time(), time.perf_counter()
    out = [adapter.adapt(x) for x in agl_trajs]
    adapt_s = time.perf_counter() - t0
    adapt_cpu = time.process_time() - c0
    n_trip = sum(len(o) for o in out)
    rewarded = sum(1 for o in out for x in o if x.reward is not None)
    with_ids = sum(1 for o in out for x in o if x.prompt.get("token_ids") and x.response.get("token_ids"))
    return {
        "version": importlib.metadata.version("agentlightning"),
        "python": sys.version.split()[0],
        "trajectories": len(agl_trajs),
        "spans": n_spans,
        "triplets": n_trip,
        "expected_triplets": len(agl_trajs) * p.calls,
        "rewarded_triplets": rewarded,
        "triplets_with_token_ids": with_ids,
        "import_s": import_s,
        "synth_s": synth_s,
        "span_objects_s": spans_s,
        "adapt_s": adapt_s,
        "adapt_cpu_s": adapt_cpu,
        "spans_per_s": n_spans / adapt_s if adapt_s else float("nan"),
        "spans_per_cpu_s": n_spans / adapt_cpu if adapt_cpu else float("nan"),
        "triplets_per_s": n_trip / adapt_s if adapt_s else float("nan"),
        "span_objects_per_s": n_spans / spans_s if spans_s else float("nan"),
    }


def lines(res: dict) -> list[str]:
    return [
        f"agentlightning {res['version']} (Python {res['python']}), TracerTraceToTriplet() defaults, in memory:",
        f"  {res['trajectories']:,} trajectories, {res['spans']:,} spans -> {res['triplets']:,} triplets "
        f"(expected {res['expected_triplets']:,}; {res['rewarded_triplets']:,} carry the reward, "
        f"{res['triplets_with_token_ids']:,} have token ids)",
        f"  adapt: {res['adapt_s']:.2f} s, {res['spans_per_s']:,.0f} spans/s, {res['triplets_per_s']:,.0f} triplets/s, "
        f"{res['spans_per_cpu_s']:,.0f} spans per CPU-second",
        f"  not timed above: Span objects {res['span_objects_s']:.2f} s ({res['span_objects_per_s']:,.0f} spans/s), "
        f"import agentlightning {res['import_s']:.1f} s",
    ]


def main() -> int:
    ap = harness.parser(__doc__, seed=st.Params().seed)
    ap.add_argument("--spans", type=int, default=16_000, help="spans to adapt (whole trajectories; default 16000)")
    ap.add_argument("--params", help="synth_traces.Params as JSON (transform.py passes its own)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    st.add_shape_flags(ap)
    args = ap.parse_args()
    if args.params:
        params = json.loads(args.params)
    else:
        params = {**st.shape_of(args), "seed": args.seed, "spans": max(args.spans, 1_000_000)}
    if args.inside:
        res = measure(params, args.spans)
        for line in lines(res):
            print(line)
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return 0
    try:
        res = run(params, args.spans, args.venv)
    except PeerSkipped as e:
        print(f"agent lightning peer skipped: {e}")
        return 1
    for line in lines(res):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
