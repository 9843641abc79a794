"""README's first command, `make demo`, in a short version: the unmodified agent (its
own virtualenv, `opentelemetry-instrument`, OTEL_* variables only) runs episodes
through a real collector and model server, rewards arrive on spans and as
feedback, `nightshift nightly` builds, trains, gates and publishes, and the agent,
on fresh episodes, succeeds more often."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from instrumentation import envs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agent_world"))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the demo's own limit (900 s) plus building the policy the first time
def test_the_agent_gets_better_after_one_nightly_cycle(tmp_path, world_policy):
    python = envs.ensure("otel_v2_4")  # the same pins as examples/agent_world/requirements.txt
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NIGHTSHIFT_"))}
    env.update({"NIGHTSHIFT_DATA": str(tmp_path / "data"), "DEMO_EPISODES": "200", "DEMO_NIGHTS": "1", "DEMO_CHECK_EPISODES": "40", "DEMO_POLICY_DIR": str(world_policy),
                "DEMO_AGENT_PYTHON": str(python)})
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py")], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    m = re.search(r"success before: (\d+)%\s+after one nightly cycle: (\d+)%", p.stdout)
    assert m, p.stdout[-3000:]
    before, after = int(m.group(1)), int(m.group(2))
    # the behaviour policy succeeds about 40 %; one cycle of training on its own rewarded
    # episodes lifted it by 10 to 41 points over nine runs on 2026-11-25 (median 21: which
    # episodes are held out depends on the random trace ids); a blocked night leaves it
    # where it was. Without sft's anchor, 2 of 4 runs on 2026-11-26 were blocked for
    # breaking the output format after tool errors (no rewarded row follows one); with it
    # (trainer/algorithms/sft.py) four runs read 42 -> 76, 75, 75 and 76 %.
    print(f"success before {before}%, after {after}%")
    report = (tmp_path / "data" / "checkpoints" / "reports" / "latest.md").read_text()
    assert after - before >= 8, (before, after, report[-2000:], p.stdout[-3000:])
    data = tmp_path / "data"
    t = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"), hive_partitioning=True)
    sources = set(t["reward_source"].drop_nulls().unique())
    assert {"span:episode.reward", "feedback:checker"} <= sources  # both ways rewards arrive
    assert t["step"].max() == 1 and (t["num_steps"] == 2).mean() > 0.75  # two calls per episode, mostly
    registry = json.loads((data / "checkpoints" / "published.json").read_text())
    assert registry["current"]["version"] == "v0001" and registry["current"]["stable_name"] == "agent"
    manifest = json.loads((data / "checkpoints" / "v0001" / "manifest.json").read_text())
    assert manifest["metrics"]["train"]["sft_anchor_rows"] > 0  # the calls after tool errors anchored
    assert (data / "checkpoints" / "reports" / "latest.png").stat().st_size > 10_000
    # the world's checker ran as the gate's command: fresh tasks against the candidate as served
    decision = json.loads((data / "checkpoints" / "gate-log.jsonl").read_text().splitlines()[-1])
    checked = decision["command"]["result"]
    assert decision["command"]["exit"] == 0 and checked["episodes"] == 40 and checked["serving"] == "world-policy"
    assert checked["candidate_success"] >= checked["serving_success"]
