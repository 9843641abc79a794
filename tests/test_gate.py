"""The default gate on the agent world: candidates trained from the same logged
episodes, one good, one on reward-inverted data, one with a learning rate that
wrecks its output format. The gate must pass the first and block the others
with no help from the training objective (a gate that passes or blocks
everything fails here), and say why in numbers."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from nightshift.settings import apply
from nightshift.trainer.config import TrainConfig
from nightshift.publish.gate import GateSettings, gate, valid_output
from nightshift.trainer.run import train
from transitions_data import write

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agent_world"))

EPISODES = 160


def _message(m: dict) -> dict:
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in m.get("tool_calls") or []]
    return {"role": m["role"], "content": m.get("content"), "name": None, "tool_calls": calls or None,
            "tool_call_id": m.get("tool_call_id")}


def _logged_episodes(policy_dir: Path, n: int, invert: bool = False) -> list[dict]:
    """The behaviour policy's own episodes at temperature 1, as the transitions the
    build writes (one row per call, reward = the checker's, credited to every call)."""
    import evaluate
    import world

    from nightshift.serve.engine import Engine

    engine = Engine(str(policy_dir), "world-policy")
    chat = evaluate.engine_chat(engine, None, 1.0, seed=7)
    rng = random.Random(7)
    rows, eps = [], []
    for i in range(n):
        calls = []

        def recording(messages, _calls=calls):
            out = chat(messages)
            _calls.append(([dict(m) for m in messages], out))
            return out

        ep = world.run_episode(world.make_task(rng), recording)
        eps.append((i, ep, calls))
    mean = sum(ep.success for _, ep, _ in eps) / len(eps)
    for i, ep, calls in eps:
        r = float(ep.success)
        if invert:
            r = 1.0 - r
        for step, (messages, out) in enumerate(calls):
            tid = f"{i:016x}{step:016x}"
            rows.append({
                "transition_id": tid, "trace_id": f"{i:032x}", "span_id": f"{step:016x}", "trajectory_id": f"{i:032x}",
                "step": step, "num_steps": len(calls), "agent_name": "solver", "model": "world-policy",
                "input_messages": [_message(m) for m in messages],
                "output_message": _message({"role": "assistant", **out}), "tools": json.dumps(world.TOOLS),
                "reward": r, "return": r, "advantage": r - (1 - mean if invert else mean), "weight": 1 / len(calls),
                "temperature": 1.0, "schema_version": "1"})
    return rows


@pytest.fixture(scope="module")
def candidates(tmp_path_factory, world_policy) -> dict:
    root = tmp_path_factory.mktemp("gate")
    logged = _logged_episodes(world_policy, EPISODES)
    write(root / "data", logged)
    write(root / "inverted", [{**r, "reward": 1 - r["reward"], "return": 1 - r["return"], "advantage": -r["advantage"]}
                              for r in logged])

    def make(name: str, data: str, **kw) -> str:
        cfg = TrainConfig()
        apply(cfg, {**dict(data=str(root / data), base_model=str(world_policy), output=str(root / name),
                            served_model_name="world-policy", epochs=4, batch_size=16, eval_fraction=0.25,
                            tensorboard=False, learning_rate=5e-3), **kw}, "test")
        return train(cfg, progress=False).path

    out = {
        "root": root,
        "success": sum(r["reward"] for r in logged if r["step"] == 0) / EPISODES,
        "good": make("good", "data", algorithm="sft", sft={"threshold": 0.5}),
        "inverted": make("inverted", "inverted", algorithm="sft", sft={"threshold": 0.5}),
        "wrecked": make("wrecked", "data", algorithm="sft", sft={"threshold": 0.5}, learning_rate=0.3),
    }
    return out


def _gate(candidates, which: str):
    cfg = TrainConfig()
    apply(cfg, dict(data=str(candidates["root"] / "data"), base_model="unused: the manifest's base is used",
                     served_model_name="world-policy", eval_fraction=0.25), "test")
    return gate(candidates[which], None, cfg, GateSettings(), log_dir=str(candidates["root"] / "gate-log"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_default_gate_passes_the_good_candidate(candidates):
    d = _gate(candidates, "good")
    text = "\n".join(d.lines())
    assert d.passed, text
    assert d.checks["ranking"]["decisive"] and d.checks["generation"]["decisive"], text
    assert d.candidate_metrics["ranking_accuracy"] > d.published_metrics["ranking_accuracy"], text
    assert "nll of rewarded calls" in d.checks  # reported, not decisive
    logged = [json.loads(line) for line in (candidates["root"] / "gate-log" / "gate-log.jsonl").read_text().splitlines()]
    assert logged[-1]["passed"] and logged[-1]["checks"]["ranking"]["passed"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_default_gate_blocks_a_candidate_trained_on_inverted_rewards(candidates):
    d = _gate(candidates, "inverted")
    text = "\n".join(d.lines())
    assert not d.passed, text
    # The ranking alone blocks it: on these logs (seeded per request since 2d01f26) its point
    # estimate is near 50 % and the gate is "not convinced" (lower bound far below 50 %); on
    # others it says "ranks rewarded actions worse". Either way it is the ranking that refuses.
    assert not d.checks["ranking"]["passed"], text
    assert "ranks rewarded actions" in d.reason, text


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_default_gate_blocks_a_candidate_whose_format_broke(candidates):
    d = _gate(candidates, "wrecked")
    text = "\n".join(d.lines())
    assert not d.passed, text
    assert not d.checks["generation"]["passed"], text
    assert d.candidate_metrics["valid_share"] < d.published_metrics["valid_share"] - 0.1, text


def test_valid_output_checks_tools_offered_and_required_arguments():
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
    ok = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    assert valid_output(ok, tools)
    assert valid_output("The answer is four.", tools)
    assert not valid_output('<tool_call>{"name": "search", "arguments": {}}</tool_call>', tools)  # q missing
    assert not valid_output('<tool_call>{"name": "delete", "arguments": {"q": "x"}}</tool_call>', tools)  # not offered
    assert not valid_output('<tool_call>{"name": "search", "arguments": {"q": </tool_call>', tools)  # no JSON
    assert not valid_output(ok + "<tool_call>{broken", tools)
    assert not valid_output("   ", tools)
