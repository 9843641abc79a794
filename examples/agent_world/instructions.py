"""What the behaviour policy reads in a system prompt: instructions it learns to
follow in its instruction-tuning stage (policy.InstructSpec), the way an instruction-tuned LLM arrives knowing how to
follow a prompt it has never seen. This is the world's prompt-sensitive part
(issue 27): with the agent's own prompt the policy picks the right tool about
half the time; a prompt that says which tool a kind of question needs makes it
pick right most of the time for that kind.

Each kind of question has several paraphrases, in different frames (an order, a
warning, a lesson from past errors), and prompts also carry distractors:
instructions that say nothing about tools and questions, in the same frames, so
that the policy learns to read what an instruction says, not that any added text
helps. What a proposer writes is never among them verbatim (a test holds the
stand-in proposer's wording out and checks it): a lift on its proposal measures
whether the failures it read point at the fix, which is what APO can know.
"""

from __future__ import annotations

import random

#: Instructions that help on colour questions (the calculator cannot answer them).
COLOUR = (
    "Use the lookup tool for every question about a colour.",
    "A question about a colour needs the lookup tool, never the calculator.",
    "Never send a colour question to the calculator.",
    "Colours change daily: look them up with lookup.",
    "Past mistake: the calculator was used for a colour, which it cannot compute.",
    "Lesson from failures: colour questions go to lookup.",
    "Warning: the calculator fails on colour questions.",
    "When asked what colour something is, call lookup.",
)
#: Instructions that help on arithmetic questions (lookup cannot compute them).
ARITHMETIC = (
    "Use the calculator for every arithmetic question.",
    "A sum or product needs the calculator, never the lookup tool.",
    "Never send arithmetic to the lookup tool.",
    "Numbers are computed: use the calculator for arithmetic.",
    "Past mistake: lookup was used for arithmetic, which it cannot look up.",
    "Lesson from failures: arithmetic goes to the calculator.",
    "Warning: lookup fails on arithmetic questions.",
    "When asked to compute with numbers, call the calculator.",
)
#: Instructions that carry nothing about which tool a question needs.
DISTRACTORS = (
    "Be brief and polite.",
    "Answer in English.",
    "Past mistake: answers were too long.",
    "Lesson from failures: read the question once more before you answer.",
    "Warning: users dislike slow answers.",
    "Keep the final answer to one sentence.",
    "Do not apologise in the answer.",
    "Never guess when a tool can tell you.",
    # about tools and errors, but not about which tool a question needs: that a prompt
    # speaks of past errors must not be what helps (the stand-in proposer's frame)
    "Past mistake: a tool was called twice for one question.",
    "Warning: a tool can time out; say so if it does.",
    "Lesson from failures: errors went unreported to the user.",
    "Earlier answers were slow: make sure this does not happen again.",
)
KINDS = {"colour": COLOUR, "arithmetic": ARITHMETIC}


def draw(rng: random.Random, base: str, instructed: float = 0.5, distracted: float = 0.25,
         both: float = 1 / 3) -> tuple[str, set[str]]:
    """A system prompt for one demonstration and the question kinds it helps: the
    agent's own `base` prompt, with probability `distracted` one or two
    distractors, and with probability `instructed` instructions for one kind or
    both, each a paraphrase drawn at random, placed after the base prompt (as a
    proposer appends them) or, sometimes, before it."""
    lines, helps = [], set()
    if rng.random() < distracted:
        lines += rng.sample(DISTRACTORS, rng.choice((1, 2)))
    if rng.random() < instructed:
        kinds = ("colour", "arithmetic") if rng.random() < both else rng.choice((("colour",), ("arithmetic",)))
        for kind in kinds:
            lines.append(rng.choice(KINDS[kind]))
            helps.add(kind)
    rng.shuffle(lines)
    if not lines:
        return base, helps
    if rng.random() < 0.2:
        return "\n".join([*lines, base]), helps
    return "\n".join([base, *lines]), helps
