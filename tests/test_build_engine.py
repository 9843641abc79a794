"""`nightshift build --build-engine ray` when Ray cannot run: one sentence that names
what is missing (Ray not installed here, nothing at the cluster's address), exit 1,
nothing written; never a traceback, never minutes of Ray's own retries."""

from __future__ import annotations

import sys
import time

import pytest

from nightshift.cli.main import main
from traces import Trace, genai_call, write_spans


@pytest.fixture
def data(tmp_path):
    t = Trace("engine")
    root = t.span("invoke_agent a", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "a"}, start=0, end=9)
    t.span("chat m", genai_call("task", "answer"), parent=root, start=1, end=2)
    write_spans(str(tmp_path / "data"), [t])
    return tmp_path / "data"


def said(capsys) -> str:
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    assert "Traceback" not in text
    return text


def test_ray_not_installed_is_one_sentence(data, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    code = main(["build", "--data", str(data), "--settle", "0", "--build-engine", "ray", "--quiet"])
    text = said(capsys)
    assert code == 1 and "Ray is not installed" in text and "nightshift-rl[distributed]" in text, text
    assert len(text.splitlines()) == 1
    assert not list((data / "transitions").glob("date=*")) if (data / "transitions").exists() else True


def test_an_unreachable_cluster_is_one_sentence_at_once(data, capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    t0 = time.monotonic()
    code = main(["build", "--data", str(data), "--settle", "0", "--build-engine", "ray",
                 "--build-ray-address", "127.0.0.1:9", "--quiet"])
    text = said(capsys)
    assert code == 1 and "cannot reach the Ray cluster at 127.0.0.1:9" in text, text
    assert len(text.splitlines()) == 1
    assert time.monotonic() - t0 < 60  # not Ray's own minutes of retries against nothing
    assert not list((data / "transitions").glob("date=*")) if (data / "transitions").exists() else True


def test_the_engine_flags_are_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["build", "--help"])
    text = capsys.readouterr().out
    for flag in ("--build-engine", "--build-ray-address", "--build-workers", "--build-buckets"):
        assert flag in text
