"""The state files beside the checkpoints against bad bytes: `published.json`,
`gate-log.jsonl`, the nightly job's `state.json` and `runs.jsonl`. Commands that
change the server refuse a registry they cannot read whole, in one sentence and
before touching anything; readers that only report skip and count; a canary the
routing proxy cannot take leaves nothing behind. The short version of
tests/hardening/state_fuzz.py runs here; its long run writes docs/RELIABILITY.md."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import sys
from pathlib import Path

import pytest

from nightshift.publish import registry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "hardening"))

import state_fuzz  # noqa: E402
from vllm_standin import Standin, fake_adapter  # noqa: E402


@pytest.fixture
def server():
    s = Standin()
    yield s
    s.close()


def _main(argv: list[str]) -> tuple[int, str, str]:
    """`nightshift <argv>` in process; an exception out of it fails the test as the traceback it would print."""
    from nightshift.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_the_short_state_campaign_finds_no_traceback_and_never_touches_the_server():
    s = state_fuzz.campaign(150, seed=3, full_every=75)
    assert state_fuzz.ok(s), state_fuzz.report(s)
    # every kind of file was reached, and broken registries were refused (not merely survived)
    assert set(s.by_target) == {"registry", "gatelog", "state", "history"}, s.by_target
    assert s.refused >= 40 and s.full_reports >= 1
    assert s.tracebacks == s.server_touched == s.file_changed == s.glued == 0


BROKEN = {
    "not JSON": (b'{"history": [{"version": "v0001"', "is not JSON"),
    "a list": (b"[]", "holds a list"),
    "no time": (json.dumps({"history": [{"version": "v0001", "name": "agent@v0001", "endpoint": "E",
                                         "mode": "lora"}]}).encode(), "entry 1 of 1 has no 'time'"),
    "invalid UTF-8": (b'{"history": [], "x": "\xff"}', "is not UTF-8"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_publish_and_rollback_refuse_an_unreadable_registry_before_touching_the_server(tmp_path, server, case):
    """Issue 24: publish loaded the adapter and moved the stable name, then read the
    registry, crashed, and recorded nothing: the server served a version no registry
    named. Now the registry is read first: exit 2, one sentence, nothing sent."""
    body, why = BROKEN[case]
    ck = tmp_path / "ck"
    fake_adapter(ck / "v0001", "v0001")
    (ck / "published.json").write_bytes(body)
    flags = ["--vllm-url", server.url, "--name", "agent", "--stable-name", "agent-live", "--retries", "0"]
    for argv in (["publish", "--checkpoint", str(ck / "v0001"), *flags], ["rollback", "--checkpoints", str(ck), *flags],
                 ["watch", "--checkpoints", str(ck), "--data", str(tmp_path / "data"), *flags]):
        code, out, err = _main(argv)
        assert code == 2, (argv[0], out, err)
        assert len(err.strip().splitlines()) == 1 and f"{ck}/published.json" in err and why in err, err
        assert "nothing was changed" in err
    assert server.requests == [] and server.adapters == {}
    assert (ck / "published.json").read_bytes() == body


def test_versions_reads_past_a_bad_registry_and_says_what_it_skipped(tmp_path):
    from transitions_data import row, write

    write(tmp_path / "data", [{**row("q", "a", 1.0), "policy_version": "v0001"}])
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "published.json").write_text(json.dumps([{"version": "v0001"}]))  # a list: not a registry
    code, out, err = _main(["versions", "--data", str(tmp_path / "data"), "--checkpoints", str(ck)])
    assert code == 0 and "holds a list" in out and "read as if empty" in out, out + err
    good = {"version": "v0001", "name": "agent@v0001", "endpoint": "E", "mode": "lora",
            "time": "2026-11-20T00:00:00+00:00"}
    (ck / "published.json").write_text(json.dumps({"history": [good, {"version": "v0002", "name": "agent@v0002"},
                                                               None]}))
    code, out, err = _main(["versions", "--data", str(tmp_path / "data"), "--checkpoints", str(ck)])
    assert code == 0 and "2 of 3 entries skipped" in out and "entry 2 has no 'endpoint'" in out, out + err
    assert "v0001      (all)" in out and "(published.json; " in out  # the good entry still dates v0001


def test_a_canary_the_proxy_cannot_take_leaves_no_entry_no_adapter_and_no_wait(tmp_path, server, monkeypatch):
    """Issue 24: a canary started while the proxy was unreachable was loaded and
    recorded, with no route: the nightly job then waited on it for max_hours."""
    from conftest import free_port
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish import canary
    from nightshift.publish.publish import RouteUnavailable, publish
    from nightshift.route.client import RouteClient, RouteError

    ck = tmp_path / "ck"
    for v in ("v0001", "v0002"):
        fake_adapter(ck / v, v)
    n = NightlyConfig(vllm_url=server.url, name="agent", stable_name="agent-live", keep=3, retries=0)
    publish(str(ck / "v0001"), server.url, name="agent", stable_name="agent-live")
    before, loaded = (ck / "published.json").read_bytes(), dict(server.adapters)
    server.requests.clear()
    # the proxy down from the start: refused before the server is touched
    n.canary.share, n.canary.route_url = 0.3, f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RouteUnavailable, match="canary not started: cannot reach the routing proxy"):
        canary.start(str(ck / "v0002"), str(ck), n, n.canary, "tiny")
    assert server.changes() == [] and (ck / "published.json").read_bytes() == before
    # a proxy stand-in that answers the GET and is gone by the PUT: the candidate is unloaded again
    monkeypatch.setattr(RouteClient, "get", lambda self, name: None)

    def gone(self, *a, **kw):
        raise RouteError(0, f"cannot reach the routing proxy at {self.url}: connection refused")

    monkeypatch.setattr(RouteClient, "set", gone)
    with pytest.raises(RouteUnavailable, match="was undone"):
        canary.start(str(ck / "v0002"), str(ck), n, n.canary, "tiny")
    assert server.adapters == loaded  # agent@v0002 loaded, then unloaded
    doc = registry.load(str(ck))
    assert doc.pending is None and registry.canary(doc.entries, server.url, "agent") is None  # nothing to wait on
    assert [e["version"] for e in doc.entries] == ["v0001"]


def test_a_publication_that_fails_verification_is_undone(tmp_path, server):
    """Found on the way: a chat completion that failed after the stable name moved
    left the server serving the new version while the registry named the old one."""
    from nightshift.publish.publish import publish
    from nightshift.publish.vllm_client import VLLMError

    ck = tmp_path / "ck"
    for v in ("v0001", "v0002"):
        fake_adapter(ck / v, v)
    kw = dict(name="agent", stable_name="agent-live", retries=0)
    publish(str(ck / "v0001"), server.url, **kw)
    loaded = dict(server.adapters)
    server.fail["/v1/chat/completions"] = (500, "CUDA error: an illegal memory access was encountered")
    with pytest.raises(VLLMError, match="illegal memory access"):
        publish(str(ck / "v0002"), server.url, **kw)
    assert server.adapters == loaded and loaded["agent-live"] == str(ck / "v0001")
    doc = registry.load(str(ck))
    assert doc.pending is None and registry.serving(doc.entries, server.url, "agent")["version"] == "v0001"


def _nightly_config(tmp_path: Path, url: str) -> Path:
    cfg = tmp_path / "nightshift.yaml"
    cfg.write_text(json.dumps({"data": str(tmp_path / "data"), "train": {"output": str(tmp_path / "ck"),
                                                                         "base_model": str(tmp_path / "m")},
                               "nightly": {"vllm_url": url, "name": "agent"}}))
    return cfg


@pytest.mark.parametrize("body,why", [
    (b"[]", "does not hold a run's state"),
    (json.dumps({"run_id": "r", "stage": "bogus"}).encode(), "has stage 'bogus'"),
    (json.dumps({"run_id": "r", "stage": "publish", "run_date": "2026-11-23"}).encode(), "no version to publish"),
    (b'{"run_id": "r", "stage": "bu', "is not JSON"),
])
def test_nightly_refuses_a_state_it_cannot_resume_from(tmp_path, server, body, why):
    """A list was an AttributeError traceback; an unknown stage ran nothing and exited 0,
    every night, without a word."""
    state = tmp_path / "ck" / ".nightly" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_bytes(body)
    code, out, err = _main(["nightly", "--config", str(_nightly_config(tmp_path, server.url)), "--quiet"])
    assert code == 2 and str(state) in err and why in err and "move it aside" in err, out + err
    assert state.read_bytes() == body and server.requests == []


def test_state_files_are_written_whole_with_their_folder_synced(tmp_path, monkeypatch):
    """The nightly state had no folder fsync (its rename could be lost to a power cut),
    and a registry write that failed left its temporary file behind."""
    import nightshift.storage as storage
    from nightshift.nightly import run

    synced: list[str] = []
    real = storage.fsync
    monkeypatch.setattr(storage, "fsync", lambda p: (synced.append(str(p)), real(p)))
    (tmp_path / "n").mkdir()
    run._save(tmp_path / "n", {"run_id": "r", "stage": "build"})
    assert str(tmp_path / "n") in synced and json.loads((tmp_path / "n" / "state.json").read_text())["stage"] == "build"

    ck = tmp_path / "ck"
    registry.append(str(ck), {"version": "v0001", "name": "a@v0001", "endpoint": "E", "mode": "lora"})
    before = (ck / "published.json").read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        registry.append(str(ck), {"version": "v0002", "name": "a@v0002", "endpoint": "E", "mode": "lora"})
    monkeypatch.undo()
    assert (ck / "published.json").read_bytes() == before and sorted(p.name for p in ck.iterdir()) == ["published.json"]


def test_the_report_reads_past_a_torn_gate_log_and_the_next_decision_is_not_glued(tmp_path):
    """Invalid UTF-8 in gate-log.jsonl was a traceback in the nightly report; an append
    after a torn last line was glued to it, and both were lost."""
    from nightshift.nightly import report
    from nightshift.judge import gatelog

    decision = {"kind": "watch", "candidate": "v0002", "rolled_back_to": "v0001", "p_value": 0.001}
    (tmp_path / "gate-log.jsonl").write_bytes(json.dumps(decision).encode() + b"\n{\"cand\xffidate\": 1}\n"
                                              + b'{"kind": "watch", "candid')
    assert report.rolled_back(str(tmp_path)) == {"v0002": "rolled back: watch, p 0.001"}
    assert "2 unreadable line(s) skipped" in report.state_notes(str(tmp_path))[0]
    gatelog.append(tmp_path, {"kind": "watch", "candidate": "v0003", "rolled_back_to": "v0002", "canary": True})
    assert report.rolled_back(str(tmp_path))["v0003"] == "canary stopped: watch"
    (tmp_path / "runs.jsonl").write_bytes(b'{"run_id": "a", "candidate_metric": 0.5}\n{"run_id": "b", "candid')
    assert [h["run_id"] for h in report.read_history(tmp_path / "runs.jsonl")] == ["a"]
