"""Success rate of a policy on fresh episodes, in process (no HTTP, no spans): the
learning benchmark's and the tests' judge. The same episode loop as the agent,
the same sampling (temperature 1) through Nightshift's serving engine.

Two scores with the same `seed` are paired: the same tasks, and each episode's
k-th call samples with the same seed in both (common random numbers), so two
close policies agree on most episodes and their difference is measured on the
few where they do not, as the gate's checker measures it (gate_check.py)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import world


@dataclass
class Score:
    episodes: int
    successes: int
    right_tool: int  # first tool call was the right tool
    outcomes: list[bool] = field(default_factory=list, repr=False)  # per episode, in task order
    kinds: list[str] = field(default_factory=list, repr=False)  # each episode's question kind, in task order

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (successes, episodes)."""
        out: dict[str, tuple[int, int]] = {}
        for kind, ok in zip(self.kinds, self.outcomes):
            k, n = out.get(kind, (0, 0))
            out[kind] = (k + ok, n + 1)
        return out

    @property
    def rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0

    @property
    def tool_rate(self) -> float:
        return self.right_tool / self.episodes if self.episodes else 0.0


def engine_chat(engine, adapter: str | None, temperature: float = 1.0, seed: int = 0, system: str | None = None):
    """A chat function on the engine whose n-th call samples with seed `seed *
    1_000_003 + n`; `system` replaces the system prompt the agent sends (the
    route's role, until the real route is in front: world.with_system)."""
    from nightshift.trainer.render import parse_tool_calls

    counter = [seed * 1_000_003]

    def chat(messages: list[dict]) -> dict:
        counter[0] += 1
        if system is not None:
            messages = world.with_system(messages, system)
        prompt = engine.prompt_ids(messages, world.TOOLS)
        ids = [s.token_id for s in engine.decode_steps(adapter, prompt, 48, temperature, 1.0, 0, counter[0])]
        content, calls = parse_tool_calls(engine.finish_text(ids))
        return {"content": content, "tool_calls": calls}

    return chat


def score(model_dir: str, adapter_dir: str | None = None, episodes: int = 200, seed: int = 12345,
          temperature: float = 1.0, engine=None, colour_share: float = 0.5, system: str | None = None) -> Score:
    from nightshift.serve.engine import Engine

    engine = engine or Engine(str(model_dir), "policy")
    name = None
    if adapter_dir:
        name = "candidate"
        engine.load_adapter(name, str(adapter_dir), load_inplace=True)
    rng = random.Random(seed)
    ok = right = 0
    outcomes, kinds = [], []
    for i in range(episodes):
        task = world.make_task(rng, colour_share)
        # each episode's calls seeded from its index: a policy that takes one call more
        # in episode i does not shift the random numbers of every episode after it
        ep = world.run_episode(task, engine_chat(engine, name, temperature, seed * 7919 + i * (world.MAX_CALLS + 1),
                                                 system))
        ok += ep.success
        outcomes.append(ep.success)
        kinds.append(task.kind)
        right += bool(ep.tools_used) and ep.tools_used[0] == task.right_tool
    return Score(episodes, ok, right, outcomes, kinds)


def right_tool_probability(model_dir: str, systems: dict[str, str | None], tasks: int = 200,
                           seed: int = 4242) -> dict[str, dict[str, float]]:
    """Per prompt (None: the agent's own), the probability the policy gives the right
    tool at its first call, teacher-forced on the same `tasks` fresh questions (the
    choice between the two tools' names, by kind and overall). No sampling: a
    prompt's effect on the decision without the noise of 100 episodes, in seconds,
    which is how instruction-tuning variants were compared (benchmarks/RESULTS.md)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = random.Random(seed)
    qs = [world.make_task(rng) for _ in range(tasks)]
    names = [t["function"]["name"] for t in world.TOOLS]  # the variant's third tool too
    out = {}
    for label, system in systems.items():
        by_kind: dict[str, list[float]] = {"arithmetic": [], "colour": [], "letters": []}
        for task in qs:
            prefix = tok.apply_chat_template([{"role": "system", "content": system or world.SYSTEM},
                                              {"role": "user", "content": task.question}], tools=world.TOOLS,
                                             tokenize=False, add_generation_prompt=True)
            start = len(tok(prefix)["input_ids"])
            logp = {}
            for name in names:
                ids = tok(prefix + '<tool_call>{"name": "' + name + '"')["input_ids"]
                with torch.no_grad():
                    lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
                logp[name] = sum(lp[i - 1, ids[i]].item() for i in range(start, len(ids)))
            z = sum(math.exp(v) for v in logp.values())
            by_kind[task.kind].append(math.exp(logp[task.right_tool]) / z)
        out[label] = {k: sum(v) / len(v) for k, v in by_kind.items() if v}
        out[label]["all"] = sum(sum(v) for v in by_kind.values()) / tasks
    return out


def read_probability(model_dir: str, systems: dict[str, str | None], tasks: int = 200,
                     seed: int = 4242) -> dict[str, float]:
    """Per prompt (None: the agent's own), the probability that the policy answers the
    value the right tool returned, teacher-forced after that tool's result (the
    read-back step alone, on the same `tasks` fresh questions). The letters variant's
    policy misreads whatever the prompt says: this shows whether a prompt moves it."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nightshift.trainer.render import chat_message

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng = random.Random(seed)
    qs = [world.make_task(rng) for _ in range(tasks)]
    out = {}
    for label, system in systems.items():
        total = 0.0
        for task in qs:
            value = world.tool_value(task.right_tool, task)
            msgs = [{"role": "system", "content": system or world.SYSTEM}, {"role": "user", "content": task.question},
                    chat_message({"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "name": task.right_tool, "arguments": "{}"}]}),
                    {"role": "tool", "tool_call_id": "call_1", "content": world.run_tool(task.right_tool, task)}]
            prefix = tok.apply_chat_template(msgs, tools=world.TOOLS, tokenize=False,
                                             add_generation_prompt=True) + "The answer is"
            start = len(tok(prefix)["input_ids"])
            ids = tok(prefix + f" {value}.")["input_ids"]  # the value and its full stop (~1 after the value)
            with torch.no_grad():
                lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            total += math.exp(sum(lp[i - 1, ids[i]].item() for i in range(start, len(ids))))
        out[label] = total / tasks
    return out
