#!/usr/bin/env python
"""Learning benchmark: does the nightly job make the agent better, night after
night, and does its gate stop the nights that would make it worse?

    python benchmarks/learning.py [--nights 2] [--seeds 3] [--episodes 200]
                                  [--eval-episodes 200] [--algorithms pg,awr,sft]

1. The agent world's behaviour policy (examples/agent_world: a tiny model built
   offline and taught the world by SFT so that it picks the right tool about
   half the time; built once, cached).
2. Night 1's logs, shared by every configuration: --episodes episodes of the
   unmodified agent (its own virtualenv, `opentelemetry-instrument`) through a
   real collector and the model server; half the rewards on spans, half posted
   as feedback afterwards.
3. Each configuration (algorithm x seed) is a lineage with its own data folder,
   checkpoints and served name. Each night: `nightshift nightly` (build ->
   train on all logs so far, continuing the published adapter -> the default
   gate -> publish); then the candidate is scored on --eval-episodes fresh
   episodes (in process, temperature 1), whatever the gate said, so every
   decision can be checked. From night 2 on, the lineage's agent runs with its
   own published adapter and those calls are logged (a mixture of behaviour
   policies: the trainer recomputes μ per version).

Controls in the same run: the behaviour policy scored on the same episodes (its
spread over seeds). Printed: success per night, mean ± sd over seeds, the gate's
decisions and their confusion with the measured outcome, and the issue's
targets as met / NOT met.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "agent_world"))

import evaluate  # noqa: E402
import loop  # noqa: E402
import policy  # noqa: E402

#: Per algorithm: train settings, chosen once on this world and used for every seed and night.
SETTINGS = {
    "sft": {"learning_rate": 5e-3, "epochs": 6, "sft": {"threshold": 0.5}},
    "awr": {"learning_rate": 5e-3, "epochs": 6, "awr": {"beta": 0.5}},
    "pg": {"learning_rate": 5e-3, "epochs": 6},
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mean_sd(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return float("nan"), float("nan")
    return statistics.mean(xs), statistics.pstdev(xs) if len(xs) > 1 else 0.0


def fmt(xs: list[float]) -> str:
    m, sd = mean_sd(xs)
    return "   n/a     " if m != m else f"{100 * m:5.1f} ± {100 * sd:4.1f}"


def nightly(cfg: Path, logs: Path) -> dict:
    """One `nightshift nightly`; what it decided, read from its state file."""
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "nightly", "--config", str(cfg), "--quiet"],
                       capture_output=True, text=True, timeout=3600)
    (logs / f"nightly-{cfg.parent.name}-{time.time():.0f}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"nightly failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    state = json.loads((cfg.parent / "checkpoints" / ".nightly" / "state.json").read_text())
    gate = state.get("gate") or {}
    decisive = [c["passed"] for c in (gate.get("checks") or {}).values() if c.get("decisive")]
    command = gate.get("command") or {}
    return {"gate": "PASSED" if gate.get("passed") else "BLOCKED", "version": state.get("version"),
            "lines": state.get("gate_lines") or [],
            # the default gate's own verdict (its offline checks), and the world checker's (gate.command)
            "offline": "PASSED" if gate and all(decisive) else "BLOCKED",
            "checker": ("PASSED" if command.get("passed") else "BLOCKED") if command else None,
            "checker_result": command.get("result")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nights", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=200, help="episodes logged per lineage per night")
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--algorithms", default="pg,awr,sft")
    ap.add_argument("--check-episodes", type=int, default=100,
                    help="fresh tasks the world's checker plays per candidate as the gate's command (0: offline checks only)")
    ap.add_argument("--keep", default="", help="keep the work folder here")
    args = ap.parse_args()
    from nightshift.serve.engine import Engine

    cache = Path(os.environ.get("NIGHTSHIFT_WORLD_CACHE") or "~/.cache/nightshift-agent-world").expanduser()
    spec = policy.PolicySpec()
    log("behaviour policy (cached after the first build)")
    model = policy.build(cache / f"policy-{spec.key()}", spec, progress=False)
    python = loop.agent_python(cache / "agent-venv")
    root = Path(args.keep or tempfile.mkdtemp(prefix="nightshift-bench-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    algorithms = args.algorithms.split(",")
    seeds = list(range(args.seeds))
    t0 = time.time()
    server = loop.start_server(model, "world-policy", logs, max_loras=4 * len(algorithms) * len(seeds) + 4)
    engine = Engine(str(model), "world-policy")
    success: dict[tuple[str, int], list[float]] = {}  # (alg, night) -> per seed
    serving_score: dict[tuple[str, int], float] = {}  # (alg, seed) -> what serves now, scored
    decisions: list[dict] = []
    try:
        log(f"night 1 logs: {args.episodes} episodes of the behaviour policy through a collector")
        first = root / "night1-logs"
        collector = loop.start_collector(first, logs)
        try:
            results = loop.run_agent(python, collector, server, "world-policy", args.episodes, seed=1, logs=logs)
            loop.post_feedback(collector, results)
        finally:
            collector.stop()
        logged = loop.success(results)
        behaviour = {}
        for night in range(1, args.nights + 1):
            behaviour[night] = [evaluate.score(str(model), None, args.eval_episodes, seed=1000 * night + s,
                                               engine=engine).rate for s in seeds]
        for alg in algorithms:
            for s in seeds:
                serving_score[(alg, s)] = behaviour[1][s]
        for night in range(1, args.nights + 1):
            for alg in algorithms:
                for s in seeds:
                    name = f"{alg}-s{s}"
                    data = root / name
                    if night == 1:
                        for part in ("spans", "logs", "feedback"):
                            if (first / part).exists():
                                shutil.copytree(first / part, data / part)
                    else:
                        published = (data / "checkpoints" / "published.json").exists()
                        collector = loop.start_collector(data, logs)
                        try:
                            res = loop.run_agent(python, collector, server, name if published else "world-policy",
                                                 args.episodes, seed=100 * night + s, logs=logs)
                            loop.post_feedback(collector, res)
                        finally:
                            collector.stop()
                    cfg = loop.nightly_config(data / "nightly.yaml", data, model, data / "checkpoints", server, name=name,
                                              nightly={"train_window_days": 3650}, seed=s,
                                              checker_episodes=args.check_episodes,
                                              **{**SETTINGS[alg], "algorithm": alg})
                    # what serves before tonight, on tonight's episodes (scored before the nightly can move it)
                    before = serving_score[(alg, s)] if night == 1 else evaluate.score(
                        str(model), _serving_path(data), args.eval_episodes, seed=1000 * night + s, engine=engine).rate
                    log(f"night {night}: {name}: nightshift nightly")
                    d = nightly(cfg, logs)
                    rate = float("nan")
                    if d["version"]:
                        rate = evaluate.score(str(model), str(data / "checkpoints" / d["version"]), args.eval_episodes,
                                              seed=1000 * night + s, engine=engine).rate
                    d.update(night=night, alg=alg, seed=s, candidate=rate, before=before)
                    decisions.append(d)
                    log(f"  gate {d['gate']}: candidate {100 * rate:.1f} % vs serving {100 * before:.1f} %")
                    serving_score[(alg, s)] = rate if d["gate"] == "PASSED" else before
                    success.setdefault((alg, night), []).append(serving_score[(alg, s)])
                    success.setdefault((alg + " (candidates)", night), []).append(rate)
    finally:
        server.stop()
    report(args, algorithms, seeds, logged, behaviour, success, decisions, time.time() - t0)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _serving_path(data: Path) -> str | None:
    reg = data / "checkpoints" / "published.json"
    if not reg.exists():
        return None
    return json.loads(reg.read_text())["current"]["checkpoint"]


def report(args, algorithms, seeds, logged, behaviour, success, decisions, seconds) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = "?"
    nights = range(1, args.nights + 1)
    print("nightshift learning benchmark (examples/agent_world), nights of `nightshift nightly` with its default gate")
    print(f"date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, commit {commit}, "
          f"{os.cpu_count()} CPUs, python {platform.python_version()}, {seconds:.0f} s")
    print(f"logged: {args.episodes} episodes per lineage per night (night 1 shared: behaviour policy, "
          f"{100 * logged:.1f} % success while logging); scored on {args.eval_episodes} fresh episodes, temperature 1, "
          f"{len(seeds)} seeds")
    print("success % of what serves after each night, mean ± sd over seeds (candidates the gate blocked in brackets)")
    print(f"  {'':22}" + "".join(f"{'night ' + str(n):>16}" for n in nights))
    print(f"  {'behaviour policy':22}" + "".join(f"{fmt(behaviour[n]):>16}" for n in nights))
    for alg in algorithms:
        print(f"  {alg + ' (serving)':22}" + "".join(f"{fmt(success[(alg, n)]):>16}" for n in nights))
        print(f"  {alg + ' (candidate)':22}" + "".join(f"{fmt(success[(alg + ' (candidates)', n)]):>16}" for n in nights))
    base_m, base_sd = mean_sd(behaviour[1])
    print("gate decisions (better/worse: the candidate's success against what served before it, same episodes; "
          "offline: the default gate's own checks; checker: the world's checker as gate.command; gate: both)")
    confs = {k: {(g, b): 0 for g in ("PASSED", "BLOCKED") for b in ("better", "worse")}
             for k in ("offline", "checker", "gate")}
    for d in decisions:
        better = "better" if d["candidate"] > d["before"] else "worse"
        for k, conf in confs.items():
            if d.get(k):
                conf[(d[k], better)] += 1
        cr = d.get("checker_result") or {}
        checked = (f", checker {100 * cr['candidate_success']:.0f} vs {100 * cr['serving_success']:.0f} %"
                   if "candidate_success" in cr else "")
        print(f"  night {d['night']} {d['alg']}-s{d['seed']}: gate {d['gate']:7} (offline {d['offline']}, checker "
              f"{d.get('checker') or 'off'}) candidate {100 * d['candidate']:5.1f} % vs {100 * d['before']:5.1f} %{checked}")
    for k, conf in confs.items():
        if sum(conf.values()):
            print(f"  confusion ({k}): passed-and-better {conf[('PASSED', 'better')]}, passed-and-worse "
                  f"{conf[('PASSED', 'worse')]}, blocked-and-better {conf[('BLOCKED', 'better')]}, blocked-and-worse "
                  f"{conf[('BLOCKED', 'worse')]}")
    conf = confs["offline"]
    print("targets:")
    spread = max(base_sd, 0.0)
    for alg in algorithms:
        m1, _ = mean_sd(success[(alg, 1)])
        gain = 100 * (m1 - base_m)
        drops = [mean_sd(success[(alg, n)])[0] - mean_sd(success[(alg, n - 1)])[0] for n in nights if n > 1]
        holds = all(-d <= max(spread, max(mean_sd(success[(alg, n)])[1] for n in nights)) for d in drops)
        print(f"  {alg}: +{gain:.1f} points after night 1 (>= +30: {'met' if gain >= 30 else 'NOT met'}); "
              f"no night drops beyond the seed spread: {'met' if holds else 'NOT met'}"
              + ("" if drops else " (one night only)"))
    if "pg" in algorithms and "sft" in algorithms:
        last = args.nights
        (pm, psd), (sm, ssd) = mean_sd(success[("pg", last)]), mean_sd(success[("sft", last)])
        beyond = pm - sm > max(psd, ssd)
        print(f"  pg >= sft outside the seed spread (night {last}): {100 * pm:.1f} vs {100 * sm:.1f}: "
              f"{'met' if beyond else 'NOT met'}")
    print(f"  passed-and-worse = 0, the default gate's offline checks: {'met' if conf[('PASSED', 'worse')] == 0 else 'NOT met'}")
    if sum(confs["gate"].values()) and args.check_episodes:
        print(f"  passed-and-worse = 0, with the world's checker: "
              f"{'met' if confs['gate'][('PASSED', 'worse')] == 0 else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
