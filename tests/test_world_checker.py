"""The gate command's statistical contract (issue 27 item 9), and the agent world's
checker that honours it: the gate hands the command the tasks' seed, the
confidence and the minimum effect; the command plays candidate and serving on the
same tasks with the same sampling seeds and passes only when the one-sided lower
bound of the paired difference clears the minimum effect; the gate refuses a pass
that contradicts the command's own numbers."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from nightshift.judge.gate import GateSettings, gate
from nightshift.trainer.config import TrainConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "agent_world"))

import gate_check  # noqa: E402
import paired  # noqa: E402


def _pairs(cand_only: int, serv_only: int, both: int, neither: int, seed: int = 0) -> tuple[list[bool], list[bool]]:
    rows = [(True, False)] * cand_only + [(False, True)] * serv_only + [(True, True)] * both + [(False, False)] * neither
    random.Random(seed).shuffle(rows)
    return [c for c, _ in rows], [s for _, s in rows]


def test_a_candidate_one_point_ahead_on_100_tasks_is_not_passed_as_better():
    # b853c89's pg-s2 night 1: the checker saw 34 vs 33 % and passed a candidate 13 points
    # worse on 200 fresh episodes (the old rule: candidate >= serving - margin 0)
    cand, serv = _pairs(cand_only=20, serv_only=19, both=14, neither=47)
    said = gate_check.judge(cand, serv, confidence=0.95, min_effect=0.0)
    assert (said["candidate_success"], said["serving_success"], said["n"]) == (0.34, 0.33, 100)
    assert said["estimate"] == pytest.approx(0.01) and said["lower"] < 0 and not said["passed"]
    # a tolerant team (at most 15 points worse) would let it through: the minimum effect is theirs to state
    assert gate_check.judge(cand, serv, 0.95, -0.15)["passed"]


def test_a_clear_gain_on_paired_tasks_passes_where_the_same_rates_unpaired_could_not():
    # 10 points better, the two agreeing on all but 12 tasks (what common random numbers
    # give two close models): the discordant tasks carry the evidence
    cand, serv = _pairs(cand_only=11, serv_only=1, both=40, neither=48)
    said = gate_check.judge(cand, serv, 0.95, 0.0)
    assert said["passed"] and 0 < said["lower"] < said["estimate"] == pytest.approx(0.10)
    # 50 against 40 %, outcomes independent (no pairing): 10 points are within the noise
    cand, serv = _pairs(cand_only=30, serv_only=20, both=20, neither=30)
    assert not gate_check.judge(cand, serv, 0.95, 0.0)["passed"]


@pytest.mark.parametrize("p_serving,p_candidate,coupling", [(0.5, 0.5, 0.0), (0.35, 0.35, 0.9), (0.4, 0.47, 0.95),
                                                              (0.7, 0.62, 0.8)])
def test_the_one_sided_bound_holds_its_confidence(p_serving, p_candidate, coupling):
    """Coverage by simulation: the lower bound is below the true difference at least
    about 95 % of the time, for independent and strongly paired outcomes alike."""
    rng = random.Random(7)
    runs, covered = 600, 0
    for _ in range(runs):
        cand, serv = [], []
        for _ in range(100):
            u = rng.random()
            v = u if rng.random() < coupling else rng.random()
            serv.append(u < p_serving)
            cand.append(v < p_candidate)
        covered += paired.paired_lower(cand, serv, 0.95).lower <= p_candidate - p_serving
    assert covered / runs >= 0.93, covered / runs


def test_unpaired_outcomes_are_refused_in_one_sentence():
    with pytest.raises(ValueError, match="same tasks: 3 candidate, 2 serving"):
        paired.paired_lower([True, False, True], [True, False])


@pytest.fixture
def candidate(tmp_path, tiny_model):
    """A candidate folder with no transitions to score on: only the command decides."""
    folder = tmp_path / "ck" / "v0002"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"version": "v0002", "base_model": str(tiny_model), "dataset": {}}))
    return folder, TrainConfig(base_model=str(tiny_model), data=str(tmp_path / "data"))


def test_the_gate_states_the_contract_to_the_command(candidate, tmp_path):
    folder, cfg = candidate
    seen = tmp_path / "env.json"
    command = (f"{sys.executable} -c \"import json, os; json.dump({{k: v for k, v in os.environ.items() "
               f"if k.startswith('NIGHTSHIFT_GATE_')}}, open({str(seen)!r}, 'w'))\"")
    settings = GateSettings(command=command, confidence=0.9, min_effect=-0.02)
    first = gate(str(folder), str(tmp_path / "ck" / "v0001"), cfg, settings)
    env = json.loads(seen.read_text())
    assert env["NIGHTSHIFT_GATE_CONFIDENCE"] == "0.9" and env["NIGHTSHIFT_GATE_MIN_EFFECT"] == "-0.02"
    assert env["NIGHTSHIFT_GATE_SEED"].isdigit() and first.command["seed"] == int(env["NIGHTSHIFT_GATE_SEED"])
    # the same decision asks for the same tasks again (reproducible); another pair of versions, others
    assert gate(str(folder), str(tmp_path / "ck" / "v0001"), cfg, settings).command["seed"] == first.command["seed"]
    assert gate(str(folder), None, cfg, settings).command["seed"] != first.command["seed"]


@pytest.mark.parametrize("said,passed,reason", [
    ({"estimate": 0.03, "lower": -0.04, "n": 100}, False,
     "the evaluation command failed (exit 0): it exited 0, but its lower bound -0.040 is not above gate.min_effect "
     "+0.000"),
    ({"estimate": 0.12, "lower": 0.02, "n": 100}, True, "the evaluation command passed"),
    ({"candidate_success": 0.8}, True, "the evaluation command passed"),  # no bound stated: its exit code decides
])
def test_a_pass_that_contradicts_the_commands_own_bound_is_a_broken_check(candidate, said, passed, reason):
    folder, cfg = candidate
    d = gate(str(folder), None, cfg, GateSettings(command=f"echo '{json.dumps(said)}'"))
    assert d.passed is passed and reason in d.reason, d.reason


@pytest.mark.slow
def test_the_checker_pairs_tasks_and_seeds_over_http(tmp_path, world_policy, world_candidates):
    """gate_check.py against the real model server: the same adapter as candidate and
    as what serves gives the same outcome on every task (pairing is exact, so the
    bound is tight), and an identical candidate is not passed as better."""
    import os
    import subprocess
    import urllib.request

    import loop

    logs = tmp_path / "logs"
    logs.mkdir()
    server = loop.start_server(world_policy, "world-policy", logs)
    try:
        good = world_candidates["good"]
        body = json.dumps({"lora_name": "agent", "lora_path": str(good)}).encode()
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/load_lora_adapter", data=body,
                                                      headers={"Content-Type": "application/json"}), timeout=60)
        env = {**os.environ, "NIGHTSHIFT_CANDIDATE": str(good), "NIGHTSHIFT_PUBLISHED": str(good),
               "NIGHTSHIFT_GATE_SEED": "4242", "NIGHTSHIFT_GATE_CONFIDENCE": "0.95", "NIGHTSHIFT_GATE_MIN_EFFECT": "0"}
        p = subprocess.run([sys.executable, str(gate_check.__file__), "--server", server.url, "--serving", "agent",
                            "--base", "world-policy", "--episodes", "24"], env=env, capture_output=True, text=True,
                           timeout=600)
    finally:
        server.stop()
    said = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 1, p.stdout + p.stderr
    assert said["n"] == 24 and said["seed"] == 4242 and said["candidate_only"] == said["serving_only"] == 0
    assert said["estimate"] == 0 and said["lower"] < 0 and not said["passed"]
