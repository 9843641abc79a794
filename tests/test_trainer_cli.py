"""`nightshift train` / `merge` / `checkpoints` as real processes: exit codes, a run
killed part-way that resumes, and spans -> `nightshift build` -> `nightshift
train` on what the transform really writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from traces import Trace, genai_call, write_spans
from transitions_data import row, write

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NIGHTSHIFT_TRAIN_TENSORBOARD": "false"}


def ns(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=timeout)


def _rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        q = f"What is {i} + {i}?"
        out += [row(q, f"The answer is {2 * i}.", 1.0, advantage=0.5, group=q),
                row(q, "No idea.", 0.0, advantage=-0.5, group=q)]
    return out


def test_train_merge_and_list_from_the_command_line(tmp_path, tiny_model):
    write(tmp_path / "data", _rows(10))
    p = ns("train", "--data", str(tmp_path / "data"), "--base-model", str(tiny_model), "--checkpoints",
           str(tmp_path / "ck"), "--max-steps", "3", "--batch-size", "4", "--served-model-name", "served/base")
    assert p.returncode == 0, p.stderr
    assert "train: sft on" in p.stdout  # the default algorithm and f"-> v0001 at {tmp_path / 'ck' / 'v0001'}" in p.stdout
    assert "3 step(s)" in p.stdout and "held-out" in p.stdout
    listing = ns("checkpoints", "--checkpoints", str(tmp_path / "ck"), "--json")
    assert listing.returncode == 0
    entry = json.loads(listing.stdout.splitlines()[0])
    assert entry["version"] == "v0001" and entry["algorithm"] == "sft" and entry["dataset"]["rows_scanned"] == 20
    m = ns("merge", str(tmp_path / "ck" / "v0001"), str(tmp_path / "merged"))
    assert m.returncode == 0, m.stderr
    assert (tmp_path / "merged" / "model.safetensors").exists()


def test_exit_codes_say_what_went_wrong(tmp_path, tiny_model):
    p = ns("train", "--data", str(tmp_path / "none"), "--base-model", str(tiny_model))
    assert p.returncode == 1 and "no transitions dataset" in p.stderr
    p = ns("train", "--data", str(tmp_path), "--base-model", str(tiny_model), "--algorithm", "ppo")
    assert p.returncode == 2 and "--algorithm (train.algorithm): must be one of" in p.stderr
    p = ns("train", "--data", str(tmp_path))
    assert p.returncode == 2 and "train.base_model: required" in p.stderr
    write(tmp_path / "d2", _rows(2))
    p = ns("train", "--data", str(tmp_path / "d2"), "--base-model", str(tmp_path / "no-such-model"))
    assert p.returncode == 1 and "not a local folder" in p.stderr


def test_a_killed_run_resumes_from_its_last_trainer_checkpoint(tmp_path, tiny_model):
    write(tmp_path / "data", _rows(40))
    args = ["train", "--data", str(tmp_path / "data"), "--base-model", str(tiny_model), "--checkpoints",
            str(tmp_path / "ck"), "--max-steps", "300", "--batch-size", "4", "--quiet"]
    env = {**ENV, "NIGHTSHIFT_TRAIN_SAVE_STEPS": "5"}
    proc = subprocess.Popen([sys.executable, "-m", "nightshift.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    runs = tmp_path / "ck" / ".runs"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if list(runs.glob("*/trainer/checkpoint-*/trainer_state.json")):  # a complete one
            break
        time.sleep(0.01)
    assert proc.poll() is None, "finished before a checkpoint was seen: make the run longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "ck" / "v0001").exists()  # nothing committed by the killed run
    p = ns("train", *args[1:], env={"NIGHTSHIFT_TRAIN_SAVE_STEPS": "5"})
    assert p.returncode == 0, p.stderr
    assert "resumed from checkpoint-" in p.stdout and "300 step(s)" in p.stdout
    man = json.loads((tmp_path / "ck" / "v0001" / "manifest.json").read_text())
    assert man["metrics"]["train"]["steps"] == 300
    assert man["metrics"]["train"]["resumed_from"].startswith("checkpoint-")
    assert not list(runs.glob("*/trainer"))  # the finished run's scratch is gone


def test_spans_to_transitions_to_a_checkpoint(tmp_path, tiny_model):
    """The transform's real output is the trainer's input: GenAI spans with a tool
    loop and Agent Lightning rewards, built, then trained on."""
    data = tmp_path / "data"
    traces = []
    for i in range(12):
        t = Trace(f"ep{i}")
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=0, end=10)
        q = f"What is {i} * 3?"
        t.span("chat m1", genai_call(q, None, tool_call=("c1", "calculator", {"expression": f"{i}*3"})),
               parent=root, start=1, end=2)
        history = [{"role": "user", "parts": [{"type": "text", "content": q}]},
                   {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "calculator",
                                                    "arguments": {"expression": f"{i}*3"}}]},
                   {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": str(i * 3)}]}]
        t.span("chat m1", genai_call("", f"It is {i * 3 if i % 2 else i}.", history=history[:-1] + [history[-1]]),
               parent=root, start=3, end=4)
        t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                             "agentlightning.reward.0.value": float(i % 2)},
               parent=root, start=5, end=5.1)
        traces.append(t)
    write_spans(str(data), traces)
    b = ns("build", "--data", str(data), "--settle", "0", "--quiet")
    assert b.returncode == 0, b.stderr
    assert "transitions: 24 rows from 12 trajectories" in b.stdout
    p = ns("train", "--data", str(data), "--base-model", str(tiny_model), "--checkpoints", str(tmp_path / "ck"),
           "--max-steps", "2", "--batch-size", "4", "--quiet")
    assert p.returncode == 0, p.stderr
    man = json.loads((tmp_path / "ck" / "v0001" / "manifest.json").read_text())
    assert man["dataset"]["rows_selected"] == 24
    assert man["dataset"]["rows_trained"] + man["dataset"]["rows_eval"] == 24
