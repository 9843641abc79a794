"""Production judging each published version: reward by version, the always-valid
sequential test, and the watch rolling a worse version back through the real
publish path (the serve stand-in, real adapters)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nightshift.publish import registry
from nightshift.judge.versions import by_version, interval, lines
from nightshift.publish.canary import CanarySettings
from nightshift.judge.watch import WatchSettings, canary_action, judge, radius
from transitions_data import row, write


def _traj(version: str | None, reward: float | None, i: int, agent: str = "writer", steps: int = 2) -> list[dict]:
    when = dt.datetime(2026, 11, 20, 12, tzinfo=dt.timezone.utc) + dt.timedelta(minutes=i)
    traj = hashlib.sha256(f"{version}-{agent}-{i}".encode()).hexdigest()[:32]
    out = []
    for s in range(steps):
        r = row(f"task {i}", f"answer {s}", reward, trajectory=traj, step=s, num_steps=steps, agent=agent, when=when)
        r["policy_version"] = version
        out.append(r)
    return out


def test_reward_by_version_per_agent_with_intervals_and_too_few_said_so(tmp_path):
    rows = []
    for i in range(40):
        rows += _traj(None, float(i % 2), i)  # the base model: 50 % success
        rows += _traj("v0001", 1.0 if i % 4 else 0.0, 100 + i)  # 75 %
    for i in range(10):
        rows += _traj("v0002", 1.0, 200 + i, agent="checker")  # too few for an interval
    rows += _traj("v0002", None, 300)  # unrated
    write(tmp_path, rows)
    stats = {(s.version, s.agent): s for s in by_version(str(tmp_path))}
    base, v1, v2 = stats[("base", "(all)")], stats[("v0001", "(all)")], stats[("v0002", "(all)")]
    assert (base.calls, base.trajectories, base.rated, base.mean, base.binary) == (80, 40, 40, 0.5, True)
    assert (v1.mean, v1.rated) == (0.75, 40) and v1.low == pytest.approx(interval([1.0] * 30 + [0.0] * 10, True)[0])
    assert v1.low < 0.75 < v1.high and 0.5 < v1.high < 0.9
    assert (v2.trajectories, v2.rated, v2.low) == (11, 10, None) and stats[("v0002", "checker")].rated == 10
    text = "\n".join(lines(list(stats.values())))
    assert "too few rated trajectories for an interval: 30 needed" in text and "success 0.750" in text


def _bernoulli(p: float, n: int, rng: random.Random) -> list[float]:
    return [1.0 if rng.random() < p else 0.0 for _ in range(n)]


def _first_decision(p_base: float, p_cand: float, seed: int, looks: range) -> tuple[str, int]:
    """The nightly watch looks after every batch of trajectories; the first decision taken."""
    rng = random.Random(seed)
    base = _bernoulli(p_base, looks.stop, rng)
    cand = _bernoulli(p_cand, looks.stop, rng)
    for n in looks:
        v = judge(base[:n], cand[:n])
        if v.decision in ("worse", "better"):
            return v.decision, n
    return "none", looks.stop


def test_an_aa_comparison_never_rolls_back_however_often_it_looks():
    # two copies of one version, looked at after every 20 trajectories up to 600, 20 seeds
    decisions = [_first_decision(0.6, 0.6, seed, range(20, 601, 20))[0] for seed in range(20)]
    assert decisions == ["none"] * 20


def test_a_worse_version_is_found_and_a_better_one_promoted():
    found = [_first_decision(0.7, 0.45, seed, range(20, 601, 20)) for seed in range(20)]
    assert all(d == "worse" for d, _ in found), found
    assert max(n for _, n in found) <= 300  # README: within 300 trajectories per version at this gap
    better = [_first_decision(0.45, 0.7, seed, range(20, 601, 20))[0] for seed in range(5)]
    assert better == ["better"] * 5
    assert judge([1.0] * 10, [0.0] * 10).decision == "too_few"  # never on fewer than it needs


def _canary_outcome(p_serving: float, p_canary: float, seed: int, per_look: int = 20, looks: int = 30,
                    hours_per_look: float = 6.0) -> tuple[str, int]:
    """A canary looked at every `hours_per_look` hours, each look adding `per_look` rated
    trajectories on each side: (its fate, trajectories per side when decided)."""
    rng = random.Random(seed)
    serving, canary = _bernoulli(p_serving, per_look * looks, rng), _bernoulli(p_canary, per_look * looks, rng)
    w, c = WatchSettings(), CanarySettings(share=0.5)
    for k in range(1, looks + 1):
        n = k * per_look
        action = canary_action(judge(serving[:n], canary[:n]), k * hours_per_look, w, c)
        if action:
            return action, n
    return "undecided", per_look * looks


def test_a_canary_as_good_as_what_serves_is_never_stopped_over_20_seeds():
    fates = [_canary_outcome(0.4, 0.4, seed) for seed in range(20)]
    assert all(f != "stop" for f, _ in fates), fates
    assert min(n for _, n in fates) >= 30  # never on fewer trajectories than the test needs
    # with 600 a side the sequence is still too wide to show "no worse than 0.05": they expire
    assert {f for f, _ in fates} <= {"expire", "promote"}


def test_a_worse_canary_is_stopped_and_a_better_one_promoted_within_a_few_hundred_trajectories():
    worse = [_canary_outcome(0.4, 0.1, seed) for seed in range(20)]
    assert all(f == "stop" for f, _ in worse), worse
    assert max(n for _, n in worse) <= 200, worse
    better = [_canary_outcome(0.4, 0.75, seed) for seed in range(20)]
    assert all(f == "promote" for f, _ in better), better
    assert max(n for _, n in better) <= 200, better
    # 8 points worse: never promoted (a point estimate "within the margin" would have
    # promoted 8 of these 20 at 80 trajectories a side)
    slightly = [_canary_outcome(0.5, 0.42, seed) for seed in range(20)]
    assert all(f in ("stop", "expire") for f, _ in slightly), slightly


def test_the_confidence_sequence_holds_the_difference_and_names_the_decision():
    rng = random.Random(3)
    a, b = _bernoulli(0.7, 200, rng), _bernoulli(0.4, 200, rng)
    v = judge(a, b)
    assert v.decision == "worse" and v.low < v.diff < v.high < 0  # worse: the whole sequence below 0
    assert v.high - v.low == pytest.approx(2 * radius((0.21 + 0.24) / 200, 0.1, 0.01), rel=0.1)
    w = judge(a[:40], a[40:80])
    assert w.decision == "wait" and w.low < 0 < w.high


def ns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True, timeout=180)


def test_the_watch_rolls_a_worse_version_back_and_records_why(tmp_path, serve_factory, tool_adapter):
    import shutil

    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    ck = tmp_path / "ck"
    for v in ("v0001", "v0002"):
        shutil.copytree(tool_adapter, ck / v)
        man = json.loads((ck / v / "manifest.json").read_text())
        man["version"] = v
        (ck / v / "manifest.json").write_text(json.dumps(man))
    flags = ["--vllm-url", s.url, "--name", "agent", "--stable-name", "agent-live"]
    for v in ("v0001", "v0002"):
        assert ns("publish", "--checkpoint", str(ck / v), *flags).returncode == 0
    rng = random.Random(7)
    rows = []
    for i in range(150):
        rows += _traj("v0001", 1.0 if rng.random() < 0.8 else 0.0, i)
        rows += _traj("v0002", 1.0 if rng.random() < 0.3 else 0.0, 1000 + i)
    write(tmp_path / "data", rows)
    dry = ns("watch", "--data", str(tmp_path / "data"), "--checkpoints", str(ck), *flags, "--dry-run")
    assert dry.returncode == 0 and "v0002 (serving) against v0001: worse" in dry.stdout, dry.stdout + dry.stderr
    assert registry.current(str(ck))["version"] == "v0002"  # a dry run changes nothing ...
    assert "would roll v0002 back (dry run)" in dry.stdout and not (ck / "gate-log.jsonl").exists()  # ... records nothing
    p = ns("watch", "--data", str(tmp_path / "data"), "--checkpoints", str(ck), *flags)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "rolled back: v0002 -> v0001" in p.stdout
    now = registry.current(str(ck))
    assert (now["version"], now.get("rollback_of")) == ("v0001", "v0002")
    assert "agent-live" in s.models() and "agent@v0001" in s.models()
    decision = json.loads((ck / "gate-log.jsonl").read_text().splitlines()[-1])
    assert (decision["kind"], decision["decision"], decision["rolled_back_to"]) == ("watch", "worse", "v0001")
    assert decision["p_value"] < 0.01 and decision["n_candidate"] == 150
    # the next look compares v0001 (serving again) with v0002: better, nothing more to roll back
    again = ns("watch", "--data", str(tmp_path / "data"), "--checkpoints", str(ck), *flags)
    assert again.returncode == 0 and "v0001 (serving) against v0002: better" in again.stdout


def test_a_first_version_worse_than_the_base_is_said_and_kept_not_unserved(tmp_path):
    ck = tmp_path / "ck"
    registry.append(str(ck), {"version": "v0001", "name": "agent@v0001", "endpoint": "http://127.0.0.1:9",
                              "mode": "lora", "path": "/x", "checkpoint": str(ck / "v0001")})
    rng = random.Random(5)
    rows = []
    for i in range(120):
        rows += _traj(None, 1.0 if rng.random() < 0.8 else 0.0, i)  # the base, before v0001
        rows += _traj("v0001", 1.0 if rng.random() < 0.3 else 0.0, 1000 + i)
    write(tmp_path / "data", rows)
    p = ns("watch", "--data", str(tmp_path / "data"), "--checkpoints", str(ck), "--vllm-url", "http://127.0.0.1:9",
           "--name", "agent")
    assert p.returncode == 0, p.stdout + p.stderr  # nothing rolled back: exit 0, not 3
    assert "v0001 (serving) against base: worse" in p.stdout and "v0001 stays" in p.stdout and "canary" in p.stdout
    decision = json.loads((ck / "gate-log.jsonl").read_text().splitlines()[-1])
    assert (decision["decision"], decision["action"], decision["baseline"]) == ("worse", "kept: nothing published "
                                                                                  "before it", "base")
    assert registry.current(str(ck))["version"] == "v0001"


def _canary_entry(ck: Path, started: dt.datetime, checkpoint: str, route_url: str = "") -> None:
    registry.append(str(ck), {"version": "v0002", "name": "agent@v0002", "endpoint": "http://127.0.0.1:9",
                              "mode": "lora", "path": "/x", "checkpoint": checkpoint, "role": "canary", "share": 0.5,
                              "route": route_url, "serving": "base", "serving_name": "world-policy",
                              "stable": "agent", "time": started.isoformat()})


def _arms(start: dt.datetime, n: int, p_base: float, p_canary: float, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        when = start + dt.timedelta(minutes=i)
        for version, p, k in ((None, p_base, i), ("v0002", p_canary, 5000 + i)):
            r = row(f"task {k}", "answer", 1.0 if rng.random() < p else 0.0, trajectory=f"{k:032x}", when=when)
            rows.append({**r, "policy_version": version})
    return rows


def test_a_canary_is_judged_by_the_agents_clock_not_the_publishers(tmp_path):
    from nightshift.nightly.run import NightlyConfig
    from nightshift.judge.watch import watch

    published = dt.datetime(2026, 11, 20, 15, tzinfo=dt.timezone.utc)
    _canary_entry(tmp_path / "ck", published, str(tmp_path / "ck" / "v0002"))
    # the agents' hosts run three hours behind the machine that published the canary
    write(tmp_path / "data", _arms(published - dt.timedelta(hours=3), 150, 0.3, 0.8))
    n = NightlyConfig(vllm_url="http://127.0.0.1:9", name="agent", stable_name="agent")
    v, out = watch(str(tmp_path / "data"), str(tmp_path / "ck"), n, n.watch, n.canary, act=False)
    assert (v.decision, v.n_baseline, v.n_candidate) == ("better", 150, 150), out
    assert "would promote" in out[-1]


def test_a_canary_whose_folder_was_deleted_is_ended_not_promoted(tmp_path):
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "agent_world"))
    import loop

    from nightshift.nightly.run import NightlyConfig
    from nightshift.judge.watch import watch
    from nightshift.route.client import RouteClient

    (tmp_path / "logs").mkdir()
    proxy = loop.start_route(types.SimpleNamespace(url="http://127.0.0.1:9"), tmp_path / "logs", tmp_path / "r.json")
    try:
        RouteClient(proxy.url).set("agent", "world-policy", "agent@v0002", 0.5)
        started = dt.datetime.now(dt.timezone.utc)
        _canary_entry(tmp_path / "ck", started, str(tmp_path / "ck" / "v0002"), proxy.url)  # no such folder
        write(tmp_path / "data", _arms(started + dt.timedelta(seconds=5), 150, 0.3, 0.8))
        n = NightlyConfig(vllm_url="http://127.0.0.1:9", name="agent", stable_name="agent", retries=0, timeout=2)
        n.canary.route_url = proxy.url
        v, out = watch(str(tmp_path / "data"), str(tmp_path / "ck"), n, n.watch, n.canary)
        assert v.decision == "better" and v.action == "canary expired", out
        assert "folder was deleted" in "\n".join(out)
        end = registry.read(str(tmp_path / "ck"))[-1]
        assert (end["role"], end["outcome"]) == ("canary_end", "expired")
        route = RouteClient(proxy.url).get("agent")
        assert (route["serving"], route["candidate"]) == ("world-policy", None)  # every conversation on the base
    finally:
        proxy.stop()


def test_a_canary_whose_version_already_serves_is_closed_as_promoted_not_judged(tmp_path, monkeypatch):
    """A registry left by a promotion that recorded the publication but died before the
    canary's end (what publishing did before the two were one commit): the canary's
    version serves every conversation. Judging it again as a canary could stop it,
    unloading the adapter that serves; the watch closes it as promoted instead."""
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import publish
    from nightshift.judge.watch import watch
    from nightshift.route.client import RouteClient

    sys.path.insert(0, str(Path(__file__).resolve().parent / "hardening"))
    from vllm_standin import Standin, fake_adapter

    routes: dict = {"agent": {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5}}
    monkeypatch.setattr(RouteClient, "get", lambda self, name: routes.get(name))  # the proxy's control API, stood in
    monkeypatch.setattr(RouteClient, "delete", lambda self, name: routes.pop(name, None))
    monkeypatch.setattr(RouteClient, "set", lambda self, name, s, c=None, share=0.0: routes.update(
        {name: {"serving": s, "candidate": c, "share": share}}))
    server = Standin()
    try:
        ck = tmp_path / "ck"
        for v in ("v0001", "v0002"):
            fake_adapter(ck / v, v)
        kw = dict(name="agent", stable_name="agent", retries=0)
        publish(str(ck / "v0001"), server.url, **kw)
        started = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)
        registry.append(str(ck), {"version": "v0002", "name": "agent@v0002", "endpoint": server.url, "mode": "lora",
                                  "path": str(ck / "v0002"), "checkpoint": str(ck / "v0002"), "role": "canary",
                                  "share": 0.5, "route": "http://proxy", "serving": "v0001",
                                  "serving_name": "agent@v0001", "stable": "agent", "time": started.isoformat()})
        publish(str(ck / "v0002"), server.url, **kw)  # the promotion's publication, then the run died
        rng = random.Random(3)
        rows = []
        for i in range(150):  # production says v0002 is worse: judged as a canary, it would be stopped
            for v, p, k in (("v0001", 0.8, i), ("v0002", 0.3, 5000 + i)):
                r = row(f"task {k}", "a", 1.0 if rng.random() < p else 0.0, trajectory=f"{k:032x}",
                        when=started + dt.timedelta(minutes=i))
                rows.append({**r, "policy_version": v})
        write(tmp_path / "data", rows)
        n = NightlyConfig(vllm_url=server.url, name="agent", stable_name="agent", retries=0)
        n.canary.route_url = "http://proxy"
        v, out = watch(str(tmp_path / "data"), str(ck), n, n.watch, n.canary)
        assert v.decision == "better" and "already serves" in v.why and "canary promoted: v0002" in "\n".join(out), out
        assert server.adapters["agent"] == server.adapters["agent@v0002"] == str(ck / "v0002")  # nothing unloaded
        end = registry.read(str(ck))[-1]
        assert (end["role"], end["version"], end["outcome"]) == ("canary_end", "v0002", "promoted")
        assert "agent" not in routes  # the stable name passes through to the server, where v0002 serves
    finally:
        server.close()
