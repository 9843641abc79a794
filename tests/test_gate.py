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
from nightshift.publish.gate import GateSettings, gate, valid_output


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
