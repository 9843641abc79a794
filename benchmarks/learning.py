#!/usr/bin/env python
"""Learning benchmark: does the nightly job make the agent better, night after
night, and does its gate stop the nights that would make it worse?

    python benchmarks/learning.py [--nights 2] [--seeds 3] [--episodes 200]
                                  [--eval-episodes 200] [--algorithms pg,awr,sft]
                                  (or apo,apo-placebo,apo+sft,sft [--prompt-share 0.5])
                                  [--canary 0.5] [--drift 0.0,0.8]

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

Production's verdict: every night's `nightshift nightly` runs the watch after its
build. With --canary SHARE the lineages publish each candidate as a canary through
one `nightshift route` in front of the server (their agents ask for the stable
name through it), and the watch stops or promotes it; without, a publish moves
all traffic and the watch rolls a worse version back. --drift A,B sets the
world's task mix (the share of colour questions): A for night 1's logs, B for
every later night's traffic and scoring. Traffic that moves away from what the
logs held is what an offline gate cannot see: with 0.0,0.8 a candidate trained
on arithmetic-only logs passes the gate and is worse on colour-heavy traffic.

Prompt optimization (issue 27), --algorithms apo,apo+sft,apo-placebo (benchmarks/
apo_arms.py): every arm of such a run serves the prompt-sensitive policy
(counterfactual.PROMPT_SENSITIVE; --policy DIR serves a given folder). An apo
lineage's agent reaches the server through its own `nightshift route`; each night's
`nightshift nightly` (experiments: prompts, or both for apo+sft) judges the running
prompt canary by production reward (the watch), then proposes a candidate with the
stand-in proposer (tests/support/proposer_standin.py, or --apo-base-url) and puts it
on --prompt-share of the conversations. The table names the prompt serving after each
night per seed (base: the agent's own; vNNNN: a promoted candidate) and scores it with
tonight's candidate on the behaviour policy's episodes; apo-placebo is the control.

--world letters (issue 27, "APO + sft beats either alone"): the world's variant
where a prompt and logged data fix different failures (examples/agent_world/
complement.py): a third tool the policy almost never calls unless its prompt says
when (no rewarded rows for sft; the other tools' error names it), and a habit of
misreading results that no prompt changes (no error to read; rewarded rows unteach
it). Every arm serves complement.LETTERS_POLICY, and the table adds success by
question kind after the last night.

Controls in the same run: the behaviour policy scored on the same episodes (its
spread over seeds). Printed: success per night, mean ± sd over seeds, the gate's
decisions and their confusion with the measured outcome, the watch's decisions,
reward by version per lineage, and the targets as met / NOT met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples" / "agent_world"))
sys.path.insert(0, str(HERE))

import apo_arms  # noqa: E402
import complement  # noqa: E402
import counterfactual  # noqa: E402
import evaluate  # noqa: E402
import harness  # noqa: E402
import loop  # noqa: E402
import paired  # noqa: E402
import policy  # noqa: E402
import world  # noqa: E402
from harness import Target, log, verdict  # noqa: E402

#: Per algorithm: train settings, chosen once on this world and used for every seed and night.
SETTINGS = {
    "sft": {"learning_rate": 5e-3, "epochs": 6, "sft": {"threshold": 0.5}},
    "awr": {"learning_rate": 5e-3, "epochs": 6, "awr": {"beta": 0.5}},
    "pg": {"learning_rate": 5e-3, "epochs": 6},
}

#: Success after night 1 against the behaviour policy, in points.
T_GAIN = Target(">=", 30, "+30")


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
    stale = [line for line in p.stderr.splitlines() if " is deprecated: " in line]
    if stale:  # loop.nightly_config writes each key in its home: a line here is a setting left behind
        log(f"  nightly printed {len(stale)} deprecation line(s), the first: {stale[0]}")
    if p.returncode != 0:
        raise RuntimeError(f"nightly failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    state = json.loads((cfg.parent / "checkpoints" / ".nightly" / "state.json").read_text())
    gate = state.get("gate") or {}
    decisive = [c["passed"] for c in (gate.get("checks") or {}).values() if c.get("decisive")]
    command = gate.get("command") or {}
    trained = bool(state.get("version"))  # no candidate: nothing new, or a canary still being judged
    return {"gate": ("PASSED" if gate.get("passed") else "BLOCKED") if trained else None,
            "version": state.get("version"), "outcome": state.get("outcome") or "",
            "watch": state.get("watch") or [],
            "lines": state.get("gate_lines") or [],
            # the default gate's own verdict (its offline checks), and the world checker's (gate.command)
            "offline": ("PASSED" if gate and all(decisive) else "BLOCKED") if trained else None,
            "checker": ("PASSED" if command.get("passed") else "BLOCKED") if command else None,
            "checker_result": command.get("result"),
            # prompt optimization (apo arms): the candidates started, and the watch's word on prompt canaries
            "prompts": state.get("prompts") or [], "prompt_watch": state.get("prompt_watch") or []}


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--nights", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=200, help="episodes logged per lineage per night")
    ap.add_argument("--eval-episodes", type=int, default=200)
    ap.add_argument("--algorithms", default="pg,awr,sft")
    ap.add_argument("--check-episodes", type=int, default=100,
                    help="fresh tasks the world's checker plays per candidate as the gate's command (0: offline checks only)")
    ap.add_argument("--keep", default="", help="keep the work folder here")
    ap.add_argument("--canary", type=float, default=0.0, metavar="SHARE",
                    help="publish each candidate as a canary to this share of conversations through nightshift route "
                         "(0: a publish moves all traffic)")
    ap.add_argument("--prompt-share", type=float, default=0.5, metavar="SHARE",
                    help="apo arms: the share of the agent's conversations a prompt candidate gets on the route")
    ap.add_argument("--policy", default="", metavar="DIR",
                    help="serve this model folder instead of the built policy (the tests' cached one)")
    ap.add_argument("--apo-base-url", default="", metavar="URL",
                    help="apo arms: a real proposer (OpenAI-compatible) instead of the stand-in; the placebo stays")
    ap.add_argument("--apo-model", default="", help="the proposer's model name, with --apo-base-url")
    ap.add_argument("--apo-key-env", default="", metavar="VARIABLE",
                    help="the environment variable holding the proposer's key, with --apo-base-url")
    ap.add_argument("--world", default="", choices=world.VARIANTS,
                    help="the agent world's variant ('letters': complement.py's, for apo+sft against either alone)")
    ap.add_argument("--drift", default="0.5,0.5", metavar="A,B",
                    help="share of colour questions in night 1's logs (A) and in later nights' traffic and scoring (B)")
    args = ap.parse_args()
    args.drift = tuple(float(x) for x in args.drift.split(","))
    if len(args.drift) != 2 or not all(0 <= x <= 1 for x in args.drift) or not 0 <= args.canary < 1:
        ap.error("--drift takes two shares in [0, 1], --canary a share in [0, 1)")
    if not 0 < args.prompt_share < 1:
        ap.error("--prompt-share takes a share in (0, 1)")
    unknown = [a for a in args.algorithms.split(",") if a not in SETTINGS and not apo_arms.is_apo(a)]
    if unknown:
        ap.error(f"--algorithms: {', '.join(unknown)} unknown; known: {', '.join([*SETTINGS, *apo_arms.ARMS])}")
    return args


def mix(args: argparse.Namespace, night: int) -> float:
    """The share of colour questions on `night`: night 1's logs, then the drifted
    traffic. A model published on night k serves night k + 1's traffic, so that is
    what candidates and what serves are scored on."""
    return args.drift[0] if night == 1 else args.drift[1]


@dataclass
class World:
    """The agent world as the nights use it: the behaviour policy, the agent's
    Python, one model server for every lineage, an in-process engine for scoring."""

    model: Path
    python: Path
    root: Path
    logs: Path
    server: loop.Service
    engine: object
    started: float  # time.time() when the server started: the run's seconds count from here
    route: loop.Service | None = None  # with --canary: the agents reach the server through it
    policy: str = ""  # which behaviour policy: its kind and spec key
    routes: dict[str, loop.Service] = field(default_factory=dict)  # apo lineage -> its own route
    proposers: dict[str, object] = field(default_factory=dict)  # apo arm -> its proposer (a stand-in server)


@dataclass
class Nights:
    """What the nights measured."""

    logged: float = 0.0  # success while logging night 1
    behaviour: dict[int, list[float]] = field(default_factory=dict)  # night -> per seed
    behaviour_scores: dict[int, list[evaluate.Score]] = field(default_factory=dict)  # night -> per seed, per episode
    success: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (alg, night) -> per seed
    serving_score: dict[tuple[str, int], evaluate.Score] = field(default_factory=dict)  # (alg, seed) -> what serves now
    prompt: dict[tuple[str, int], list[str]] = field(default_factory=dict)  # (apo arm, night) -> serving prompt per seed
    prompt_lines: list[str] = field(default_factory=list)  # apo arms: what nightly proposed and the watch decided
    decisions: list[dict] = field(default_factory=list)
    root: Path = Path(".")  # the work folder: each lineage's data, checkpoints and report
    watch: list[dict] = field(default_factory=list)  # every decision the watch took, with the gate's on that version


def start_world(args: argparse.Namespace, algorithms: list[str], seeds: list[int]) -> World:
    from nightshift.serve.engine import Engine

    cache = Path(os.environ.get("NIGHTSHIFT_WORLD_CACHE") or "~/.cache/nightshift-agent-world").expanduser()
    if args.policy:
        model, which = Path(args.policy).resolve(), f"the folder {args.policy} (--policy)"
    elif args.world == "letters":
        lspec = complement.LETTERS_POLICY
        log("the letters variant's policy (complement.LETTERS_POLICY; cached after the first build)")
        model = complement.build(cache / f"letters-{lspec.key()}", lspec, progress=False)
        which = f"letters {lspec.key()} (complement.LETTERS_POLICY, world variant 'letters')"
    elif any(apo_arms.is_apo(a) for a in algorithms):
        # APO needs a policy that reads its system prompt: every arm of this run serves it, so
        # sft here is the weights-only arm that apo+sft is compared with
        # The one that reads what a prompt says: InstructSpec's defaults alone also lift under a
        # placebo line (11 points on its right first tool), which an APO figure would count.
        cspec = counterfactual.PROMPT_SENSITIVE
        log("prompt-sensitive behaviour policy (counterfactual.PROMPT_SENSITIVE; cached after the first build)")
        model = counterfactual.build(cache / f"counterfactual-{cspec.key()}", cspec, progress=False)
        which = f"counterfactual {cspec.key()} (counterfactual.PROMPT_SENSITIVE)"
    else:
        spec = policy.PolicySpec()
        log("behaviour policy (cached after the first build)")
        model = policy.build(cache / f"policy-{spec.key()}", spec, progress=False)
        which = f"behaviour {spec.key()} (policy.PolicySpec defaults)"
    python = loop.agent_python(cache / "agent-venv")
    root = Path(args.keep or tempfile.mkdtemp(prefix="nightshift-bench-learning-"))
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    started = time.time()
    # the server loads the model in its process while this one loads it for scoring
    server = loop.start_server(model, "world-policy", logs, max_loras=4 * len(algorithms) * len(seeds) + 4,
                               wait=False)
    try:
        engine = Engine(str(model), "world-policy")
        server.ready("/health", "the model server")
    except BaseException:
        server.stop()
        raise
    route = loop.start_route(server, logs, root / "routes.json") if args.canary else None
    w = World(model, python, root, logs, server, engine, started, route, which)
    for alg in {a for a in algorithms if apo_arms.is_apo(a)}:
        if alg == "apo-placebo":
            w.proposers[alg] = apo_arms.PlaceboProposer().__enter__()
        elif not args.apo_base_url:
            w.proposers[alg] = w.proposers.get("standin") or apo_arms.Standin().__enter__()
            w.proposers["standin"] = w.proposers[alg]
    return w


def first_night_logs(w: World, args: argparse.Namespace) -> tuple[Path, float]:
    """Night 1's logs, shared by every lineage: the behaviour policy through a collector."""
    log(f"night 1 logs: {args.episodes} episodes of the behaviour policy through a collector")
    first = w.root / "night1-logs"
    collector = loop.start_collector(first, w.logs)
    try:
        results = loop.run_agent(w.python, collector, w.server, "world-policy", args.episodes, seed=1, logs=w.logs,
                                 colour_share=mix(args, 1))
        loop.post_feedback(collector, results)
    finally:
        collector.stop()
    return first, loop.success(results)


def night_logs(w: World, args: argparse.Namespace, data: Path, first: Path, night: int, s: int, server,
               model) -> None:
    """A lineage's logs for tonight: night 1's shared first logs, copied; from night 2
    on, its own agent's episodes through `server` (a route or the model server)
    asking for `model()` (called only then: what serves is read after night 1)."""
    if night == 1:
        for part in ("spans", "logs", "feedback"):
            if (first / part).exists():
                shutil.copytree(first / part, data / part)
        return
    collector = loop.start_collector(data, w.logs)
    try:
        res = loop.run_agent(w.python, collector, server, model(), args.episodes, seed=100 * night + s,
                             logs=w.logs, colour_share=mix(args, night))
        loop.post_feedback(collector, res)
    finally:
        collector.stop()


def lineage_night(w: World, args: argparse.Namespace, n: Nights, first: Path, night: int, alg: str, s: int) -> None:
    """One night of one lineage: its logs (from night 2 on, its own agent's), the
    nightly job, the candidate scored whatever the gate said."""
    name = f"{alg}-s{s}"
    data = w.root / name
    night_logs(w, args, data, first, night, s, w.route or w.server, lambda: _agent_model(w, data, name))
    canary = {"canary": {"share": args.canary, "route_url": w.route.url}} if w.route else {}
    cfg = loop.nightly_config(data / "nightly.yaml", data, w.model, data / "checkpoints", w.server, name=name,
                              nightly={"train_window_days": 3650, **canary}, seed=s,
                              checker_episodes=args.check_episodes,
                              **{**SETTINGS[alg], "algorithm": alg})
    # what serves before tonight, on tonight's episodes (scored before the nightly can move it)
    serving_before = _serving_path(data)
    before_score = n.serving_score[(alg, s)] if night == 1 else evaluate.score(
        str(w.model), serving_before, args.eval_episodes, seed=1000 * night + s, engine=w.engine,
        colour_share=mix(args, night + 1))
    before = before_score.rate
    log(f"night {night}: {name}: nightshift nightly")
    d = nightly(cfg, w.logs)
    rate, cand_score = float("nan"), None
    if d["version"]:
        cand_score = evaluate.score(str(w.model), str(data / "checkpoints" / d["version"]), args.eval_episodes,
                                    seed=1000 * night + s, engine=w.engine, colour_share=mix(args, night + 1))
        rate = cand_score.rate
    d.update(night=night, alg=alg, seed=s, candidate=rate, before=before,
             truth=_clearly(cand_score, before_score) if cand_score else None)
    n.decisions.append(d)
    cr = d.get("checker_result") or {}
    # every decision in the log as it is taken: a run stopped early still says what it reached
    log(f"  gate {d['gate']} (offline {d['offline']}, checker {d.get('checker') or 'off'}"
        + (f": paired {100 * cr['estimate']:+.0f}, bound {100 * cr['lower']:+.1f} on {cr['n']}" if "lower" in cr else "")
        + f"): candidate {100 * rate:.1f} % vs serving {100 * before:.1f} % [{d['truth']}]" if d["version"]
        else f"  no candidate: {d['outcome']}")
    for line in d["watch"]:
        log(f"  {line}")
    n.watch += _watch_decisions(data, name, night, n.decisions, n.watch)
    # what serves now (the registry's word: a canary serves only its share), scored on tonight's episodes
    serving_now = _serving_path(data)
    if serving_now == serving_before:
        n.serving_score[(alg, s)] = before_score
    elif d["version"] and serving_now and serving_now.endswith(d["version"]):
        n.serving_score[(alg, s)] = cand_score
    else:
        n.serving_score[(alg, s)] = evaluate.score(str(w.model), serving_now, args.eval_episodes,
                                                   seed=1000 * night + s, engine=w.engine,
                                                   colour_share=mix(args, night + 1))
    n.success.setdefault((alg, night), []).append(n.serving_score[(alg, s)].rate)
    n.success.setdefault((alg + " (candidates)", night), []).append(rate)


def apo_night(w: World, args: argparse.Namespace, n: Nights, first: Path, night: int, alg: str, s: int) -> None:
    """One night of an apo lineage: its agent's logs through the lineage's own route
    (from night 2 on: a prompt canary rewrites its share of the conversations), the
    nightly job (the watch judges the canary; the prompt stage proposes the next;
    apo+sft also trains), then what serves (adapter and prompt) and tonight's prompt
    candidate scored on the same fresh episodes as the behaviour policy."""
    name = apo_arms.lineage(alg, s)
    data = w.root / name
    if name not in w.routes:
        w.routes[name] = loop.start_route(w.server, w.logs, data / "routes.json")
    route = w.routes[name]
    night_logs(w, args, data, first, night, s, route, lambda: name if _serving_path(data) else "world-policy")
    proposer = w.proposers.get(alg)
    apo = ({"base_url": proposer.url, "model": "standin"} if proposer else
           {"base_url": args.apo_base_url, "model": args.apo_model, "api_key_env": args.apo_key_env})
    kind = apo_arms.ARMS[alg]
    cfg = loop.nightly_config(data / "nightly.yaml", data, w.model, data / "checkpoints", w.server, name=name,
                              nightly={"train_window_days": 3650, "experiments": kind,
                                       "canary": {"route_url": route.url}, "prompts": {"share": args.prompt_share}},
                              seed=s, checker_episodes=args.check_episodes if kind == "both" else 0,
                              apo={**apo, "candidates": 1, "timeout": 120.0, "retries": 1},
                              **{**SETTINGS["sft"], "algorithm": "sft"})
    log(f"night {night}: {name}: nightshift nightly (experiments: {kind})")
    d = nightly(cfg, w.logs)
    ps = apo_arms.prompt_state(data / "prompt-candidates", d["prompts"])
    said = [*d["prompt_watch"], *d["prompts"], *([f"weights: {d['outcome'] or 'published ' + str(d['version'])}"]
                                                 if kind == "both" else [])]
    for line in said:
        log(f"  {line}")
    n.prompt_lines += [f"night {night} {name}: {line}" for line in said]
    n.watch += _watch_decisions(data, name, night, n.decisions, n.watch)
    adapter = _serving_path(data)
    seed, share = 1000 * night + s, mix(args, night + 1)
    if adapter is None and ps.serving_system is None:
        now = n.behaviour_scores[night][s]  # the behaviour policy under the agent's own prompt: already scored
    else:
        now = evaluate.score(str(w.model), adapter, args.eval_episodes, seed=seed, engine=w.engine, colour_share=share,
                             system=ps.serving_system)
    rate = float("nan")
    if ps.candidate_system is not None:
        rate = evaluate.score(str(w.model), adapter, args.eval_episodes, seed=seed, engine=w.engine, colour_share=share,
                              system=ps.candidate_system).rate
    log(f"  serving prompt {ps.serving}{' + adapter' if adapter else ''}: {100 * now.rate:.1f} %"
        + (f"; candidate {ps.candidate}: {100 * rate:.1f} %" if ps.candidate else "") + f"; {ps.trial}")
    n.serving_score[(alg, s)] = now
    n.success.setdefault((alg, night), []).append(now.rate)
    n.success.setdefault((alg + " (candidates)", night), []).append(rate)
    n.prompt.setdefault((alg, night), []).append(ps.serving + ("+adapter" if adapter else ""))


def _clearly(candidate: evaluate.Score, before: evaluate.Score) -> str:
    """`better`, `worse` or `within noise`: whether the scoring episodes themselves
    (paired: same tasks, same sampling seeds) tell the two apart, by a two-sided
    95 % interval of the paired difference. The strict confusion counts a 0.5-point
    difference on 200 episodes as truth; this one does not."""
    if paired.paired_lower(candidate.outcomes, before.outcomes, 0.975).lower > 0:
        return "better"
    if paired.paired_lower(before.outcomes, candidate.outcomes, 0.975).lower > 0:
        return "worse"
    return "within noise"


def _agent_model(w: World, data: Path, name: str) -> str:
    """What the lineage's agent asks for: its stable name once something answers to
    it (a publication, or a route on the proxy), else the base model."""
    if _serving_path(data):
        return name
    if w.route is not None:
        from nightshift.route.client import RouteClient

        if RouteClient(w.route.url).get(name) is not None:
            return name
    return "world-policy"


def _watch_decisions(data: Path, name: str, night: int, decisions: list[dict], known: list[dict]) -> list[dict]:
    """The watch's decisions not in `known` yet (gate-log.jsonl, kind watch), each
    with what the offline gate had said of that version."""
    path = data / "checkpoints" / "gate-log.jsonl"
    seen = {(d["lineage"], d["time"], d["version"]) for d in known}
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        e = json.loads(line)
        if e.get("kind") != "watch" or (name, e["time"], e["candidate"]) in seen:
            continue
        gate = next((d for d in decisions if d.get("version") == e["candidate"] and f"{d['alg']}-s{d['seed']}" == name),
                    None)
        out.append({"lineage": name, "night": night, "time": e["time"], "version": e["candidate"],
                    "against": e["baseline"], "decision": e["decision"], "action": e.get("action", ""),
                    "diff": e.get("diff"), "low": e.get("low"), "high": e.get("high"),
                    "offline": gate["offline"] if gate else "?", "gate": gate["gate"] if gate else "?"})
    return out


def run_nights(w: World, args: argparse.Namespace, algorithms: list[str], seeds: list[int]) -> Nights:
    n = Nights(root=w.root)
    first, n.logged = first_night_logs(w, args)
    for night in range(1, args.nights + 1):
        n.behaviour_scores[night] = [evaluate.score(str(w.model), None, args.eval_episodes, seed=1000 * night + s,
                                                    engine=w.engine, colour_share=mix(args, night + 1)) for s in seeds]
        n.behaviour[night] = [x.rate for x in n.behaviour_scores[night]]
    for alg in algorithms:
        for s in seeds:
            n.serving_score[(alg, s)] = n.behaviour_scores[1][s]
    for night in range(1, args.nights + 1):
        for alg in algorithms:
            for s in seeds:
                (apo_night if apo_arms.is_apo(alg) else lineage_night)(w, args, n, first, night, alg, s)
    return n


def main() -> int:
    args = parse_args()
    world.use(args.world)  # before anything starts: the agents and the gate's checker inherit it
    head = harness.header("nightshift learning benchmark (examples/agent_world), nights of `nightshift nightly` "
                          "with its default gate", args)  # before anything runs: how busy the machine was
    algorithms = args.algorithms.split(",")
    seeds = list(range(args.seeds))
    w = start_world(args, algorithms, seeds)
    try:
        n = run_nights(w, args, algorithms, seeds)
    finally:
        for r in [w.route, *w.routes.values()]:
            if r:
                r.stop()
        for p in {id(p): p for p in w.proposers.values()}.values():
            p.__exit__(None, None, None)
        w.server.stop()
    print("\n".join(report(head, args, algorithms, seeds, n, time.time() - w.started, w.policy)), flush=True)
    if args.keep:
        print("reports (with the plot of reward by version): "
              + ", ".join(str(w.root / apo_arms.lineage(a, s) / "checkpoints" / "reports" / "latest.png")
                          for a in algorithms for s in seeds), flush=True)
    if not args.keep:
        shutil.rmtree(w.root, ignore_errors=True)
    return 0


def apo_targets(args: argparse.Namespace, algorithms: list[str], n: Nights) -> list[str]:
    """Issue 27's targets for the apo arms: APO alone >= +15 points over the base prompt
    within 3 nights outside the seed spread (the placebo's gain beside it, so a lift
    a longer prompt also gives is seen as one), and apo+sft above either alone."""
    nights = range(1, min(args.nights, 3) + 1)
    out = []

    def gain(alg: str, k: int) -> tuple[float, float]:
        (m, sd), (bm, bsd) = mean_sd(n.success[(alg, k)]), mean_sd(n.behaviour[k])
        return 100 * (m - bm), 100 * max(sd, bsd)

    for alg in [a for a in ("apo", "apo-placebo") if a in algorithms]:
        # night 1's candidate on the same episodes as the base prompt: what the proposal is worth,
        # whether or not the watch has seen enough of it to promote it yet
        cg, cspread = gain(alg + " (candidates)", 1)
        out.append(f"  {alg}: night 1's candidate over the base prompt, same episodes: {cg:+.1f} points (seed spread "
                   f"{cspread:.1f}; not a target: the target is what serves)")
        best = max(nights, key=lambda k: gain(alg, k)[0])
        g, spread = gain(alg, best)
        met = g >= 15 and g > spread
        out.append(f"  {alg}: best gain over the base prompt within {len(nights)} night(s): {g:+.1f} points (night "
                   f"{best}, seed spread {spread:.1f}); >= +15 outside the spread: {verdict(met)}")
    if "apo" in algorithms and "apo-placebo" in algorithms:
        k = max(nights)
        (am, asd), (pm, psd) = mean_sd(n.success[("apo", k)]), mean_sd(n.success[("apo-placebo", k)])
        out.append(f"  apo above its placebo outside the seed spread (night {k}): {100 * am:.1f} vs {100 * pm:.1f}: "
                   f"{verdict(am - pm > max(asd, psd))}")
    if "apo+sft" in algorithms:
        k = args.nights
        bm, bsd = mean_sd(n.success[("apo+sft", k)])
        for other in ("apo", "sft"):
            if other not in algorithms:
                out.append(f"  apo+sft beats {other} alone: not measured ({other} not in --algorithms)")
                continue
            om, osd = mean_sd(n.success[(other, k)])
            out.append(f"  apo+sft beats {other} alone outside the seed spread (night {k}): {100 * bm:.1f} vs "
                       f"{100 * om:.1f}: {verdict(bm - om > max(bsd, osd))}")
    return out


def _versions(data: Path) -> list[str]:
    from nightshift.judge.versions import NoTransitions, by_version, lines

    try:
        return lines(by_version(str(data), checkpoints=str(data / "checkpoints")))
    except NoTransitions as e:
        return [str(e)]


def _serving_path(data: Path) -> str | None:
    """The checkpoint serving the lineage's stable name (canaries do not count), or None: the base."""
    from nightshift.publish import registry

    for e in reversed(registry.read(str(data / "checkpoints"))):
        if e.get("role") not in registry.CANARY_ROLES:
            return e["checkpoint"]
    return None


def by_kind(algorithms: list[str], seeds: list[int], n: Nights, last: int) -> list[str]:
    """Success by question kind of what serves after the last night, pooled over
    seeds: which failures each arm fixed (the letters variant's point)."""
    arms = [("behaviour policy", n.behaviour_scores[last])] + [(a, [n.serving_score[(a, s)] for s in seeds])
                                                               for a in algorithms]
    kinds = sorted({k for _, scores in arms for sc in scores for k in sc.kinds})
    out = [f"success % by question kind after night {last} (what serves; pooled over seeds)"]
    rows = []
    for label, scores in arms:
        cells = []
        for kind in kinds:
            ok = sum(sc.by_kind().get(kind, (0, 0))[0] for sc in scores)
            total = sum(sc.by_kind().get(kind, (0, 0))[1] for sc in scores)
            cells.append(f"{100 * ok / total:5.1f} (n={total})" if total else "n/a")
        rows.append((label, *cells))
    return out + harness.table(rows, header=("", *kinds))


def report(head: list[str], args: argparse.Namespace, algorithms: list[str], seeds: list[int], n: Nights,
           seconds: float, policy_used: str = "") -> list[str]:
    nights = range(1, args.nights + 1)
    behaviour, success, decisions = n.behaviour, n.success, n.decisions
    out = [*head, f"time: {seconds:.0f} s", f"policy: {policy_used}"]
    out.append(f"logged: {args.episodes} episodes per lineage per night (night 1 shared: behaviour policy, "
               f"{100 * n.logged:.1f} % success while logging); scored on {args.eval_episodes} fresh episodes, "
               f"temperature 1, {len(seeds)} seeds")
    if args.drift[0] != args.drift[1] or args.canary:
        out.append(f"traffic: {100 * args.drift[0]:.0f} % colour questions in night 1's logs, {100 * args.drift[1]:.0f} % "
                   "from night 2 on (what each night's model serves, and is scored on); "
                   + (f"candidates published as canaries to {100 * args.canary:.0f} % of conversations through "
                      "nightshift route, what serves moves when the watch promotes one" if args.canary
                      else "a publish moves all traffic"))
    out.append("success % of what serves after each night, mean ± sd over seeds (candidates the gate blocked in brackets)")
    rows = [("behaviour policy", *(fmt(behaviour[k]) for k in nights))]
    for alg in algorithms:
        rows.append((alg + " (serving)", *(fmt(success[(alg, k)]) for k in nights)))
        rows.append((alg + " (candidate)", *(fmt(success[(alg + " (candidates)", k)]) for k in nights)))
        if apo_arms.is_apo(alg):  # which prompt serves, per seed ("base": the agent's own; +adapter: apo+sft's)
            rows.append((alg + " (serving prompt)", *(",".join(n.prompt[(alg, k)]) for k in nights)))
    out.extend(harness.table(rows, header=("", *(f"night {k}" for k in nights))))
    if args.world:
        out += by_kind(algorithms, seeds, n, args.nights)
    base_m, base_sd = mean_sd(behaviour[1])
    out.append("gate decisions (better/worse: the candidate's success against what served before it, same episodes; "
               "offline: the default gate's own checks; checker: the world's checker as gate.command; gate: both)")
    confs = {k: {(g, b): 0 for g in ("PASSED", "BLOCKED") for b in ("better", "worse")}
             for k in ("offline", "checker", "gate")}
    # the same decisions against what the scoring episodes can tell apart (paired, 95 %)
    clear = {k: {(g, b): 0 for g in ("PASSED", "BLOCKED") for b in ("better", "worse", "within noise")}
             for k in ("offline", "checker", "gate")}
    for d in decisions:
        better = "better" if d["candidate"] > d["before"] else "worse"
        for k, conf in confs.items():
            if d.get(k):
                conf[(d[k], better)] += 1
                if d.get("truth"):
                    clear[k][(d[k], d["truth"])] += 1
        if not d["version"]:
            out.append(f"  night {d['night']} {d['alg']}-s{d['seed']}: no candidate ({d['outcome']})")
            continue
        cr = d.get("checker_result") or {}
        checked = (f", checker {100 * cr['candidate_success']:.0f} vs {100 * cr['serving_success']:.0f} %"
                   if "candidate_success" in cr else "")
        if "lower" in cr:
            checked += f" (paired {100 * cr['estimate']:+.0f}, bound {100 * cr['lower']:+.1f} on {cr['n']})"
        out.append(f"  night {d['night']} {d['alg']}-s{d['seed']}: gate {d['gate']:7} (offline {d['offline']}, checker "
                   f"{d.get('checker') or 'off'}) candidate {100 * d['candidate']:5.1f} % vs {100 * d['before']:5.1f} %"
                   f" [{d.get('truth') or '?'}]{checked}")
    for k, conf in confs.items():
        if sum(conf.values()):
            out.append(f"  confusion ({k}): passed-and-better {conf[('PASSED', 'better')]}, passed-and-worse "
                       f"{conf[('PASSED', 'worse')]}, blocked-and-better {conf[('BLOCKED', 'better')]}, blocked-and-worse "
                       f"{conf[('BLOCKED', 'worse')]}")
    for k, conf in clear.items():
        if sum(conf.values()):
            out.append(f"  beyond the scoring's noise ({k}): passed-and-better {conf[('PASSED', 'better')]}, "
                       f"passed-and-worse {conf[('PASSED', 'worse')]}, blocked-and-better {conf[('BLOCKED', 'better')]}, "
                       f"blocked-and-worse {conf[('BLOCKED', 'worse')]}; within noise: passed "
                       f"{conf[('PASSED', 'within noise')]}, blocked {conf[('BLOCKED', 'within noise')]}")
    out.append("production watch (after each night's build: a canary against what serves, or what serves against "
               "the version before it; interval: the always-valid confidence sequence of the difference)")
    for e in n.watch:
        band = (f" [{e['low']:+.3f}, {e['high']:+.3f}]" if e.get("low") is not None else "")
        diff = f" {e['diff']:+.3f}" if e.get("diff") is not None else ""
        out.append(f"  night {e['night']} {e['lineage']}: {e['version']} against {e['against']}: {e['decision']}{diff}"
                   f"{band} -> {e['action'] or '-'} (offline gate had {e['offline']})")
    if not n.watch:
        out.append("  no decision: too few rated trajectories, or nothing to compare yet")
    if n.prompt_lines:
        out.append("prompt optimization (apo arms): the prompt watch's decisions and what each night proposed")
        out += ["  " + x for x in n.prompt_lines]
    out.append("reward by version (nightshift versions), per lineage")
    for alg in algorithms:
        for s in seeds:
            if not apo_arms.is_apo(alg):
                out += [f"  {alg}-s{s}:"] + ["    " + x for x in _versions(n.root / f"{alg}-s{s}")]
    conf = confs["offline"]
    out.append("targets:")
    spread = max(base_sd, 0.0)
    for alg in [a for a in algorithms if not apo_arms.is_apo(a)]:
        m1, _ = mean_sd(success[(alg, 1)])
        gain = 100 * (m1 - base_m)
        drops = [mean_sd(success[(alg, k)])[0] - mean_sd(success[(alg, k - 1)])[0] for k in nights if k > 1]
        holds = all(-d <= max(spread, max(mean_sd(success[(alg, k)])[1] for k in nights)) for d in drops)
        out.append(f"  {alg}: +{gain:.1f} points after night 1 ({T_GAIN.check(gain)}); "
                   f"no night drops beyond the seed spread: {verdict(holds)}" + ("" if drops else " (one night only)"))
    if "pg" in algorithms and "sft" in algorithms:
        last = args.nights
        (pm, psd), (sm, ssd) = mean_sd(success[("pg", last)]), mean_sd(success[("sft", last)])
        beyond = pm - sm > max(psd, ssd)
        out.append(f"  pg >= sft outside the seed spread (night {last}): {100 * pm:.1f} vs {100 * sm:.1f}: {verdict(beyond)}")
    out += apo_targets(args, algorithms, n)
    if not all(apo_arms.is_apo(a) for a in algorithms):  # the weight gate's targets: its decisions are pg/awr/sft's
        out.append(f"  passed-and-worse = 0, the default gate's offline checks: "
                   f"{verdict(conf[('PASSED', 'worse')] == 0)}")
        caught = [e for e in n.watch if e["action"] in ("rolled back", "canary stopped") and e["offline"] == "PASSED"]
        out.append(f"  production rolled back (or stopped) a version the offline gate passed: {len(caught)} "
                   f"({verdict(bool(caught))})")
    if sum(confs["gate"].values()) and args.check_episodes:
        out.append(f"  passed-and-worse = 0, with the world's checker: {verdict(confs['gate'][('PASSED', 'worse')] == 0)}")
        for k in ("checker", "gate"):
            c = confs[k]
            out.append(f"  issue 27: passed-and-worse 0 and blocked-and-better <= 2 ({k}): {c[('PASSED', 'worse')]} and "
                       f"{c[('BLOCKED', 'better')]}: "
                       f"{verdict(c[('PASSED', 'worse')] == 0 and c[('BLOCKED', 'better')] <= 2)}")
    return out


if __name__ == "__main__":
    sys.exit(main())
