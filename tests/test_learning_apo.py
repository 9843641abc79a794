"""benchmarks/learning.py's `apo` arm, one night end to end on tiny settings: the
agent's logs, `nightshift nightly` with experiments: prompts (an APO round against
the stand-in proposer, its candidate started on the lineage's own `nightshift
route`), and a table that names the prompt serving after the night and scores the
candidate. Behaviour, not figures: the policy here is the tests' cached behaviour
policy, which reads no prompt (the measurement serves the instruction-tuned one).
Ten logged episodes are enough for what is asserted: the round needs failures to
read, and at the policy's ~50 % success ten episodes hold none about once in a
thousand runs; four scoring episodes score the candidate (a figure, not asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_apo_arm_runs_a_night_and_reports_the_serving_prompt(tmp_path, world_policy):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "learning.py"), "--algorithms", "apo",
                        "--nights", "1", "--seeds", "1", "--episodes", "10", "--eval-episodes", "4",
                        "--check-episodes", "0", "--policy", str(world_policy), "--keep", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=580, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = p.stdout
    serving = next(line for line in out.splitlines() if line.strip().startswith("apo (serving prompt)"))
    assert serving.split()[-1] == "base"  # a candidate is on trial, nothing promoted after one night
    assert "night 1 apo-s0: solver: prompt candidate v0001" in out, out
    candidate = next(line for line in out.splitlines() if line.strip().startswith("apo (candidate)"))
    assert "n/a" not in candidate  # the candidate was scored, whatever the watch will say
    assert "apo: best gain over the base prompt within 1 night(s)" in out
    route = (tmp_path / "w" / "apo-s0" / "routes.json").read_text()
    assert '"kind": "prompt"' in route and '"share": 0.5' in route


def test_the_worlds_nightly_config_gives_the_publishing_keys_under_publish(tmp_path):
    """examples/agent_world/loop.py's settings file (the demo's and the benchmark's):
    the publishing keys under `publish:`, so no nightly prints deprecation lines."""
    sys.path.insert(0, str(ROOT / "examples" / "agent_world"))
    import loop

    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import MOVED
    from nightshift.settings import load

    server = loop.Service(None, "http://127.0.0.1:9", tmp_path / "serve.log")
    cfg = loop.nightly_config(tmp_path / "n.yaml", tmp_path / "data", tmp_path / "policy", tmp_path / "ck", server,
                              name="apo-sft-s0", nightly={"experiments": "both", "keep": 3,
                                                          "canary": {"route_url": "http://127.0.0.1:9"}})
    notes: list[str] = []
    n = load(NightlyConfig, "nightly", str(cfg), {}, env={}, moved=MOVED, notes=notes)
    assert notes == []
    assert (n.vllm_url, n.name, n.stable_name, n.keep, n.experiments) == ("http://127.0.0.1:9", "apo-sft-s0",
                                                                          "apo-sft-s0", 3, "both")
