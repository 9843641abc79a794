"""Candidates trained on the agent world's logged episodes, shared by the gate's
tests and the canary's: one good (SFT on the rewarded calls), one trained on
reward-inverted logs (worse in production), one whose learning rate wrecked its
output format. Trained once per session, into one checkpoints folder."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

EPISODES = 160
ROOT = Path(__file__).resolve().parents[2]


def _message(m: dict) -> dict:
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in m.get("tool_calls") or []]
    return {"role": m["role"], "content": m.get("content"), "name": None, "tool_calls": calls or None,
            "tool_call_id": m.get("tool_call_id")}


def logged_episodes(policy_dir: Path, n: int) -> list[dict]:
    """The behaviour policy's own episodes at temperature 1, as the transitions the
    build writes (one row per call, reward = the checker's, credited to every call)."""
    sys.path.insert(0, str(ROOT / "examples" / "agent_world"))
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
        for step, (messages, out) in enumerate(calls):
            rows.append({
                "transition_id": f"{i:016x}{step:016x}", "trace_id": f"{i:032x}", "span_id": f"{step:016x}",
                "trajectory_id": f"{i:032x}", "step": step, "num_steps": len(calls), "agent_name": "solver",
                "model": "world-policy", "input_messages": [_message(m) for m in messages],
                "output_message": _message({"role": "assistant", **out}), "tools": json.dumps(world.TOOLS),
                "reward": r, "return": r, "advantage": r - mean, "weight": 1 / len(calls),
                "temperature": 1.0, "schema_version": "1"})
    return rows


def train_candidates(root: Path, policy_dir: Path) -> dict:
    """{"root", "success", "good", "inverted", "wrecked"}: the three versions' folders
    (v0001, v0002, v0003 of `root`/ck) and the behaviour policy's logged success."""
    from nightshift.settings import apply
    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.run import train
    from transitions_data import write

    logged = logged_episodes(policy_dir, EPISODES)
    write(root / "data", logged)
    write(root / "inverted", [{**r, "reward": 1 - r["reward"], "return": 1 - r["return"], "advantage": -r["advantage"]}
                              for r in logged])

    def make(data: str, **kw) -> str:
        cfg = TrainConfig()
        apply(cfg, {**dict(data=str(root / data), base_model=str(policy_dir), output=str(root / "ck"),
                           served_model_name="world-policy", epochs=4, batch_size=16, eval_fraction=0.25,
                           tensorboard=False, learning_rate=5e-3), **kw}, "test")
        return train(cfg, progress=False).path

    return {
        "root": root,
        "success": sum(r["reward"] for r in logged if r["step"] == 0) / EPISODES,
        # 8 epochs: about 70 % success against the behaviour policy's 33 % (4: 48 %), a gap the
        # canary test's watch can see in a few hundred episodes
        "good": make("data", algorithm="sft", sft={"threshold": 0.5}, epochs=8),
        "inverted": make("inverted", algorithm="sft", sft={"threshold": 0.5}),
        "wrecked": make("data", algorithm="sft", sft={"threshold": 0.5}, learning_rate=0.3),
    }
