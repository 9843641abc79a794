"""Killed between any two steps, a publication, a rollback or a canary's start,
stop or promotion leaves the server, the routing proxy and `published.json`
agreeing once the next command has run: it finishes or undoes what was pending
and says so. Real processes: `nightshift serve` with the tiny model, `nightshift
route`, and the command itself as a subprocess killed (SIGKILL) at each
failpoint (publish/failpoints.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nightshift.publish import registry
from nightshift.publish.failpoints import ENV
from nightshift.route.client import RouteClient

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    """One `nightshift serve` for the module; each test publishes under names of its own."""
    from conftest import ServeProcess

    s = ServeProcess(model=tiny_model, log_path=tmp_path_factory.mktemp("serve") / "serve.log",
                     extra_args=["--max-lora-rank", "64"]).start()
    yield s
    s.stop()


def _versions(tmp_path: Path, tool_adapter: Path, n: int) -> Path:
    ck = tmp_path / "ck"
    for i in range(1, n + 1):
        v = ck / f"v{i:04d}"
        shutil.copytree(tool_adapter, v)
        man = json.loads((v / "manifest.json").read_text())
        (v / "manifest.json").write_text(json.dumps({**man, "version": v.name}))
    return ck


def _killed(args: list[str], point: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                       env={**env, "HF_HUB_OFFLINE": "1", ENV: point})
    assert p.returncode == -9, f"not killed at {point}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


def _main(argv: list[str]) -> tuple[int, str]:
    from nightshift.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, out.getvalue()


def _agree(ck: Path, server, name: str, route_url: str = "") -> dict:
    """The registry names what the server serves: nothing pending, the stable name
    on the serving version's path, every versioned adapter loaded one the registry
    names, and the proxy routing exactly the running canary (or none)."""
    doc = registry.load(str(ck))
    assert doc.pending is None, doc.pending
    models = server.models()
    serving = registry.serving(doc.entries, server.url, name)
    assert models[f"{name}-live"]["root"] == serving["path"], (models, serving)
    assert models[serving["name"]]["root"] == serving["path"]
    named = {e["name"] for e in doc.entries}
    assert {m for m in models if m.startswith(f"{name}@")} <= named, (models.keys(), named)
    trial = registry.canary(doc.entries, server.url, name)
    if route_url:
        route = RouteClient(route_url).get(f"{name}-live")
        if trial is not None:
            assert route and route["candidate"] == trial["name"] and trial["name"] in models, (route, trial)
        else:
            assert not (route and route.get("candidate")), route
    return {"serving": serving["version"], "canary": trial and trial["version"]}


@pytest.mark.timeout(600)
def test_a_publication_or_rollback_killed_at_any_step_is_finished_or_undone_by_the_next_command(
        tmp_path, server, tool_adapter):
    s, name = server, "pub"
    ck = _versions(tmp_path, tool_adapter, 7)
    flags = ["--vllm-url", s.url, "--name", name, "--stable-name", f"{name}-live", "--adapter-root",
             str(tmp_path / "adapters"), "--keep", "2"]
    assert _main(["publish", "--checkpoint", str(ck / "v0001"), *flags])[0] == 0
    # each point between two steps of a publication, and the command that runs next: killed before the
    # server showed all of it, it is undone; after (the stable name moved), verified and recorded
    plan = [("begin", "publish"), ("loaded", "watch"), ("stable", "rollback"), ("verified", "publish"),
            ("committed", "rollback")]
    for i, (point, then) in enumerate(plan):
        v = f"v{i + 2:04d}"
        before = _agree(ck, s, name)["serving"]
        _killed(["-m", "nightshift.cli", "publish", "--checkpoint", str(ck / v), *flags], f"publish.{point}")
        assert (registry.load(str(ck)).pending is None) == (point == "committed"), point
        if then == "publish":
            code, out = _main(["publish", "--checkpoint", str(ck / v), *flags])
        elif then == "rollback":
            code, out = _main(["rollback", "--checkpoints", str(ck), *flags])
        else:
            code, out = _main(["watch", "--data", str(tmp_path / "no-data"), "--checkpoints", str(ck), *flags])
        assert code == 0, (point, then, out)
        assert ("repaired:" in out) == (point != "committed"), (point, out)
        now = _agree(ck, s, name)
        if point in ("stable", "verified"):  # all of it was on the server: recorded, not undone
            assert "verified and recorded" in out, out
        if point in ("begin", "loaded"):
            assert "undone" in out, out
        if then == "watch":  # undone, and nothing else: what served before still serves
            assert now["serving"] == before, (now, before)
        print(f"killed at publish.{point}, then {then}: {out.splitlines()[0]}")
    # a rollback killed after it loaded the version to go back to, then a publication
    _killed(["-m", "nightshift.cli", "rollback", "--checkpoints", str(ck), *flags], "publish.loaded")
    code, out = _main(["publish", "--checkpoint", str(ck / "v0007"), *flags])
    assert code == 0 and "a rollback from" in out and "undone" in out, out
    assert _agree(ck, s, name)["serving"] == "v0007"


DRIVER = """
import sys
from nightshift.publish import canary, registry
from nightshift.publish.publish import PublishSettings
op, ck, checkpoint, url, route, name = sys.argv[1:]
s = PublishSettings(vllm_url=url, name=name, stable_name=f"{name}-live", keep=5)
c = canary.CanarySettings(share=0.5, route_url=route)
if op == "start":
    canary.start(checkpoint, ck, s, c, "tiny")
else:
    trial = registry.canary(registry.read(ck), url, name)
    (canary.stop if op == "stop" else canary.promote)(trial, ck, s, c, "driven by the test")
"""


@pytest.mark.timeout(600)
def test_a_canary_start_stop_or_promotion_killed_at_any_step_leaves_server_proxy_and_registry_agreeing(
        tmp_path, server, tool_adapter):
    sys.path.insert(0, str(ROOT / "examples" / "agent_world"))
    import loop

    from nightshift.publish import canary
    from nightshift.publish.publish import PublishSettings, publish
    from nightshift.judge.watch import watch

    s, name = server, "can"
    (tmp_path / "logs").mkdir()
    proxy = loop.start_route(s, tmp_path / "logs", tmp_path / "routes.json")
    try:
        ck = _versions(tmp_path, tool_adapter, 17)
        settings = PublishSettings(vllm_url=s.url, name=name, stable_name=f"{name}-live", keep=5)
        c = canary.CanarySettings(share=0.5, route_url=proxy.url)
        publish(str(ck / "v0001"), s.url, name=name, stable_name=f"{name}-live")
        versions = iter(f"v{i:04d}" for i in range(2, 18))

        def look(point: str) -> dict:
            _, out = watch(str(tmp_path / "no-data"), str(ck), settings, canary=c)
            assert any(line.startswith("repaired:") for line in out) == (not point.endswith("committed")), (point, out)
            return _agree(ck, s, name, proxy.url)

        for point in ("begin", "loaded", "verified", "routed", "committed"):
            v = next(versions)
            _killed(["-c", DRIVER, "start", str(ck), str(ck / v), s.url, proxy.url, name], f"canary_start.{point}")
            now = look(f"canary_start.{point}")
            assert now["canary"] == (v if point in ("routed", "committed") else None), (point, now)
            if now["canary"]:
                canary.stop(registry.canary(registry.read(str(ck)), s.url, name), str(ck), settings, c, "next case")
                _agree(ck, s, name, proxy.url)
        for point in ("begin", "routed", "unloaded", "committed"):
            canary.start(str(ck / next(versions)), str(ck), settings, c, "tiny")
            _killed(["-c", DRIVER, "stop", str(ck), "", s.url, proxy.url, name], f"canary_stop.{point}")
            assert look(f"canary_stop.{point}")["canary"] is None  # a stop is always finished
        for point in ("begin", "loaded", "stable", "verified", "routed", "committed"):
            v = next(versions)
            canary.start(str(ck / v), str(ck), settings, c, "tiny")
            _killed(["-c", DRIVER, "promote", str(ck), "", s.url, proxy.url, name], f"canary_promote.{point}")
            now = look(f"canary_promote.{point}")
            promoted = point in ("routed", "committed")
            assert now["canary"] == (None if promoted else v) and (now["serving"] == v) == promoted, (point, now)
            if not promoted:  # undone: the canary runs on, as before the promotion began
                canary.stop(registry.canary(registry.read(str(ck)), s.url, name), str(ck), settings, c, "next case")
                _agree(ck, s, name, proxy.url)
    finally:
        proxy.stop()
