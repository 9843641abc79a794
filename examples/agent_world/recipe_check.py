"""Is the world's prompt-reading chain robust? Builds policy -> instructed ->
counterfactual -> letters for several seeds (every stage's seed, the behaviour
policy's included, so each seed is a different build as another machine's
floating-point kernels make one) and prints, per seed, what the tests and the
APO benchmarks rely on, with met / NOT met:

    python examples/agent_world/recipe_check.py --seeds 0,1,2 --cache /tmp/world-check

A recipe the tests may rely on passes for every seed. Why this exists: on a new
machine (an AVX-512 EPYC, 2026-11-27) the recipe tuned on earlier machines built
an instructed policy deaf to the prompt (colour 0.58 -> 0.57 under a colour
instruction) and two tests failed; the same code reads prompts or not depending
on its numerics when training stops short of the point where reading forms
(benchmarks/RESULTS.md).

Stage settings can be overridden as JSON (`--instruct '{"epochs": 3}'`); each
seed's build goes to its own cache folder under --cache, keyed like the real
cache, so reruns reuse what is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import complement  # noqa: E402
import counterfactual  # noqa: E402
import evaluate  # noqa: E402
import policy  # noqa: E402
import world  # noqa: E402


def said(*problems: str) -> str:
    """The agent's prompt as the stand-in proposer edits it for these problems (the
    tests' wording, from the stand-in itself)."""
    from support.proposer_standin import _instruction

    return "\n".join([world.SYSTEM, *map(_instruction, problems)])


COLOUR_ERR = "tool error: calculator: error: cannot calculate a colour"
ARITH_ERR = "tool error: lookup: error: cannot look up arithmetic"
PLACEBO = "feedback: the answers were slow and too long"


def specs(seed: int, instruct: dict, cf: dict, letters: dict, base_seed: int | None):
    base = policy.PolicySpec(seed=seed if base_seed is None else base_seed)
    ispec = policy.InstructSpec(base=base, seed=seed, **instruct)
    cspec = dataclasses.replace(counterfactual.PROMPT_SENSITIVE, base=base, instruct=ispec, seed=seed, **cf)
    lspec = dataclasses.replace(complement.LETTERS_POLICY, start=cspec, seed=seed, **letters)
    return base, ispec, cspec, lspec


def check(seed: int, root: Path, instruct: dict, cf: dict, letters: dict, base_seed: int | None, tasks: int,
          episodes: int, until: str = "letters") -> list[tuple[str, float, bool]]:
    """(what, value, met) for one seed's chain."""
    base, ispec, cspec, lspec = specs(seed, instruct, cf, letters, base_seed)
    out: list[tuple[str, float, bool]] = []
    t0 = time.time()
    inst = policy.build_instructed(root / f"instructed-{ispec.key()}", ispec, progress=False)
    cfp = counterfactual.build(root / f"counterfactual-{cspec.key()}", cspec, progress=False)
    print(f"  seed {seed}: built to counterfactual in {time.time() - t0:.0f} s", flush=True)
    prompts = {"own": None, "colour": said(COLOUR_ERR), "both": said(COLOUR_ERR, ARITH_ERR),
               "placebo": said(PLACEBO)}
    p = evaluate.right_tool_probability(str(inst), prompts, tasks=tasks)
    out.append(("instructed: colour line lifts colour", p["colour"]["colour"] - p["own"]["colour"],
                p["colour"]["colour"] - p["own"]["colour"] > 0.15))
    p = evaluate.right_tool_probability(str(cfp), prompts, tasks=tasks)
    own, both, placebo = p["own"]["all"], p["both"]["all"], p["placebo"]["all"]
    out.append(("counterfactual: own, all kinds (0.3-0.7)", own, 0.3 < own < 0.7))
    out.append(("counterfactual: both errors said, lift", both - own, both - own > 0.2))
    out.append(("counterfactual: placebo moves it (<0.07)", placebo - own, abs(placebo - own) < 0.07))
    if episodes:
        from nightshift.serve.engine import Engine

        engine = Engine(str(cfp), "world-policy")
        rate = {k: evaluate.score("", None, episodes, seed=20261126, engine=engine, system=v).rate
                for k, v in prompts.items() if k in ("own", "both", "placebo")}
        out.append(("counterfactual episodes: own success (0.25-0.65)", rate["own"], 0.25 <= rate["own"] <= 0.65))
        out.append(("counterfactual episodes: both said, lift (>=0.15)", rate["both"] - rate["own"],
                    rate["both"] - rate["own"] >= 0.15))
        out.append(("counterfactual episodes: placebo moves it (<0.10)", rate["placebo"] - rate["own"],
                    abs(rate["placebo"] - rate["own"]) < 0.10))
    if until != "letters":
        return out
    t0 = time.time()
    try:
        lp = complement.build(root / f"letters-{lspec.key()}", lspec, progress=False)
        print(f"  seed {seed}: built letters in {time.time() - t0:.0f} s", flush=True)
        letter_err = [f"tool error: {t}: {world.LETTER_ERROR}" for t in ("lookup", "calculator")]
        p = evaluate.right_tool_probability(str(lp), {"own": None, "said": said(*letter_err),
                                                      "placebo": said(PLACEBO), "colour": said(COLOUR_ERR)},
                                            tasks=tasks)
        out.append(("letters: own, letters (<0.02)", p["own"]["letters"], p["own"]["letters"] < 0.02))
        out.append(("letters: said, letters (>0.85)", p["said"]["letters"], p["said"]["letters"] > 0.85))
        out.append(("letters: said - placebo (>0.3)", p["said"]["letters"] - p["placebo"]["letters"],
                    p["said"]["letters"] - p["placebo"]["letters"] > 0.3))
        out.append(("letters: colour line lifts colour (>0.2)", p["colour"]["colour"] - p["own"]["colour"],
                    p["colour"]["colour"] - p["own"]["colour"] > 0.2))
        worst = max(abs(p["own"]["colour"] - 0.5), abs(p["own"]["arithmetic"] - 0.5))
        out.append(("letters: own old kinds a coin flip (|x-0.5|<0.15)", worst, worst < 0.15))
        r = evaluate.read_probability(str(lp), {"own": None, "said": said(f"tool error: lookup: {world.LETTER_ERROR}",
                                                                          COLOUR_ERR)}, tasks=tasks)
        out.append(("letters: reads right (0.6-0.88)", r["own"], 0.6 < r["own"] < 0.88))
        out.append(("letters: prompt moves reading (<0.05)", r["said"] - r["own"], abs(r["said"] - r["own"]) < 0.05))
    finally:
        world.use("")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each is a whole chain")
    ap.add_argument("--base-seed", type=int, help="one behaviour policy for every seed (default: its own per seed)")
    ap.add_argument("--cache", default="/tmp/world-check", help="where the chains are built (one folder per seed)")
    ap.add_argument("--instruct", default="{}", help="policy.InstructSpec overrides, JSON")
    ap.add_argument("--counterfactual", default="{}", help="counterfactual.PROMPT_SENSITIVE overrides, JSON")
    ap.add_argument("--letters", default="{}", help="complement.LETTERS_POLICY overrides, JSON")
    ap.add_argument("--tasks", type=int, default=40, help="questions each teacher-forced probe reads (the tests': 40)")
    ap.add_argument("--episodes", type=int, default=0, help="also score the counterfactual policy on fresh episodes")
    ap.add_argument("--until", choices=("counterfactual", "letters"), default="letters", help="the last stage built")
    args = ap.parse_args()
    instruct, cf, letters = (json.loads(x) for x in (args.instruct, args.counterfactual, args.letters))
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS") if k in os.environ}
    print(f"recipe check: instruct {instruct} counterfactual {cf} letters {letters} env {env}", flush=True)
    failed = 0
    for seed in (int(s) for s in args.seeds.split(",")):
        root = Path(args.cache) / f"seed-{seed}"
        root.mkdir(parents=True, exist_ok=True)
        rows = check(seed, root, instruct, cf, letters, args.base_seed, args.tasks, args.episodes, args.until)
        for what, value, met in rows:
            print(f"  seed {seed}  {what:<52} {value:+.3f}  {'met' if met else 'NOT met'}", flush=True)
        failed += not all(m for _, _, m in rows)
    print(f"recipe check: {failed} of {len(args.seeds.split(','))} seeds NOT met")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
