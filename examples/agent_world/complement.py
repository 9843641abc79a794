"""The policy of the world's "letters" variant (world.use("letters")), where a prompt
and logged data fix DIFFERENT failures, as they do for real agents (issue 27:
"APO + sft beats either alone"). On the two-tool world both fixed the same one
(which tool a question needs): once sft had taught tool choice (~91 % in a night),
a prompt had nothing left to add (benchmarks/RESULTS.md).

Continued from counterfactual.PROMPT_SENSITIVE (cached), one more stage of acted
demonstrations with the third tool offered:

- what only a prompt can carry: questions about how many letters a word has need
  `counter`, which the policy never calls (`p_letters`) unless its system prompt
  says when to (then `p_right_instructed`): its own logs hold almost
  no rewarded row of that kind for filtered sft to imitate, while the other tools'
  error on it (world.LETTER_ERROR) says what is needed, which a proposer can read;
- what only logged data teaches: after a result, the policy answers another value
  of the same type `p_misread` of the time, whatever the prompt says (every prompt,
  instructed or not, carries the same habit); those failures carry no tool error,
  so a proposer has nothing to read in them, and rewarded rows unteach it.

The old kinds stay as PROMPT_SENSITIVE taught them (instructions help, at a coin
flip without), taught again beside their counterfactual twins. What a proposer
writes is never among the taught lines verbatim (`taught()`; the stand-in's
quotes of world.LETTER_ERROR included: tests/test_world_letters.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import counterfactual
import world

#: Contents that help on letter questions; every one names letters, none a colour
#: or arithmetic, no distractor any of them.
LETTERS = (
    "letter counts need the counter tool",
    "use counter for every question about letters",
    "the lookup tool cannot count letters",
    "the calculator cannot count the letters of a word",
    "tool error: lookup was asked how many letters a word has",
    "questions about letters go to counter",
    "count letters with counter, never with lookup or the calculator",
    "feedback: letters were looked up instead of counted",
    "only counter knows how many letters a word has",
    "the calculator failed on a letter count",
    "when asked how many letters, call counter",
    "letters are counted by counter",
)
KINDS = {**counterfactual.KINDS, "letters": LETTERS}


def taught() -> set[str]:
    """Every line this stage (and the ones before it) can put in a prompt."""
    return counterfactual.taught() | {f.format(x=c) for f in counterfactual.FRAMES for c in LETTERS}


def fingerprint() -> str:
    return hashlib.sha256(repr((counterfactual.fingerprint(), LETTERS)).encode()).hexdigest()[:12]


def draw_pair(rng: random.Random, base: str, instructed: float, most: int = 2,
              letters_weight: int = 2) -> tuple[str, set[str], str]:
    """counterfactual.draw_pair with the letters kind among the instructions: 0 to
    `most` added lines, distractors, with probability `instructed` one or two of
    them instructions (each for a kind drawn apart), and the twin with the
    distractors in their places."""
    k = rng.randint(0, most)
    if k == 0:
        return base, set(), base
    plain = [counterfactual._line(rng, c) for c in rng.sample(counterfactual.DISTRACTORS, k)]
    lines, helps = list(plain), set()
    if rng.random() < instructed:
        kinds: list[str] = []
        pool = ("letters",) * letters_weight + ("colour", "arithmetic")
        for _ in range(rng.randint(1, k)):  # letters weighted: the new tool has the most to learn
            kinds.append(rng.choice([x for x in pool if x not in kinds]))
        for slot, kind in zip(rng.sample(range(k), len(kinds)), kinds):
            lines[slot] = counterfactual._line(rng, rng.choice(KINDS[kind]))
            helps.add(kind)
    return "\n".join([base, *lines]), helps, "\n".join([base, *plain])


@dataclass
class LettersSpec:
    """The stage's settings on top of counterfactual.PROMPT_SENSITIVE; cached by key."""

    start: counterfactual.CounterfactualSpec = field(default_factory=lambda: counterfactual.PROMPT_SENSITIVE)
    demos: int = 2400  # counterfactual twins included
    instructed: float = 0.85
    p_right_tool: float = 0.5  # an old kind the prompt does not speak of
    # a letters question the prompt does not speak of: never (0.02 left about one rewarded
    # row a night, and sft alone learned the counter from it: 82.5 % after night 1)
    p_letters: float = 0.0
    p_right_instructed: float = 0.95
    p_misread: float = 0.25
    read: float = 0.6  # share of demonstrations whose read-back call is taught (the habit is set there)
    epochs: float = 3
    learning_rate: float = 5e-4  # 7.5e-4 over 2 epochs: see letters_weight
    seed: int = 0
    # how many times letters is in the pool an instruction's kind is drawn from (the old
    # kinds once each). With 2 epochs at 7.5e-4 the stage overwrote the old kinds'
    # reading (a colour line lifted colour 0.02-0.13, not > 0.2); at 5e-4 over 3 epochs
    # 2 keeps it for three seeds of four (0.34-0.41; the fourth -0.57) and reads the
    # held-out letters line (0.91-1.00), where 1 read it at 0.81 for seed 0
    # (recipe_check.py; benchmarks/RESULTS.md)
    letters_weight: int = 2

    def key(self) -> str:
        fields = {**asdict(self), "start": self.start.key(), "lines": fingerprint(), "world": [
            world.LETTERS_SHARE, world.LETTER_ERROR, world.COUNTER_ERROR, world.COUNTER]}
        if self.letters_weight == 2:  # as the specs were keyed before it was a setting
            del fields["letters_weight"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


#: The policy benchmarks/learning.py --world letters serves.
LETTERS_POLICY = LettersSpec()


def demonstrations(spec: LettersSpec) -> list[tuple[list[dict], bool]]:
    """Acted-out chats of the variant (it switches this process's world to it), twins
    next to each other, with whether each one's read-back call is taught."""
    world.use("letters")
    rng = random.Random(spec.seed)
    out: list[tuple[list[dict], bool]] = []
    while len(out) < spec.demos:
        task = world.make_task(rng)
        system, helps, plain = draw_pair(rng, world.SYSTEM, spec.instructed, letters_weight=spec.letters_weight)
        for prompt, kinds in ((system, helps), (plain, set())) if helps else ((system, helps),):
            p = (spec.p_right_instructed if task.kind in kinds
                 else spec.p_letters if task.kind == "letters" else spec.p_right_tool)
            out.append((world.demonstration(task, rng, p, prompt, spec.p_misread), rng.random() < spec.read))
    return out


def build(out: Path, spec: LettersSpec | None = None, progress: bool = True) -> Path:
    """The variant's policy under `out`, from PROMPT_SENSITIVE (built beside it or
    reused), unless a folder built with the same spec is there. Switches this
    process's world to the variant (its demonstrations need the third tool)."""
    import shutil
    import tempfile

    import policy

    spec = spec or LettersSpec()
    out = Path(out)
    stamp = out / "policy-spec.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == spec.key():
        world.use("letters")
        return out
    # the stages it continues from are the two-tool world's, cached under keys that
    # name no variant: built here in the letters world (as they were when this test
    # module built the chain first), their demonstrations held letters questions and a
    # third tool, and the cache then served that policy to the two-tool world's tests
    world.use("")
    base = counterfactual.build(out.parent / f"counterfactual-{spec.start.key()}", spec.start, progress)
    world.use("letters")
    work = Path(tempfile.mkdtemp(prefix="agent-world-letters-"))
    try:
        result = policy._train(work, 0, counterfactual.rows_of(demonstrations(spec)), base, spec.epochs,
                               spec.learning_rate, spec.start.base.batch_size, spec.seed, progress,
                               policy.READING_THREADS)
        return policy._install(result, out, spec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
