"""The default gate on the agent world: candidates trained from the same logged
episodes, one good, one on reward-inverted data, one with a learning rate that
wrecks its output format. The gate must pass the first and block the others
with no help from the training objective (a gate that passes or blocks
everything fails here), and say why in numbers."""

from __future__ import annotations

import json

import pytest

from nightshift.settings import apply
from nightshift.trainer.config import TrainConfig
from nightshift.judge.gate import GateSettings, gate, valid_output


@pytest.fixture(scope="module")
def candidates(world_candidates) -> dict:
    return world_candidates


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


def test_the_gate_scores_as_the_trainer_evaluates_by_tokens_within_max_length(tmp_path, monkeypatch):
    """The gate scores held-out rows the way training saw them: rows longer than
    the run plan's max_length (train.max_length 0 = the model's own limit, 512
    positions here) are left out as training left them out, and the model sees
    micro-batches of at most the plan's tokens, not 8 rows of any length (on 16k-token
    agent calls, 8 rows are 128k tokens: beyond what a 7B model fitted in training)."""
    import shutil

    from transformers import Qwen2ForCausalLM

    from nightshift.trainer.render import render
    from nightshift.trainer.select import held_out
    from nightshift.trainer.tiny import save_tiny
    from transitions_data import row, write

    base = save_tiny(tmp_path / "base", max_positions=512)
    candidate = tmp_path / "ck" / "v0001"
    shutil.copytree(base, candidate)
    (candidate / "manifest.json").write_text(json.dumps({"version": "v0001", "kind": "full", "base_model": str(base),
                                                         "dataset": {}, "config": {"eval_fraction": 0.5}}))
    rows = [row(f"What is {i} + {i}? " * (20, 26, 30, 60)[i % 4], f"The answer is {2 * i}.", float(i % 2))
            for i in range(28)]
    write(tmp_path / "data", rows)
    cfg = TrainConfig()
    apply(cfg, dict(data=str(tmp_path / "data"), base_model=str(base), output=str(tmp_path / "ck"),
                    tokens_per_step=256), "test")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    held = [len(render(tok, r)) for r in rows if held_out(r["trajectory_id"], 0.5)]
    assert max(held) > 512 and sum(n <= 512 for n in held) >= 8  # the data can tell the two ways apart
    seen: list[int] = []
    forward = Qwen2ForCausalLM.forward

    def spy(self, *args, **kwargs):
        seen.append(int(kwargs["input_ids"].numel()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Qwen2ForCausalLM, "forward", spy)
    d = gate(str(candidate), None, cfg, GateSettings(samples=0))
    assert d.candidate_metrics["rows"] == sum(n <= 512 for n in held), "\n".join(d.lines())
    assert seen and max(seen) <= 1024  # the plan's micro-batch on a CPU: the longest row rounded up to 1,024
    assert sum(seen) == 2 * sum(n for n in held if n <= 512)  # every kept row once per model, packed
