"""One build at a time per lake: a second build refuses in one sentence instead of
taking the first one's scratch for a crash's leftovers (transform/output.py `held`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from traces import Trace, genai_call, write_spans

from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig


def _episode(seed: str) -> Trace:
    t = Trace(seed)
    root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                  start=0, end=5)
    t.span("chat m1", genai_call("task", "answer"), parent=root, start=1, end=2)
    t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                         "agentlightning.reward.0.value": 1.0}, parent=root, start=3, end=3.5)
    return t


HOLD = textwrap.dedent("""
    import sys, time
    import fsspec
    from nightshift.transform import output
    fs, root = fsspec.core.url_to_fs(sys.argv[1])
    with output.held(fs, root):
        print("held", flush=True)
        sys.stdin.read()  # until the test closes it
""")


def test_a_second_build_on_a_lake_is_refused_and_the_first_ones_scratch_kept(tmp_path):
    write_spans(tmp_path, [_episode("a")])
    build(TransformConfig(data=str(tmp_path), settle=0))
    scratch = tmp_path / "transitions" / ".build-running"  # a running build's split pieces
    scratch.mkdir()
    (scratch / "bucket-0000.arrow").write_bytes(b"pieces")
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        r = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(tmp_path), "--settle", "0"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr  # as every BuildError
        assert "another build" in r.stderr and f"pid {first.pid}" in r.stderr and "Traceback" not in r.stderr
        assert (scratch / "bucket-0000.arrow").read_bytes() == b"pieces"  # HEAD's repair removed it
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    # the first one gone (its lock with it, however it ended): the next build runs and cleans up
    build(TransformConfig(data=str(tmp_path), settle=0))
    assert not scratch.exists() and os.listdir(tmp_path / "transitions") == ["date=2025-11-22"]
