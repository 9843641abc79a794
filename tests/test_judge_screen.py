"""Screening of prompt candidates (issue 27 item 3), judged in judge/: the weight
gate's command contract on each stored candidate, the folders it is given, its
score ranking the beam; and the proposer, which never imports the judge, refusing
a round that has a screening command but was handed no screening."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.proposer_standin import Standin
from test_prompts_propose import config, lake  # noqa: F401  (the fixture: a lake of one agent's trajectories)

from nightshift.judge.screen import screener
from nightshift.prompts.config import ScreenSettings
from nightshift.prompts.propose import ApoError, propose


def test_screening_gets_the_gate_contract_and_only_passing_candidates_join_the_beam(lake, tmp_path):
    seen = tmp_path / "seen.jsonl"
    cmd = ("python3 -c 'import json,os,pathlib;e=os.environ;c=pathlib.Path(e[\"NIGHTSHIFT_CANDIDATE\"]);"
           "p=pathlib.Path(e[\"NIGHTSHIFT_PUBLISHED\"]);"
           f"open(\"{seen}\",\"a\").write(json.dumps({{k:e[k] for k in e if k.startswith(\"NIGHTSHIFT_\")}})+chr(10));"
           "assert (c/\"manifest.json\").exists() and (p/\"system.txt\").exists();"
           "print(json.dumps({\"score\": len((c/\"system.txt\").read_text())}))'")
    with Standin() as s:
        cfg = config(lake, s, gate=ScreenSettings(command=cmd, timeout=60))
        rnd = propose(cfg, "solver", salt="night-1", screen=screener(cfg))
        c, other = rnd.stored
        env = json.loads(seen.read_text().splitlines()[0])
        assert env["NIGHTSHIFT_CANDIDATE"] == c.path and env["NIGHTSHIFT_PUBLISHED"] == c.path + "/parent"
        assert (env["NIGHTSHIFT_KIND"], env["NIGHTSHIFT_AGENT"], env["NIGHTSHIFT_BASE_MODEL"]) == ("prompt", "solver", "tiny")
        assert c.screen["passed"] and c.screen["score"] == len(c.system) > other.screen["score"]
        assert json.loads((Path(c.path) / "screen.json").read_text())["passed"]
        assert [e.ref for e in rnd.beam.entries] == ["lake", "v0001"]  # beam_width 2: the best scored one
        # the next night edits both parents; a failing screen keeps a candidate out of the beam
        cfg.gate = ScreenSettings(command="exit 3", timeout=60)
        nxt = propose(cfg, "solver", salt="night-2", screen=screener(cfg))
    assert set(nxt.critiques) == {"lake", "v0001"}
    assert all(not c.screen["passed"] and c.screen["exit"] == 3 for c in nxt.stored)
    assert [e.ref for e in nxt.beam.entries] == ["lake", "v0001"]


def test_a_round_with_a_screening_command_and_no_screening_handed_in_is_refused(lake, tmp_path):  # noqa: F811
    nowhere = SimpleNamespace(url="http://127.0.0.1:9")  # never asked: the round is refused first
    cfg = config(lake, nowhere, gate=ScreenSettings(command="true"))
    assert screener(config(lake, nowhere)) is None  # no command: nothing to run
    with pytest.raises(ApoError, match="apo.gate.command is set but this caller screens nothing"):
        propose(cfg, "solver", salt="n")
    assert not (lake / "prompt-candidates" / "solver").exists()  # refused before anything was stored
