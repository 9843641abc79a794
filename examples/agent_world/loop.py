"""The closed loop's moving parts as real processes: a Nightshift collector, a
model server (`nightshift serve --engine transformers`), the agent program in
its own virtualenv under `opentelemetry-instrument`, feedback posted afterwards.
Shared by `make demo`, `benchmarks/learning.py` and the closed-loop test.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, what: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; its log ({log}):\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout:.0f} s; its log: {log}")


@dataclass
class Service:
    proc: subprocess.Popen
    url: str
    log: Path
    extra: dict = field(default_factory=dict)

    def ready(self, path: str, what: str, timeout: float = 120.0) -> "Service":
        """Wait until `path` answers (a service started with wait=False)."""
        _wait(f"{self.url}{path}", self.proc, what, self.log, timeout)
        return self

    def stop(self, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode


def start_collector(data: Path, logs: Path) -> Service:
    """`nightshift collect` on free ports; HTTP for the agent's OTLP and for feedback."""
    http, grpc = free_port(), free_port()
    log = logs / "collector.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nightshift.cli", "collect", "--data", str(data), "--http", f"127.0.0.1:{http}",
         "--grpc", f"127.0.0.1:{grpc}"], stdout=open(log, "ab"), stderr=subprocess.STDOUT,
        env={**os.environ, "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "1s"})
    url = f"http://127.0.0.1:{http}"
    _wait(f"{url}/healthz", proc, "the collector", log)
    return Service(proc, url, log)


def start_server(model: Path, served_name: str, logs: Path, max_lora_rank: int = 16, max_loras: int = 4,
                 wait: bool = True) -> Service:
    """`nightshift serve --engine transformers`; wait=False returns while it loads
    (then `.ready("/health", ...)`), so a caller can load its own model meanwhile."""
    port = free_port()
    log = logs / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nightshift.cli", "serve", "--engine", "transformers", "--model", str(model),
         "--served-model-name", served_name, "--port", str(port), "--max-lora-rank", str(max_lora_rank), "--max-loras", str(max_loras)],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    server = Service(proc, f"http://127.0.0.1:{port}", log)
    return server.ready("/health", "the model server") if wait else server


def start_route(upstream: Service, logs: Path, state: Path) -> Service:
    """`nightshift route` in front of the model server: the agents' base URL points
    here, and canaries get their share of the conversations (off until a route is set)."""
    port = free_port()
    log = logs / "route.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nightshift.cli", "route", "--listen", f"127.0.0.1:{port}", "--upstream", upstream.url,
         "--state", str(state)], stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/healthz", proc, "the routing proxy", log)
    return Service(proc, url, log)


def agent_python(venv: Path) -> Path:
    """The agent's own virtualenv (openai + OpenTelemetry instrumentation, pinned in
    requirements.txt; nothing of Nightshift), created on first use."""
    py = venv / "bin" / "python"
    stamp = venv / ".requirements"
    want = REQUIREMENTS.read_text()
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)], check=True)
    stamp.write_text(want)
    return py


def run_agent(python: Path, collector: Service, server: Service, model: str, episodes: int, seed: int,
              logs: Path, colour_share: float = 0.5) -> list[dict]:
    """The agent, unmodified, configured by environment only (`colour_share`: the
    world's task mix, which the learning benchmark drifts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({
        "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "world-agent", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY",
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": "not-needed", "AGENT_MODEL": model,
    })
    p = subprocess.run([str(python.parent / "opentelemetry-instrument"), str(python), str(HERE / "agent.py"),
                        "--episodes", str(episodes), "--seed", str(seed), "--colour-share", str(colour_share)], env=env, cwd=str(HERE),
                       capture_output=True, text=True, timeout=1800)
    (logs / f"agent-{seed}.log").write_text(p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"the agent failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def post_feedback(collector: Service, results: list[dict]) -> int:
    """The rewards that were not on the spans arrive later, as a reviewer's labels."""
    labels = [{"trace_id": r["trace_id"], "name": "checker", "value": 1.0 if r["success"] else 0.0,
               "id": f"checker-{r['trace_id']}"} for r in results if not r["reward_in_span"]]
    if not labels:
        return 0
    req = urllib.request.Request(f"{collector.url}/v1/feedback", data=json.dumps(labels).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["accepted"]


def success(results: list[dict]) -> float:
    return sum(r["success"] for r in results) / len(results) if results else 0.0


def nightly_config(path: Path, data: Path, policy: Path, checkpoints: Path, server: Service, name: str = "agent",
                   nightly: dict | None = None, checker_episodes: int = 0, apo: dict | None = None,
                   **train) -> Path:
    """One settings file for build -> train -> gate -> publish on this world. The
    algorithm defaults to sft (rejection sampling), which benchmarks/learning.py
    found the strongest here; any other is one setting away. `checker_episodes`
    > 0 makes the world's own checker (gate_check.py: fresh tasks against the
    candidate as the server serves it) the gate's `command`, as a team would
    wire its own evaluation. `apo`: the `apo:` section (the proposer, for agents on
    prompt optimization: nightly.experiments prompts or both). The publishing keys
    (`nightly` may carry some too) go under `publish:`, their home, which the
    nightly job reads without the deprecation lines it prints for them under
    `nightly:`."""
    import world
    from nightshift.publish.publish import MOVED

    given = nightly or {}

    tools = path.parent / "agent-tools.json"  # what the agent offers: its spans do not record it
    tools.write_text(json.dumps(world.TOOLS, indent=2))
    cfg = {
        "data": str(data),
        "transform": {"settle": 0, "reward": {"keys": ["episode.reward"]}, "credit": {"strategy": "identical"}},
        "train": {"base_model": str(policy), "served_model_name": "world-policy", "output": str(checkpoints),
                  "algorithm": "sft", "learning_rate": 5e-3, "epochs": 6, "batch_size": 16, "eval_fraction": 0.2,
                  "tensorboard": False, "sft": {"threshold": 0.5}, "tools_fallback": str(tools), **train},
        "publish": {"vllm_url": server.url, "name": name, "stable_name": name, "keep": 2,
                    **{k: v for k, v in given.items() if k in MOVED.keys}},
        "nightly": {
            # a night's demo logs are small: a 95 % bound on 30 held-out episodes blocks
            # even good candidates, so the world asks the gate for 80 % confidence; and
            # 96 generation samples (with 48, good candidates' validity moved 2-6 points
            # by chance, against a 5-point margin)
            "gate": {"samples": 96, "ranking_confidence": 0.8},
            **{k: v for k, v in given.items() if k not in MOVED.keys}},
    }
    if apo:
        cfg["apo"] = {"data": str(data), **apo}
    if checker_episodes > 0:
        cfg["nightly"].setdefault("gate", {})["command"] = " ".join(shlex.quote(a) for a in (
            sys.executable, str(HERE / "gate_check.py"), "--server", server.url, "--serving", name,
            "--base", cfg["train"]["served_model_name"], "--episodes", str(checker_episodes)))
    path.write_text(json.dumps(cfg, indent=2))
    return path
