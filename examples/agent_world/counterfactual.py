"""The stage that makes the behaviour policy read what a prompt says, not how long
it is (issue 27 item 8): `PROMPT_SENSITIVE`, the policy the lift test and the
demo's APO arm should use.

The default instruction tuning (instructions.py, policy.InstructSpec) adds lines
mostly when they help, and its policy learned partly that a longer prompt helps
(a placebo line in the stand-in's frame lifts its right first tool by 11
points). Here every prompt gains 0 to `most_lines` lines, each a content in a
frame (an order, a warning, a lesson from past errors, the stand-in proposer's
"Earlier conversations went wrong with: ..."); distractors (slowness, politeness,
timeouts, retries) come in the same frames and counts, and each instructed prompt
is taught beside its counterfactual, the same prompt with a distractor where the
instruction was: only what a line says tells the two apart. Every colour content
names a colour and no arithmetic, every arithmetic content the reverse, no
distractor either.

Started from the behaviour policy (`start="base"`), which picks its tool at a
coin flip whatever it reads, 240 to 730 steps moved the right tool's probability
by at most 5 points for any prompt, taught lines included: with nothing pulling
it to read the prompt, it never did. Started from the default instructed policy
(`start="instructed"`), which does read it, passes at a gentle learning rate keep
the content and drop the length (benchmarks/RESULTS.md, the probe's table):

    python examples/agent_world/prompt_probe.py --episodes 100

One pass did it on the machines the recipe was first tuned on and not on
others: whether a tiny model has learned to read a line when training stops
depends on its floating-point numerics. Eight passes (and four of instruction
tuning) read the stand-in's wording for every seed checked (+0.33 to +0.48); the
placebo stayed within +0.07 for three seeds of four, not for the fourth (+0.19)
(`python examples/agent_world/recipe_check.py --seeds 0,1,2,3`).

What a proposer writes is never among the taught lines verbatim (`taught()`).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import policy
import world

#: How a line is said; every content goes in every frame.
FRAMES = (
    "{x}.",
    "Warning: {x}.",
    "Past mistake: {x}.",
    "Lesson from failures: {x}.",
    "Note: {x}.",
    "Remember: {x}.",
    "Users complained: {x}.",
    "Earlier conversations went wrong with: {x}. Make sure this does not happen.",
    "Earlier conversations went wrong with: {x}. Avoid this.",
    "Problem seen before: {x}. Do not repeat it.",
)
#: Contents that help on colour questions (the calculator cannot answer them).
COLOUR = (
    "the calculator was used for a colour question",
    "the calculator cannot answer a colour question",
    "use the lookup tool for every question about a colour",
    "a colour question needs lookup, never the calculator",
    "colours must be looked up, not calculated",
    "tool error: the calculator was asked for a colour",
    "colour questions were sent to the calculator",
    "only lookup knows the colour of a thing today",
    "calculator failed on a colour",
    "a colour question is not for the calculator",
    "feedback: the calculator gave no colour",
    "when asked what colour something is, call lookup",
)
#: Contents that help on arithmetic questions (lookup cannot compute them).
ARITHMETIC = (
    "lookup was used for an arithmetic question",
    "lookup cannot answer arithmetic",
    "use the calculator for every arithmetic question",
    "arithmetic needs the calculator, never lookup",
    "arithmetic must be calculated, not looked up",
    "tool error: lookup was asked for arithmetic",
    "arithmetic questions were sent to lookup",
    "only the calculator does arithmetic",
    "lookup failed on arithmetic",
    "arithmetic is for the calculator, not lookup",
    "feedback: lookup gave no arithmetic result",
    "when asked for arithmetic, call the calculator",
)
#: Contents that say nothing about which tool a question needs, some about tools,
#: errors and feedback (that a line speaks of past errors must not be what helps).
DISTRACTORS = (
    "the answers were too long",
    "feedback: replies were slow",
    "feedback: the answer was rude",
    "the user was not greeted politely",
    "a tool timed out and nobody said so",
    "a tool was called twice for one question",
    "errors went unreported to the user",
    "the answer was not in English",
    "the reply apologised too much",
    "tool error: timeout after 30 seconds",
    "tool error: rate limit reached, retry later",
    "tool error: connection reset",
    "the final answer was more than one sentence",
    "the reply format was wrong",
    "retries were not attempted after a timeout",
    "be brief and polite",
    "keep the final answer to one sentence",
    "do not apologise in the answer",
    "users dislike slow answers",
    "feedback: too many words",
    "read the question once more before you answer",
    "the answer came late",
    "feedback: the tone was cold",
    "never guess when a tool can tell you",
)
KINDS = {"colour": COLOUR, "arithmetic": ARITHMETIC}


def taught() -> set[str]:
    """Every line the instruction-tuning stage can put in a prompt: what a held-out
    wording must not be."""
    return {f.format(x=c) for f in FRAMES for c in (*COLOUR, *ARITHMETIC, *DISTRACTORS)}


def fingerprint() -> str:
    """A hash of the lines above, part of policy.InstructSpec's cache key: a changed
    line is a different policy."""
    return hashlib.sha256(repr((FRAMES, COLOUR, ARITHMETIC, DISTRACTORS)).encode()).hexdigest()[:12]


def _line(rng: random.Random, content: str) -> str:
    return rng.choice(FRAMES).format(x=content)


def draw_pair(rng: random.Random, base: str, instructed: float = 0.5, both: float = 1 / 3,
              most: int = 2) -> tuple[str, set[str], str]:
    """(prompt, the question kinds it helps, its counterfactual) for one
    demonstration: the agent's `base` prompt and 0 to `most` added lines (as a
    proposer appends them), distractors, with probability `instructed` one of them
    (two, for both kinds, in a third of the prompts with room) an instruction
    instead. The counterfactual has the distractors in those places: taught side by
    side, the two differ only in what the instruction says."""
    k = rng.randint(0, most)
    if k == 0:
        return base, set(), base
    plain = [_line(rng, c) for c in rng.sample(DISTRACTORS, k)]
    lines, helps = list(plain), set()
    if rng.random() < instructed:
        kinds = ["colour", "arithmetic"] if k >= 2 and rng.random() < both else [rng.choice(("colour", "arithmetic"))]
        for slot, kind in zip(rng.sample(range(k), len(kinds)), kinds):
            lines[slot] = _line(rng, rng.choice(KINDS[kind]))
            helps.add(kind)
    return "\n".join([base, *lines]), helps, "\n".join([base, *plain])


@dataclass
class CounterfactualSpec:
    """The recipe's settings on top of the behaviour policy `base`; cached by key
    like policy.InstructSpec, the taught lines part of the key."""

    base: policy.PolicySpec = field(default_factory=policy.PolicySpec)
    # what the stage continues from: "base", the behaviour policy (it then learned
    # nothing of the prompt), or "instructed", policy.InstructSpec's policy, which
    # reads the prompt but also its length: the twins unteach the length
    start: str = "base"
    # the instruction-tuning stage's settings, when start is "instructed" (None: its
    # defaults on `base`); part of the key, so a changed recipe is a different policy
    instruct: policy.InstructSpec | None = None
    demos: int = 1600  # counterfactual twins included
    instructed: float = 0.5  # share of prompts with added lines whose lines include an instruction
    both: float = 1 / 3  # share of instructed prompts (with room for two lines) speaking of both kinds
    most_lines: int = 2  # 0..most_lines lines added to every prompt, uniformly
    p_right_tool: float = 0.5  # for a kind the prompt does not speak of
    p_right_instructed: float = 1.0
    # only the decision is taught in every demonstration; reading a result back, which
    # the base policy does, in this share, so a longer prompt does not unteach it
    read: float = 0.2
    epochs: float = 3  # an int, as the tried variants were keyed (a JSON 3, not 3.0)
    learning_rate: float = 2e-3
    seed: int = 0

    def key(self) -> str:
        fields = {**asdict(self), "lines": fingerprint()}
        del fields["instruct"]
        if self.start == "base":  # as the first variants were keyed, before `start` was
            del fields["start"]
        else:
            fields["start"] = f"instructed-{self.instructed_spec().key()}"
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def instructed_spec(self) -> policy.InstructSpec:
        """The instruction-tuning stage this one continues from (start "instructed")."""
        return self.instruct or policy.InstructSpec(base=self.base)


#: The recipe that reads what a prompt says (benchmarks/RESULTS.md): the default
#: instructed policy, then eight passes over counterfactual twins, most prompts with
#: lines instructing, at a learning rate low enough to keep what it had learned (one
#: pass read prompts only where it was tuned; three or five left a placebo line
#: lifting the right tool 8-11 points for some seeds: recipe_check.py).
PROMPT_SENSITIVE = CounterfactualSpec(start="instructed", instructed=0.85, both=0.5, p_right_instructed=0.95,
                                      epochs=8, learning_rate=5e-4)


def demonstrations(spec: CounterfactualSpec) -> list[tuple[list[dict], bool]]:
    """Acted-out chats (the right tool more often where the prompt says which tool
    that kind of question needs), twins next to each other, with whether each
    one's read-back call is taught."""
    rng = random.Random(spec.seed)
    out: list[tuple[list[dict], bool]] = []
    while len(out) < spec.demos:
        task = world.make_task(rng)
        system, helps, plain = draw_pair(rng, world.SYSTEM, spec.instructed, spec.both, spec.most_lines)
        for prompt, kinds in ((system, helps), (plain, set())) if helps else ((system, helps),):
            p = spec.p_right_instructed if task.kind in kinds else spec.p_right_tool
            out.append((world.demonstration(task, rng, p, prompt), rng.random() < spec.read))
    return out


def rows(spec: CounterfactualSpec) -> list[dict]:
    """The demonstrations as transitions, in policy._rows's shape."""
    return rows_of(demonstrations(spec))


def rows_of(chats: list[tuple[list[dict], bool]]) -> list[dict]:
    """Acted-out chats, with whether each one's read-back call is taught, as transitions."""
    from nightshift.schemas import SCHEMA_VERSION

    def message(m: dict) -> dict:
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in m.get("tool_calls") or []]
        return {"role": m["role"], "content": m.get("content"), "name": None, "tool_calls": calls or None,
                "tool_call_id": m.get("tool_call_id")}

    out = []
    for i, (chat, read) in enumerate(chats):
        cuts = (2, 4) if read else (2,)
        for step, cut in enumerate(cuts):
            out.append({"transition_id": f"{i:016x}{step:016x}", "trace_id": f"{i:032x}", "span_id": f"{step:016x}",
                        "trajectory_id": f"{i:032x}", "group_id": None, "step": step, "num_steps": len(cuts),
                        "agent_name": "demo", "service_name": "demo", "model": "demo", "provider": None,
                        "input_messages": [message(m) for m in chat[:cut]], "output_message": message(chat[cut]),
                        "tools": json.dumps(world.TOOLS), "finish_reason": None, "prompt_token_ids": None,
                        "completion_token_ids": None, "completion_logprobs": None, "input_tokens": None,
                        "output_tokens": None, "reward": 1.0, "reward_source": "demo", "return": 1.0,
                        "advantage": 0.0, "start_time": None, "end_time": None, "convention": "demo",
                        "truncated": False, "weight": 1.0, "flags": [], "schema_version": SCHEMA_VERSION})
    return out


def build(out: Path, spec: CounterfactualSpec | None = None, progress: bool = True) -> Path:
    """The recipe's policy under `out`, from the behaviour policy (built beside it or
    reused), unless a folder built with the same spec is there."""
    import shutil
    import tempfile

    spec = spec or CounterfactualSpec()
    out = Path(out)
    stamp = out / "policy-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == spec.key():
        return out
    policy.two_tool_world("the counterfactual policy")
    if spec.start == "instructed":
        ispec = spec.instructed_spec()
        base = policy.build_instructed(out.parent / f"instructed-{ispec.key()}", ispec, progress)
    elif spec.start == "base":
        base = policy.build(out.parent / f"policy-{spec.base.key()}", spec.base, progress)
    else:
        raise ValueError(f"CounterfactualSpec.start must be 'base' or 'instructed', not {spec.start!r}")
    work = Path(tempfile.mkdtemp(prefix="agent-world-counterfactual-"))
    try:
        result = policy._train(work, 0, rows(spec), base, spec.epochs, spec.learning_rate, spec.base.batch_size,
                               spec.seed, progress, policy.READING_THREADS)
        return policy._install(result, out, spec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
