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
DEFAULT_VENV = Path(os.environ.get("NIGHTSHIFT_BENCH_AGL_VENV", Path.home() / ".cache" / "nightshift-bench" / "agl-venv"))
PACKAGE = "agentlightning==0.3.0"
RESULT_PREFIX = "AGL_RESULT "


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] agl peer: {msg}", file=sys.stderr, flush=True)


class PeerSkipped(Exception):
    """The peer could not be measured; the message says why."""


# --------------------------------------------------------------------------------------
# Outside the venv: install and run
# --------------------------------------------------------------------------------------


def _clean_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _version(venv: Path) -> str | None:
    py = _python(venv)
    if not py.exists():
        return None
    code = "import importlib.metadata as m, agentlightning.adapter; print(m.version('agentlightning'))"
    try:
        r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300, env=_clean_env(venv))
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = r.stdout.strip().splitlines()
    return out[-1] if r.returncode == 0 and out else None


def ensure_venv(venv: Path = DEFAULT_VENV) -> tuple[str, float]:
    """(version, seconds spent installing: 0 when reused). Raises PeerSkipped."""
    version = _version(venv)
    if version:
        return version, 0.0
    log(f"installing {PACKAGE} into {venv} (first time only; about a minute)")
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    log_path = venv.parent / "agl-install.log"
    with open(log_path, "wb") as lf:
        steps = []
        if not _python(venv).exists():
            steps.append([sys.executable, "-m", "venv", str(venv)])
        steps.append([str(_python(venv)), "-m", "pip", "install", "--disable-pip-version-check", PACKAGE])
        for cmd in steps:
            lf.write(("$ " + " ".join(cmd) + "\n").encode())
            lf.flush()
            try:
                r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=1800, env=_clean_env(venv))
            except subprocess.TimeoutExpired:
                raise PeerSkipped(f"install timed out after 30 min: {' '.join(cmd)} (log: {log_path})") from None
            except OSError as e:
                raise PeerSkipped(f"install failed: {' '.join(cmd)}: {e}") from None
            if r.returncode != 0:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise PeerSkipped(f"install failed (exit {r.returncode}): {' '.join(cmd)}; log {log_path}; last lines: "
                                  + " | ".join(tail))
    version = _version(venv)
    if not version:
        raise PeerSkipped(f"installed into {venv}, but `import agentlightning.adapter` fails there (log: {log_path})")
    took = time.perf_counter() - t0
    log(f"installed agentlightning {version} in {took:.0f} s")
    return version, took


def run(params: dict, spans: int, venv: Path = DEFAULT_VENV, timeout: float = 1800) -> dict:
    """Install if needed, measure in the venv, return the result dict (see measure()).
    Raises PeerSkipped."""
    version, install_s = ensure_venv(venv)
    cmd = [str(_python(venv)), str(Path(__file__).resolve()), "--inside", "--params", json.dumps(params),
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
    sys.path.insert(0, str(HERE))
    import logging

    import synth_traces as st

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spans", type=int, default=16_000, help="spans to adapt (whole trajectories; default 16000)")
    ap.add_argument("--params", help="synth_traces.Params as JSON (transform.py passes its own)")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    for name, default in (("calls", 5), ("prompt-chars", 2000), ("response-chars", 300), ("prompt-tokens", 300),
                          ("prompt-step", 200), ("response-tokens", 100), ("attempts", 4), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    args = ap.parse_args()
    if args.params:
        params = json.loads(args.params)
    else:
        params = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in
                  ("calls", "prompt-chars", "response-chars", "prompt-tokens", "prompt-step", "response-tokens",
                   "attempts", "seed")}
        params["spans"] = max(args.spans, 1_000_000)
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
