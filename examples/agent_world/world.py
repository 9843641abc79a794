"""A small tool-use world with a programmatic checker: questions that need the right
tool (a calculator for arithmetic, a lookup for what colour things are today), a
tool call, the tool's result read back, and a final answer. Two LLM calls per episode, and only
the final answer is checked, but the first call's tool choice decides it: credit
assignment matters.

Plain Python, no Nightshift: the agent program, the demo and the learning
benchmark all use it.
"""

from __future__ import annotations

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


@dataclass
class Task:
    question: str
    kind: str  # arithmetic | colour
    truth: str
    colours: dict[str, str] = field(default_factory=dict)  # today's colours, what the lookup tool knows
    misread: str = "zero"  # what the calculator makes of a question with no arithmetic in it

    @property
    def right_tool(self) -> str:
        return "calculator" if self.kind == "arithmetic" else "lookup"


def make_task(rng: random.Random, colour_share: float = 0.5) -> Task:
    """A fresh task: a colour question with probability `colour_share`, else
    arithmetic (the learning benchmark moves it between nights: traffic drifts)."""
    colours = {item: rng.choice(COLOURS) for item in ITEMS}
    misread = rng.choice(NUMBERS)
    if rng.random() < 1.0 - colour_share:
        while True:  # answers from zero to nine
            a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            if 0 <= value <= 9:
                break
        return Task(f"What is {a} {op} {b}?", "arithmetic", NUMBERS[value], colours, misread)
    item = rng.choice(ITEMS)
    return Task(f"What colour is the {item} today?", "colour", colours[item], colours, misread)


def tool_value(name: str, task: Task) -> str:
    """What the tool finds for the task's question. Asked the wrong question, a tool
    still answers (as real ones do): the calculator reads some number into it,
    the lookup returns the colour of the item nearest the question. So the
    answer always has to be read off the result, and a wrong tool means a wrong one."""
    q = task.question
    if name == "calculator":
        m = re.search(r"(\d+) ([-+*]) (\d+)", q)
        if not m:
            return task.misread
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return NUMBERS[value] if 0 <= value <= 9 else str(value)
    if name == "lookup":
        m = re.search(r"is the (\w+) today", q)
        item = m.group(1) if m and m.group(1) in task.colours else ITEMS[sum(map(ord, q)) % len(ITEMS)]
        return task.colours[item]
    return "no such tool"


def run_tool(name: str, task: Task) -> str:
    """The tool message's content: `result: <value>`."""
    return f"result: {tool_value(name, task)}"


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


def demonstration(task: Task, rng: random.Random, p_right_tool: float = 0.5) -> list[dict]:
    """One episode as a chat, acted out: the right tool with probability
    `p_right_tool` (else the other one), then the answer read off the tool's
    result (so a wrong tool gives a wrong answer)."""
    right = rng.random() < p_right_tool
    name = task.right_tool if right else ("lookup" if task.right_tool == "calculator" else "calculator")
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    result = run_tool(name, task)
    value = tool_value(name, task)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "assistant", "content": f"The answer is {value}."},
    ]


def demonstrations(n: int, seed: int = 0, p_right_tool: float = 0.5) -> list[list[dict]]:
    rng = random.Random(seed)
    return [demonstration(make_task(rng), rng, p_right_tool) for _ in range(n)]
