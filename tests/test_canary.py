"""Canaries judged by production, end to end: the unmodified agent (its own
virtualenv, `opentelemetry-instrument`, OTEL_* and OPENAI_BASE_URL only) asks for
the stable name through `nightshift route` in front of the serve stand-in; a
candidate takes half of the conversations; every batch of episodes goes through
the collector, `nightshift build` and `nightshift watch`, as a nightly schedule
would. A candidate whose format broke is stopped, a good one promoted,
each within the episodes the README states; every trajectory is made by one
version; a route is never left pointing at an adapter that is gone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from instrumentation import envs
from nightshift.nightly.run import NightlyConfig
from nightshift.publish import canary, registry
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "agent_world"))

BATCH = 40  # episodes between two looks of the watch
MAX_BATCHES = 8  # README: decided within 320 episodes (160 a side at half the traffic)


def ns(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    return subprocess.run([sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**env, "HF_HUB_OFFLINE": "1"})


class World:
    """The moving parts: collector, model server, routing proxy, the agent's python."""

    def __init__(self, tmp: Path, policy: Path) -> None:
        import loop

        self.loop, self.tmp, self.logs, self.data = loop, tmp, tmp / "logs", tmp / "data"
        self.logs.mkdir(parents=True)
        self.python = envs.ensure("otel_v2_4")  # the pins of examples/agent_world/requirements.txt
        self.server = loop.start_server(policy, "world-policy", self.logs)
        self.route = loop.start_route(self.server, self.logs, tmp / "routes.json")
        self.ck = tmp / "ck"
        self.settings = NightlyConfig(vllm_url=self.server.url, name="agent", stable_name="agent", keep=3)
        self.canary = CanarySettings(share=0.5, route_url=self.route.url)
        self.episodes = 0

    def stop(self) -> None:
        self.route.stop()
        self.server.stop()

    def batch(self, seed: int) -> list[dict]:
        """BATCH episodes asking for the stable name through the proxy, their rewards on
        spans or posted as feedback, flushed (the collector drains on SIGTERM)."""
        collector = self.loop.start_collector(self.data, self.logs)
        try:
            results = self.loop.run_agent(self.python, collector, self.route, "agent", BATCH, seed, self.logs)
            self.loop.post_feedback(collector, results)
        finally:
            collector.stop()
        self.episodes += BATCH
        return results

    def build(self) -> None:
        b = ns("build", "--data", str(self.data), "--settle", "0", "--incremental", "--reward-keys", "episode.reward",
               "--quiet")
        assert b.returncode == 0, b.stdout + b.stderr

    def look(self) -> subprocess.CompletedProcess:
        self.build()
        return ns("watch", "--data", str(self.data), "--checkpoints", str(self.ck), "--vllm-url", self.server.url,
                  "--name", "agent", "--stable-name", "agent", "--route-url", self.route.url)

    def until_decided(self, seed: int) -> subprocess.CompletedProcess:
        for k in range(MAX_BATCHES):
            self.batch(seed + k)
            w = self.look()
            assert w.returncode in (0, 3), w.stdout + w.stderr
            if "canary stopped" in w.stdout or "canary promoted" in w.stdout:
                return w
        table = ns("versions", "--data", str(self.data), "--checkpoints", str(self.ck)).stdout
        raise AssertionError(f"undecided after {self.episodes} episodes:\n{w.stdout}\n{table}")

    def transitions(self) -> pl.DataFrame:
        return pl.read_parquet(str(self.data / "transitions" / "**" / "*.parquet"), hive_partitioning=True)


@pytest.fixture
def world(tmp_path, world_policy, world_candidates):
    w = World(tmp_path, world_policy)
    w.ck.mkdir()
    for v in ("v0001", "v0003"):  # good; format wrecked by its learning rate
        shutil.copytree(world_candidates["root"] / "ck" / v, w.ck / v)
    yield w
    w.stop()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_worse_canary_is_stopped_and_a_better_one_promoted_through_the_proxy(world):
    client = RouteClient(world.route.url)
    # 1. the wrecked candidate takes half of the conversations; the base serves the rest
    lines = canary.start(str(world.ck / "v0003"), str(world.ck), world.settings, world.canary, "world-policy")
    assert "takes 50 % of the conversations" in lines[0]
    route = client.get("agent")
    assert (route["serving"], route["candidate"], route["share"]) == ("world-policy", "agent@v0003", 0.5)
    w = world.until_decided(seed=100)
    assert w.returncode == 3 and "canary stopped: v0003" in w.stdout, w.stdout
    stopped_after = world.episodes
    # every conversation back on the base, the candidate unloaded, the registry and the gate log told why
    route = client.get("agent")
    assert (route["serving"], route["candidate"]) == ("world-policy", None)
    assert "agent@v0003" not in _models(world)
    ended = registry.read(str(world.ck))[-1]
    assert (ended["role"], ended["version"], ended["outcome"]) == ("canary_end", "v0003", "stopped")
    assert registry.judged_worse(registry.read(str(world.ck)), world.server.url, "agent") == {"v0003"}
    decision = json.loads((world.ck / "gate-log.jsonl").read_text().splitlines()[-1])
    assert (decision["action"], decision["decision"], decision["candidate"]) == ("canary stopped", "worse", "v0003")
    assert decision["high"] < 0 and decision["n_candidate"] >= 30 and decision["n_baseline"] >= 30

    # 2. the good candidate, against the same base
    canary.start(str(world.ck / "v0001"), str(world.ck), world.settings, world.canary, "world-policy")
    world.episodes = 0
    w = world.until_decided(seed=200)
    assert w.returncode == 0 and "canary promoted: v0001" in w.stdout, w.stdout
    promoted_after = world.episodes
    assert client.get("agent") is None  # no route: the stable name passes through to the server ...
    models = _models(world)
    assert models["agent"]["root"] == models["agent@v0001"]["root"]  # ... where it now serves v0001
    assert registry.serving(registry.read(str(world.ck)), world.server.url, "agent")["version"] == "v0001"

    # what production saw: one version per trajectory, about half the conversations on each canary
    t = world.transitions()
    per_trajectory = t.group_by("trajectory_id").agg(pl.col("policy_version").fill_null("base").n_unique())
    assert per_trajectory["policy_version"].max() == 1
    trajectories = t.group_by("trajectory_id").agg(pl.col("policy_version").first())
    on_canary = trajectories.filter(pl.col("policy_version").is_in(["v0001", "v0003"])).height / trajectories.height
    assert 0.35 < on_canary < 0.65, on_canary
    print(f"worse canary stopped after {stopped_after} episodes, better one promoted after {promoted_after}")

    # 3. after the promotion, every conversation is served by v0001
    results = world.batch(seed=300)
    world.build()
    last = world.transitions().filter(pl.col("trace_id").is_in([r["trace_id"] for r in results]))
    assert last.height >= BATCH and set(last["policy_version"]) == {"v0001"}


def _models(world: World) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"{world.server.url}/v1/models", timeout=10) as r:
        return {m["id"]: m for m in json.loads(r.read())["data"]}
