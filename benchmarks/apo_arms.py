"""The learning benchmark's prompt-optimization arms (issue 27): what each arm asks
of `nightshift nightly`, the proposers they call, and what serves on the route.

    apo          nightly.experiments: prompts (no weight training, as for a hosted
                 model): one APO round a night against the stand-in proposer, its
                 candidate on a share of the agent's conversations through the
                 lineage's own `nightshift route`, promoted or stopped by the watch
    apo+sft      nightly.experiments: both, on the one agent: the two kinds take turns
                 (nightly/experiments.py: the prompt first on a fresh agent, then the
                 kind that did not go last, the other when that one has nothing to
                 try); while a prompt canary is judged no adapter is trained or
                 published (never two experiments on one agent)
    apo-placebo  the `apo` pipeline with a proposer that appends two lines in the
                 stand-in's own frame and length that say nothing about the task:
                 what `apo` gains beyond it is what the failures said, not a longer
                 prompt (benchmarks/RESULTS.md: on an earlier policy a placebo line
                 lifted as much as the proposal)

Each apo lineage has its own route process: a prompt route is keyed by the hash of
the prompt the agent sends, and every lineage's agent sends the same one.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from support.proposer_standin import Standin, _blocks  # noqa: E402

#: arm -> nightly.experiments for its agent
ARMS = {"apo": "prompts", "apo+sft": "both", "apo-placebo": "prompts"}

#: The placebo's problems: the stand-in's frame ("Earlier conversations went wrong
#: with: ... Make sure this does not happen."), about as long, about nothing the
#: world's tasks need. Not among instructions.DISTRACTORS: the policy never saw them.
PLACEBO_PROBLEMS = ("replies that were worded more formally than users like",
                    "answers that repeated the question back to the user")


def is_apo(alg: str) -> bool:
    return alg in ARMS


def lineage(alg: str, seed: int) -> str:
    """The lineage's name (its folder, served and stable name): '+' is no name's character."""
    return f"{alg.replace('+', '-')}-s{seed}"


class PlaceboProposer(Standin):
    """A proposer that reads nothing: every edit is the prompt it was sent plus the
    two fixed placebo lines (the critique is the stand-in's, unused)."""

    def answer(self, body: dict) -> tuple[int, bytes]:
        text = "".join(m.get("content") or "" for m in body.get("messages") or [] if m.get("role") == "user")
        blocks = _blocks(text)
        if "critique" not in blocks:
            return super().answer(body)
        lines = [blocks.get("prompt", "")] + [f"Earlier conversations went wrong with: {p}. Make sure this does not "
                                              "happen." for p in PLACEBO_PROBLEMS]
        content = "<prompt>\n" + "\n".join(x for x in lines if x) + "\n</prompt>"
        reply = {"id": "chatcmpl-placebo", "object": "chat.completion", "model": self.model,
                 "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}]}
        return 200, json.dumps(reply).encode()


@dataclass
class PromptState:
    """What the lineage's route does with the agent's prompt after a night."""

    serving: str  # "base" (the agent's own prompt) or the promoted candidate's version
    serving_system: str | None  # the promoted candidate's text (None: the agent's own)
    candidate: str | None  # the candidate started tonight, if one was
    candidate_system: str | None
    trial: str  # one line: what is on trial now


def _system(entry: dict) -> str | None:
    man = json.loads((Path(entry["path"]) / "manifest.json").read_text())
    system = man["candidate"]["system"]
    return system[0] if isinstance(system, list) else system


def prompt_state(store: Path, started_tonight: list[str]) -> PromptState:
    """From the trials record (publish/prompt_canary.py): the promoted candidate the
    route applies, and the one `nightshift nightly` started tonight (its `prompts`
    lines name it: "<agent>: prompt candidate vNNNN (...) on N % ...")."""
    from nightshift.publish import prompt_canary as trials

    entries = trials.read(str(store)) if (store / "trials.json").exists() else []
    applied = trials.applied(entries)
    running = trials.running(entries)
    promoted = applied[-1] if applied else None
    serving = next((e for e in entries if e["role"] == "canary" and promoted
                    and e.get("version") == promoted.get("version")), None)
    new = next((m.group(1) for line in started_tonight for m in [re.search(r": prompt candidate (v\d+) \(", line)] if m),
               None)
    cand = next((e for e in entries if e["role"] == "canary" and e.get("version") == new), None) if new else None
    trial = (f"{running[0]['version']} on trial ({100 * running[0]['share']:.0f} %)" if running
             else "nothing on trial")
    return PromptState(promoted["version"] if promoted else "base", _system(serving) if serving else None,
                       new if cand else None, _system(cand) if cand else None, trial)
