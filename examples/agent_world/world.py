"""A small tool-use world with a programmatic checker: questions that need the right
tool (a calculator for arithmetic, a lookup for what colour things are today), a
tool call, the tool's result read back, and a final answer. Two LLM calls per episode, and only
the final answer is checked, but the first call's tool choice decides it: credit
assignment matters. A tool asked the wrong kind of question says so in an error
(as real tools do), and the system prompt can carry instructions that the
prompt-sensitive behaviour policy follows (instructions.py, policy.InstructSpec):
what a failure says is what a prompt can fix.

Plain Python, no Nightshift: the agent program, the demo and the learning
benchmark all use it.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable

SYSTEM = "You answer questions. Use one tool, then reply: The answer is X."
#: Things whose colour the lookup knows; colours change every day (every episode),
#: so an answer can only come from the tool, never from memory.
ITEMS = ("lamp", "chair", "kettle", "book", "shirt", "clock", "bike", "phone", "table", "radio", "camera", "guitar")
COLOURS = ("red", "blue", "green", "black", "white", "yellow", "orange", "purple", "pink", "brown", "grey", "gold")
#: The calculator answers in words: every value a tool returns is one word.
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: The tools act on the question they are called about (the agent hands it to
#: them), so choosing one is the whole decision: the world tests tool choice and
#: reading the result back, which a tiny model can learn on a CPU in minutes.
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Compute the arithmetic in the question.",
        "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "lookup", "description": "Look up today's colour of the thing the question asks about.",
        "parameters": {"type": "object", "properties": {}}}},
]
ANSWER_RE = re.compile(r"The answer is ([^.\n]+)\.?")
MAX_CALLS = 3
#: What a tool answers when asked the wrong kind of question: short and the same
#: every time, so failures that share a cause read alike (a critique counts them),
#: and what went wrong is in its first words.
TOOL_ERRORS = {"calculator": "error: cannot calculate a colour", "lookup": "error: cannot look up arithmetic"}
#: What the agent answers after a tool error (it does not retry): a wrong answer.
GAVE_UP = "The answer is unknown."

# --- the "letters" variant (issue 27: APO + sft beats either alone) ----------------------
#: The agent gained a tool the model has never used: a third kind of question (how
#: many letters a word has) needs `counter`, and the prompt-sensitive policy built
#: for this variant (complement.py) almost never calls it unless its system prompt
#: says when to, so its logs hold nearly no rewarded row of that kind for sft to
#: imitate. The other tools' error on it names what is needed, as real tools' errors
#: often do: a prompt can carry that. Off by default (the demo, the tests and their
#: cached policy use the two-tool world); `use("letters")`, or the environment
#: variable below for the agent's own process, turns it on.
VARIANT_ENV = "NIGHTSHIFT_WORLD_VARIANT"
VARIANTS = ("", "letters")
COUNTER = {"type": "function", "function": {
    "name": "counter", "description": "Count the letters of the word in the question.",
    "parameters": {"type": "object", "properties": {}}}}
LETTERS_SHARE = 0.4  # of all questions, in the variant; colour_share splits the rest
LETTER_ERROR = "error: cannot count letters, use counter"
COUNTER_ERROR = "error: no word to count"
WORDS = tuple(w for w in (*ITEMS, *COLOURS) if len(w) < len(NUMBERS))
BASE_TOOLS = TOOLS
VARIANT = ""


def use(variant: str) -> None:
    """Switch the world to `variant` ("" or "letters"), in this process and in the
    agents it starts (they inherit the environment)."""
    global VARIANT, TOOLS
    if variant not in VARIANTS:
        raise ValueError(f"the agent world has no variant {variant!r}; known: {', '.join(v or '(default)' for v in VARIANTS)}")
    VARIANT = variant
    TOOLS = [*BASE_TOOLS, COUNTER] if variant == "letters" else BASE_TOOLS
    if variant:
        os.environ[VARIANT_ENV] = variant
    else:
        os.environ.pop(VARIANT_ENV, None)


@dataclass
class Task:
    question: str
    kind: str  # arithmetic | colour | letters (the variant's)
    truth: str
    colours: dict[str, str] = field(default_factory=dict)  # today's colours, what the lookup tool knows

    @property
    def right_tool(self) -> str:
        return {"arithmetic": "calculator", "colour": "lookup", "letters": "counter"}[self.kind]


def make_task(rng: random.Random, colour_share: float = 0.5) -> Task:
    """A fresh task: a colour question with probability `colour_share`, else
    arithmetic (the learning benchmark moves it between nights: traffic drifts)."""
    colours = {item: rng.choice(COLOURS) for item in ITEMS}
    if VARIANT == "letters" and rng.random() < LETTERS_SHARE:
        word = rng.choice(WORDS)
        return Task(f"How many letters are in the word {word}?", "letters", NUMBERS[len(word)], colours)
    if rng.random() < 1.0 - colour_share:
        while True:  # answers from zero to nine
            a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            if 0 <= value <= 9:
                break
        return Task(f"What is {a} {op} {b}?", "arithmetic", NUMBERS[value], colours)
    item = rng.choice(ITEMS)
    return Task(f"What colour is the {item} today?", "colour", colours[item], colours)


def tool_value(name: str, task: Task) -> str | None:
    """What the tool finds for the task's question, None when the question is not
    one it can answer (the calculator finds no arithmetic in it, the lookup no
    thing it knows). The answer has to be read off the result."""
    q = task.question
    if name == "calculator":
        m = re.search(r"(\d+) ([-+*]) (\d+)", q)
        if not m:
            return None
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return NUMBERS[value] if 0 <= value <= 9 else str(value)
    if name == "lookup":
        m = re.search(r"is the (\w+) today", q)
        return task.colours[m.group(1)] if m and m.group(1) in task.colours else None
    if name == "counter" and VARIANT == "letters":
        m = re.search(r"letters are in the word (\w+)", q)
        return NUMBERS[len(m.group(1))] if m and len(m.group(1)) < len(NUMBERS) else None
    return None


def run_tool(name: str, task: Task) -> str:
    """The tool message's content: `result: <value>`, or the tool's error."""
    value = tool_value(name, task)
    if value is not None:
        return f"result: {value}"
    if VARIANT == "letters":
        if task.kind == "letters" and name in TOOL_ERRORS:
            return LETTER_ERROR
        if name == "counter":
            return COUNTER_ERROR
    return TOOL_ERRORS.get(name, f"error: no such tool {name!r}")


def with_system(messages: list[dict], system: str) -> list[dict]:
    """The messages with their leading system prompt replaced by `system`: what
    `nightshift route` does to a conversation it tries a prompt candidate on (the
    agent itself never changes)."""
    rest = messages[1:] if messages and messages[0].get("role") == "system" else messages
    return [{"role": "system", "content": system}, *rest]


def check(task: Task, final_text: str | None) -> bool:
    m = ANSWER_RE.search(final_text or "")
    return bool(m) and m.group(1).strip() == task.truth


@dataclass
class Episode:
    task: Task
    messages: list[dict] = field(default_factory=list)
    calls: int = 0
    tools_used: list[str] = field(default_factory=list)
    final: str | None = None
    success: bool = False


Chat = Callable[[list[dict]], dict]
"""Given messages, return the assistant message: {"content", "tool_calls": [{"id",
"function": {"name", "arguments"}}]} (the OpenAI shape, as a dict)."""


def run_episode(task: Task, chat: Chat) -> Episode:
    """Ask, run the tools the model calls, ask again, until it answers in text (at
    most MAX_CALLS calls)."""
    ep = Episode(task, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}])
    while ep.calls < MAX_CALLS:
        msg = chat(ep.messages)
        ep.calls += 1
        calls = msg.get("tool_calls") or []
        if not calls:
            ep.final = msg.get("content")
            break
        ep.messages.append({"role": "assistant", "content": msg.get("content"), "tool_calls": calls})
        for c in calls:
            ep.tools_used.append(c["function"]["name"])
            ep.messages.append({"role": "tool", "tool_call_id": c["id"],
                                "content": run_tool(c["function"]["name"], task)})
    ep.success = check(task, ep.final)
    return ep


# --- demonstrations for the behaviour policy ----------------------------------------------


def demonstration(task: Task, rng: random.Random, p_right_tool: float = 0.5, system: str = SYSTEM,
                  p_misread: float = 0.0) -> list[dict]:
    """One episode as a chat, acted out: the right tool with probability
    `p_right_tool` (else another one), then the answer read off the tool's
    result, or given up on after its error (so a wrong tool gives a wrong answer).
    With `p_misread` (the letters variant's policy) the answer is another value of
    the same type instead of the result's, whatever the prompt says: a habit only
    rewarded examples unteach."""
    right = rng.random() < p_right_tool
    if right:
        name = task.right_tool
    elif task.kind == "letters":  # the model knows its two old tools: one of them
        name = "lookup" if rng.random() < 0.6 else "calculator"
    else:
        name = "lookup" if task.right_tool == "calculator" else "calculator"
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    value = tool_value(name, task)
    if value is not None and p_misread and rng.random() < p_misread:
        pool = NUMBERS if value in NUMBERS else COLOURS
        value = rng.choice([v for v in pool if v != value])
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": run_tool(name, task)},
        {"role": "assistant", "content": f"The answer is {value}." if value is not None else GAVE_UP},
    ]


def demonstrations(n: int, seed: int = 0, p_right_tool: float = 0.5) -> list[list[dict]]:
    rng = random.Random(seed)
    return [demonstration(make_task(rng), rng, p_right_tool) for _ in range(n)]


use(os.environ.get(VARIANT_ENV, ""))
