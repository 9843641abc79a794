"""Fixtures that start a real `nightshift collect` process on free loopback ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/hardening: the campaigns' process helpers
from hardening.proc import Collector as CollectorProcess  # noqa: E402  the one collector harness
from hardening.proc import free_port  # noqa: E402,F401  (tests import it from here)


@pytest.fixture
def collector_factory(tmp_path, request):
    started: list[CollectorProcess] = []

    def make(**kw) -> CollectorProcess:
        c = CollectorProcess(data=tmp_path / "data", wal=tmp_path / "wal", log_path=tmp_path / f"collector-{len(started)}.log", **kw)
        started.append(c)
        return c

    yield make
    for c in started:
        if c.proc and c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait(10)
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for c in started:
            print(f"--- collector log {c.log_path} ---\n{c.log_tail()}")


@pytest.fixture
def collector(collector_factory):
    """A running collector with default settings (fast flush)."""
    return collector_factory().start()


# Fixtures that train the agent world's policies into ~/.cache (a fresh machine, as CI's, has none):
# the first test to ask builds the chain, 150-300 CPU-s a stage; the suite's 300 s timeout is for hangs.
POLICY_FIXTURES = {"world_policy", "world_candidates", "sensitive", "letters_policy"}
POLICY_BUILD_TIMEOUT = 1200


def pytest_collection_modifyitems(config, items):
    """A test that may build a policy from an empty cache gets POLICY_BUILD_TIMEOUT
    seconds (setup included) unless it names its own timeout."""
    for item in items:
        if POLICY_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(POLICY_BUILD_TIMEOUT))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def read_dataset(data: Path, name: str):
    """A dataset the way users read it (hive partitions), empty if nothing was written."""
    import polars as pl

    if not list((data / name).glob("**/*.parquet")):
        return pl.DataFrame()
    return pl.read_parquet(str(data / name / "**" / "*.parquet"), hive_partitioning=True)


def read_spans(data: Path):
    return read_dataset(data, "spans")


def read_logs(data: Path):
    return read_dataset(data, "logs")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen2-shaped chat model and tokenizer, built offline once per session."""
    from nightshift.trainer.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-qwen2")


@dataclass
class ServeProcess:
    """`nightshift serve --engine transformers` as a real process on a free port."""

    model: Path
    log_path: Path
    served_name: str = "tiny"
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServeProcess":
        cmd = [sys.executable, "-m", "nightshift.cli", "serve", "--engine", "transformers", "--model", str(self.model),
               "--served-model-name", self.served_name, "--port", str(self.port), *self.extra_args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env})
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1)
                return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"serve not healthy after {timeout}s:\n{self.log_text()}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-8000:]
        except OSError:
            return ""

    def models(self) -> dict[str, dict]:
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as r:
            return {m["id"]: m for m in json.loads(r.read())["data"]}

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
def serve_factory(tmp_path, tiny_model, request):
    started: list[ServeProcess] = []

    def make(**kw) -> ServeProcess:
        kw.setdefault("model", tiny_model)
        s = ServeProcess(log_path=tmp_path / f"serve-{len(started)}.log", **kw)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for s in started:
            print(f"--- serve log {s.log_path} ---\n{s.log_text()}")


@pytest.fixture(scope="session")
def tool_adapter(tmp_path_factory, tiny_model) -> Path:
    """A LoRA version (r=64) that makes the tiny model answer "What is 12 * 7?" with
    a calculator tool call: an adapter whose effect shows in the served text."""
    from nightshift.settings import apply
    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.run import train
    from transitions_data import CALC_TOOL, msg, row, write

    root = tmp_path_factory.mktemp("tool-adapter")
    call = msg("assistant", None, tool_calls=[{"id": "c1", "name": "calculator", "arguments": {"expression": "12*7"}}])
    write(root / "data", [row("What is 12 * 7?", call, 1.0, tools=CALC_TOOL, trajectory=f"{i:032x}") for i in range(16)])
    cfg = TrainConfig()
    apply(cfg, dict(data=str(root / "data"), base_model=str(tiny_model), output=str(root / "ck"), algorithm="sft",
                     max_steps=60, batch_size=4, learning_rate=5e-3, warmup=0.1, eval_fraction=0.0, tensorboard=False,
                     served_model_name="tiny", lora={"r": 64, "alpha": 128}), "fixture")
    return Path(train(cfg, progress=False).path)


@pytest.fixture(scope="session")
def world_policy() -> Path:
    """The agent world's behaviour policy (examples/agent_world), built once (about
    two minutes) and kept in the user cache so later runs reuse it."""
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "agent_world"))
    import policy

    spec = policy.PolicySpec()
    root = Path(os.environ.get("NIGHTSHIFT_WORLD_CACHE") or "~/.cache/nightshift-agent-world").expanduser()
    return policy.build(root / f"policy-{spec.key()}", spec, progress=False)


@pytest.fixture(scope="session")
def world_candidates(tmp_path_factory, world_policy) -> dict:
    """Three versions trained on the agent world's logs (tests/support/world.py): good,
    trained on inverted rewards, format wrecked; shared by the gate's and the canary's tests."""
    from support.world import train_candidates

    return train_candidates(tmp_path_factory.mktemp("world-candidates"), world_policy)
