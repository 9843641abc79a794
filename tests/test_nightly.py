"""`nightshift nightly` as a real process against `nightshift serve`: build → train →
gate → publish → report; killed after every stage's work and resumed, it publishes
exactly once; a second run waits for the lock; the gate blocks a worse version."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nightshift.settings import apply
from nightshift.publish import registry
from nightshift.trainer.config import TrainConfig
from nightshift.judge.gate import GateSettings, gate
from nightshift.trainer.run import train
from traces import Trace, genai_call, write_spans
from transitions_data import row, write


def _spans(data: Path, n: int = 24, prefix: str = "night") -> None:
    traces = []
    for i in range(n):
        t = Trace(f"{prefix}{i}")
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=0, end=10)
        good = i % 2 == 0
        t.span("chat m1", genai_call(f"What is {i} + {i}?", f"The answer is {2 * i}." if good else "No idea."),
               parent=root, start=1, end=2)
        t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                             "agentlightning.reward.0.value": 1.0 if good else 0.0},
               parent=root, start=5, end=5.1)
        traces.append(t)
    write_spans(str(data), traces)


def _config(tmp_path: Path, tiny_model: Path, url: str, **nightly) -> Path:
    cfg = {
        "data": str(tmp_path / "data"),
        "transform": {"settle": 0},
        "train": {"base_model": str(tiny_model), "served_model_name": "tiny", "output": str(tmp_path / "ck"),
                  "max_steps": 3, "batch_size": 4, "learning_rate": 1e-3, "tensorboard": False, "eval_fraction": 0.25},
        "nightly": {"vllm_url": url, "name": "agent", "gate": {"ranking_margin": 1.0, "validity_margin": 1.0, "samples": 4},
                    **nightly},
    }
    p = tmp_path / "nightshift.yaml"
    p.write_text(json.dumps(cfg))  # JSON is YAML
    return p


def nightly(config: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nightshift.cli", "nightly", "--config", str(config), "--quiet"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def test_nightly_builds_trains_gates_publishes_and_reports(tmp_path, tiny_model, serve_factory):
    s = serve_factory().start()
    _spans(tmp_path / "data")
    cfg = _config(tmp_path, tiny_model, s.url)
    p = nightly(cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "published v0001" in p.stdout
    assert "agent@v0001" in s.models()
    entry = registry.current(str(tmp_path / "ck"))
    assert entry["version"] == "v0001" and entry["checkpoint"] == str(tmp_path / "ck" / "v0001")
    state = json.loads((tmp_path / "ck" / ".nightly" / "state.json").read_text())
    assert state["stage"] == "done" and state["gate"]["passed"] and state["build"][0].startswith("transitions: 24 rows")
    report = Path(state["report"]).read_text()
    assert "**Outcome:** published v0001" in report and "| rows |" in report  # the metrics the gate measured
    assert "## Reward by version" in report and "## Production watch" in report
    png = Path(state["plot"]).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    gate_log = (tmp_path / "ck" / "gate-log.jsonl").read_text().splitlines()
    assert json.loads(gate_log[0])["candidate"].endswith("v0001")
    # the next night: nothing new arrived, nothing is trained or published
    again = nightly(cfg)
    assert again.returncode == 0 and "nothing to build" in again.stdout
    assert sorted(p.name for p in (tmp_path / "ck").glob("v*")) == ["v0001"]
    history = (tmp_path / "ck" / ".nightly" / "runs.jsonl").read_text().splitlines()
    assert len(history) == 2


def test_a_canary_night_then_a_night_that_waits_for_it_then_its_promotion(tmp_path, tiny_model, serve_factory):
    import datetime as dt

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "agent_world"))
    import loop

    from nightshift.route.client import RouteClient

    s = serve_factory().start()
    (tmp_path / "logs").mkdir()
    proxy = loop.start_route(s, tmp_path / "logs", tmp_path / "routes.json")
    try:
        _spans(tmp_path / "data")
        cfg = _config(tmp_path, tiny_model, s.url, stable_name="agent-live",
                      canary={"share": 0.3, "route_url": proxy.url})
        p = nightly(cfg)
        assert p.returncode == 0 and "published v0001 as a canary (30 % of conversations)" in p.stdout, p.stdout + p.stderr
        route = RouteClient(proxy.url).get("agent-live")
        assert (route["serving"], route["candidate"], route["share"]) == ("tiny", "agent@v0001", 0.3)
        assert "agent@v0001" in s.models() and "agent-live" not in s.models()  # beside the base, not instead
        assert registry.current(str(tmp_path / "ck")) is None  # a canary is not what serves
        trial = registry.canary(registry.read(str(tmp_path / "ck")), s.url, "agent")
        assert (trial["version"], trial["serving"], trial["serving_name"]) == ("v0001", "base", "tiny")

        # the next night: new spans, but the canary is undecided: no second experiment on top of it
        _spans(tmp_path / "data", prefix="second")
        p = nightly(cfg)
        assert p.returncode == 0 and "canary v0001 is still being judged" in p.stdout, p.stdout + p.stderr
        assert sorted(d.name for d in (tmp_path / "ck").glob("v*")) == ["v0001"]
        state = json.loads((tmp_path / "ck" / ".nightly" / "state.json").read_text())
        assert any("watch: canary v0001" in line and "too_few" in line for line in state["watch"]), state["watch"]

        # production says it is better: the watch (on its own schedule here) promotes it
        start = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=1)
        rows = []
        for i in range(40):
            when = start + dt.timedelta(seconds=i)
            rows.append({**row(f"q{i}", "a", 1.0 if i % 10 else 0.0, trajectory=f"c{i:031d}", when=when),
                         "policy_version": "v0001"})
            rows.append({**row(f"q{i}", "b", 1.0 if i % 10 < 3 else 0.0, trajectory=f"b{i:031d}", when=when),
                         "policy_version": None})
        write(tmp_path / "data", rows, date=(start + dt.timedelta(days=1)).date().isoformat(), name="production.parquet")
        w = subprocess.run([sys.executable, "-m", "nightshift.cli", "watch", "--config", str(cfg), "--data",
                            str(tmp_path / "data"), "--checkpoints", str(tmp_path / "ck")],
                           capture_output=True, text=True, timeout=300)
        assert w.returncode == 0 and "canary promoted: v0001" in w.stdout, w.stdout + w.stderr
        assert "agent-live" in s.models() and RouteClient(proxy.url).get("agent-live") is None
        assert registry.current(str(tmp_path / "ck"))["version"] == "v0001"
    finally:
        proxy.stop()


@pytest.mark.parametrize("stage", ["build", "train", "gate", "publish"])
def test_killed_after_any_stage_it_resumes_and_publishes_exactly_once(tmp_path, tiny_model, serve_factory, stage):
    s = serve_factory().start()
    _spans(tmp_path / "data")
    cfg = _config(tmp_path, tiny_model, s.url)
    killed = nightly(cfg, {"NIGHTSHIFT_FAULT_KILL_AFTER": stage})
    assert killed.returncode == -9, killed.stderr
    state = json.loads((tmp_path / "ck" / ".nightly" / "state.json").read_text())
    assert state["stage"] == stage  # the work was done, the state not yet moved on
    p = nightly(cfg)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "published v0001" in p.stdout
    assert sorted(d.name for d in (tmp_path / "ck").glob("v*")) == ["v0001"]  # trained once
    assert [e["version"] for e in registry.read(str(tmp_path / "ck"))] == ["v0001"]  # registered once
    assert s.metric("nightshift_serve_lora_loads_total") == 1  # loaded once


def test_a_second_run_waits_for_the_lock(tmp_path, tiny_model):
    cfg = _config(tmp_path, tiny_model, "http://127.0.0.1:9")
    lock = tmp_path / "ck" / ".nightly" / "nightly.lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = nightly(cfg)
    assert p.returncode == 75 and "another nightly run holds" in p.stdout + p.stderr


def test_a_failing_stage_exits_1_and_the_next_run_resumes_it(tmp_path, tiny_model, serve_factory):
    _spans(tmp_path / "data")
    s = serve_factory()  # not started yet: publishing will find nobody there
    cfg = _config(tmp_path, tiny_model, s.url)
    p = nightly(cfg)
    assert p.returncode == 1 and "cannot be reached" in p.stdout + p.stderr
    state = json.loads((tmp_path / "ck" / ".nightly" / "state.json").read_text())
    assert state["stage"] == "publish" and "cannot be reached" in state["error"]
    s.start()
    p = nightly(cfg)
    assert p.returncode == 0 and "published v0001" in p.stdout


def test_a_failing_evaluation_command_holds_the_version_back(tmp_path, tiny_model, serve_factory):
    s = serve_factory().start()
    _spans(tmp_path / "data")
    cfg = _config(tmp_path, tiny_model, s.url, gate={"ranking_margin": 1.0, "samples": 0,
                                                            "command": "echo '{\"score\": 0.1}'; exit 3"})
    p = nightly(cfg)
    assert p.returncode == 0 and "held back by the gate" in p.stdout and "exit 3" in p.stdout
    assert registry.read(str(tmp_path / "ck")) == [] and "agent@v0001" not in s.models()
    log = json.loads((tmp_path / "ck" / "gate-log.jsonl").read_text().splitlines()[-1])
    assert log["command"]["result"] == {"score": 0.1} and not log["passed"]


def test_the_gate_blocks_a_worse_checkpoint(tmp_path, tiny_model):
    rows, flipped = [], []
    for i in range(40):
        q = f"What is {i} + {i}?"
        good = row(q, f"The answer is {2 * i}.", 1.0, advantage=0.5, group=q, trajectory=f"g{i:031d}")
        bad = row(q, "I don't know.", 0.0, advantage=-0.5, group=q, trajectory=f"b{i:031d}")
        rows += [good, bad]
        flipped += [dict(good, advantage=-0.5, reward=0.0), dict(bad, advantage=0.5, reward=1.0)]
    write(tmp_path / "true", rows)
    write(tmp_path / "flipped", flipped)

    def version(data: str, out: str) -> str:
        cfg = TrainConfig()
        apply(cfg, dict(data=str(tmp_path / data), base_model=str(tiny_model), output=str(tmp_path / out),
                         max_steps=15, batch_size=8, learning_rate=2e-3, tensorboard=False, eval_fraction=0.3,
                         served_model_name="tiny"), "test")
        return train(cfg, progress=False).path

    good, worse = version("true", "good"), version("flipped", "worse")
    judge = TrainConfig()
    apply(judge, dict(data=str(tmp_path / "true"), base_model=str(tiny_model), eval_fraction=0.3), "test")
    quick = dict(samples=4, max_tokens=8)
    blocked = gate(worse, good, judge, GateSettings(**quick), log_dir=str(tmp_path))
    assert not blocked.passed and "ranks rewarded actions worse" in blocked.reason, blocked.lines()
    assert blocked.candidate_metrics["ranking_accuracy"] < 0.5 == blocked.published_metrics["ranking_accuracy"]
    assert blocked.candidate_metrics["rows"] == blocked.published_metrics["rows"] > 0  # the same held-out rows
    assert "ranking [FAILED]" in "\n".join(blocked.lines())
    gap = 0.5 - blocked.candidate_metrics["ranking_lower_bound"]
    tolerated = gate(worse, good, judge, GateSettings(ranking_margin=min(1.0, gap + 0.01), **quick),
                     log_dir=str(tmp_path))
    assert tolerated.passed and "no worse than the margin" in tolerated.reason  # worse, by less than the margin
    passed = gate(good, worse, judge, GateSettings(**quick), log_dir=str(tmp_path))
    assert passed.passed and passed.candidate_metrics["ranking_accuracy"] > 0.5
    vs_base = gate(good, None, judge, GateSettings(**quick))
    assert vs_base.passed and vs_base.published is None
    assert len((tmp_path / "gate-log.jsonl").read_text().splitlines()) == 3
