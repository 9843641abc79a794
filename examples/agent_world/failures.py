"""What fails, by question kind and step: which failures a prompt could fix (a wrong
first tool, whose error a proposer reads) and which it could not (a result misread
after the right tool: no error says so). Scores a policy (an adapter, a system
prompt) on fresh episodes, as evaluate.score does, and counts:

    python examples/agent_world/failures.py --model DIR [--adapter DIR] [--system-file F]
                                            [--episodes 80] [--world letters]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import evaluate  # noqa: E402
import world  # noqa: E402

OUTCOMES = ("ok", "wrong tool", "no tool", "misread", "other")


def outcome(ep: world.Episode) -> str:
    """One episode's outcome: ok; wrong tool (first call to a tool that cannot answer
    it); no tool (answered without one); misread (the right tool, then an answer
    that is not its result); other (no answer in format, a retry, ...)."""
    if ep.success:
        return "ok"
    if not ep.tools_used:
        return "no tool"
    if ep.tools_used[0] != ep.task.right_tool:
        return "wrong tool"
    if world.ANSWER_RE.search(ep.final or ""):
        return "misread"
    return "other"


def breakdown(engine, adapter: str | None, episodes: int, seed: int, system: str | None = None,
              colour_share: float = 0.5) -> Counter:
    """(kind, outcome) -> episodes, on evaluate.score's episodes for the same seed."""
    name = None
    if adapter:
        name = "candidate"
        engine.load_adapter(name, str(adapter), load_inplace=True)
    rng = random.Random(seed)
    out: Counter = Counter()
    for i in range(episodes):
        task = world.make_task(rng, colour_share)
        ep = world.run_episode(task, evaluate.engine_chat(engine, name, 1.0, seed * 7919 + i * (world.MAX_CALLS + 1),
                                                          system))
        out[(task.kind, outcome(ep))] += 1
    return out


def lines(counts: Counter) -> list[str]:
    kinds = sorted({k for k, _ in counts})
    out = [f"{'kind':<11}" + "".join(f"{o:>11}" for o in OUTCOMES)]
    for kind in kinds:
        out.append(f"{kind:<11}" + "".join(f"{counts[(kind, o)]:>11}" for o in OUTCOMES))
    total = sum(counts.values())
    out.append(f"{'all %':<11}" + "".join(f"{100 * sum(v for (k, o2), v in counts.items() if o2 == o) / total:>10.1f}%"
                                          for o in OUTCOMES))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter")
    ap.add_argument("--system-file", help="a file holding the system prompt the route would put in (default: the agent's)")
    ap.add_argument("--episodes", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1003)
    ap.add_argument("--world", default="", choices=world.VARIANTS)
    args = ap.parse_args()
    world.use(args.world)
    from nightshift.serve.engine import Engine

    system = Path(args.system_file).read_text() if args.system_file else None
    counts = breakdown(Engine(args.model, "policy"), args.adapter, args.episodes, args.seed, system)
    print("\n".join(lines(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
