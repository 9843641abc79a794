"""Does the prompt-sensitive policy read what a prompt says? Builds (or reuses from
the cache) counterfactual.PROMPT_SENSITIVE and prints, per prompt, the probability
of the right first tool (teacher-forced, evaluate.right_tool_probability) and,
with --episodes, the success rate on fresh episodes (the same tasks and sampling
seeds for every prompt, so differences are paired):

    python examples/agent_world/prompt_probe.py --episodes 100

The prompts: the agent's own; a taught instruction; the stand-in proposer's
wording of the world's two tool errors (held out: never taught verbatim); two
placebos in the stand-in's frame and length (the lift test's, and the learning
benchmark's apo-placebo arm's), about nothing a tool choice depends on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import evaluate  # noqa: E402
import policy  # noqa: E402
import world  # noqa: E402


def frame(problem: str) -> str:
    """The stand-in proposer's frame (tests/support/proposer_standin.py)."""
    return f"Earlier conversations went wrong with: {problem}. Make sure this does not happen."


PROMPTS = {
    "base": None,
    "taught": world.SYSTEM + "\nWarning: the calculator cannot answer a colour question.\n"
                             "Remember: lookup cannot answer arithmetic.",
    "stand-in": world.SYSTEM + "\n" + frame("tool error: calculator: error: cannot calculate a colour") + "\n"
                + frame("tool error: lookup: error: cannot look up arithmetic"),
    "placebo": world.SYSTEM + "\n" + frame("feedback: the answers were slow and too long"),
    "placebo x2": world.SYSTEM + "\n" + frame("replies that were worded more formally than users like") + "\n"
                  + frame("answers that repeated the question back to the user"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=0, help="also score each prompt on this many fresh episodes")
    ap.add_argument("--tasks", type=int, default=200, help="questions the teacher-forced probe reads")
    ap.add_argument("--model", help="a policy folder (default: build or reuse counterfactual.PROMPT_SENSITIVE)")
    ap.add_argument("--counterfactual", metavar="JSON", help="build or reuse counterfactual.py's recipe with these "
                    "CounterfactualSpec settings instead ('{}': its defaults)")
    ap.add_argument("--instructed", action="store_true", help="policy.InstructSpec's defaults instead (the stage "
                    "PROMPT_SENSITIVE continues from)")
    args = ap.parse_args()
    root = Path(os.environ.get("NIGHTSHIFT_WORLD_CACHE") or "~/.cache/nightshift-agent-world").expanduser()
    t0, c0 = time.time(), time.process_time()
    if args.model:
        model = Path(args.model)
    elif args.counterfactual is not None:
        import counterfactual

        cspec = counterfactual.CounterfactualSpec(**json.loads(args.counterfactual))
        model = counterfactual.build(root / f"counterfactual-{cspec.key()}", cspec, progress=False)
    elif args.instructed:
        spec = policy.InstructSpec()
        model = policy.build_instructed(root / f"instructed-{spec.key()}", spec, progress=False)
    else:
        import counterfactual

        cspec = counterfactual.PROMPT_SENSITIVE
        model = counterfactual.build(root / f"counterfactual-{cspec.key()}", cspec, progress=False)
    if not args.model:
        print(f"policy: {model} (build or cache: {time.time() - t0:.0f} s wall, {time.process_time() - c0:.0f} s CPU)")
    c0 = time.process_time()
    probe = evaluate.right_tool_probability(str(model), PROMPTS, args.tasks)
    print(f"probe: P(right first tool), {args.tasks} questions ({time.process_time() - c0:.0f} s CPU)")
    for label, p in probe.items():
        print(f"  {label:<11} all {p['all']:.3f}  colour {p['colour']:.3f}  arithmetic {p['arithmetic']:.3f}")
    if args.episodes:
        from nightshift.serve.engine import Engine

        engine = Engine(str(model), "world-policy")
        c0 = time.process_time()
        print(f"episodes: success on {args.episodes} fresh episodes (paired), temperature 1")
        for label, system in PROMPTS.items():
            s = evaluate.score("", None, args.episodes, seed=99, engine=engine, system=system)
            print(f"  {label:<11} {s.rate:.2f}  (right first tool {s.tool_rate:.2f})")
        print(f"  ({time.process_time() - c0:.0f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
