"""Offline screening of prompt candidates: the user's own evaluation, run on each
candidate before any production traffic sees it, through the weight gate's hook
and contract (judge/gate.py): a shell command that exits 0 to pass, with the
candidate named in the environment, and whose last stdout line, when JSON, is its
result. It lives with the judge, beside the gate, because it decides whether a
version may go out; the proposer (prompts/propose.py) is handed it (`screener`)
and never imports it: proposing and judging stay apart.

For a prompt the environment names folders of the same shape:
NIGHTSHIFT_CANDIDATE (the candidate: system.txt, prompt.json, manifest.json) and
NIGHTSHIFT_PUBLISHED (its parent: system.txt, prompt.json), NIGHTSHIFT_BASE_MODEL
(the model the agent calls), and, new here, NIGHTSHIFT_KIND=prompt and
NIGHTSHIFT_AGENT, so one command can screen adapters and prompts both. A numeric
`"score"` in the JSON line ranks the candidates that pass (for the beam). The
command inherits this process's environment: an evaluation that calls the hosted
model needs the same key the agent uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from nightshift.prompts import store
from nightshift.prompts.config import ApoConfig, ScreenSettings

#: What the proposer is handed: the screening of one stored candidate of an agent
#: whose prompt goes to `model`, as the result `run` gives.
Screen = Callable[[store.Candidate, str, "str | None"], dict]


def screener(cfg: ApoConfig) -> Screen | None:
    """The screening for `propose`'s candidates, or None when `apo.gate.command` is
    not set (nothing to run: the proposer's order decides)."""
    if not cfg.gate.command:
        return None
    return lambda c, agent, model: candidate(cfg, c, agent, model)


def candidate(cfg: ApoConfig, c: store.Candidate, agent: str, model: str | None) -> dict:
    """The screening command on a stored candidate, on local folders (an object
    store's candidate is fetched to a temporary one first)."""
    if store.is_local(c.path):
        path = c.path.removeprefix("file://")
        return run(cfg.gate, path, f"{path}/parent", agent, model)
    import fsspec

    with tempfile.TemporaryDirectory() as tmp:
        fs, p = fsspec.core.url_to_fs(c.path, **(cfg.storage_options or {}))
        fs.get(p.rstrip("/") + "/", tmp, recursive=True)
        return run(cfg.gate, tmp, str(Path(tmp) / "parent"), agent, model)


def run(settings: ScreenSettings, candidate: str, parent: str, agent: str, model: str | None) -> dict:
    """{"passed", "exit", "summary", "result"?, "score"?} of the command on one candidate."""
    env = {**os.environ, "NIGHTSHIFT_CANDIDATE": candidate, "NIGHTSHIFT_PUBLISHED": parent,
           "NIGHTSHIFT_BASE_MODEL": model or "", "NIGHTSHIFT_KIND": "prompt", "NIGHTSHIFT_AGENT": agent}
    try:
        p = subprocess.run(settings.command, shell=True, env=env, capture_output=True, text=True,
                           timeout=settings.timeout)
    except subprocess.TimeoutExpired:
        return {"exit": None, "passed": False, "summary": f"timed out after {settings.timeout:.0f} s"}
    out: dict = {"exit": p.returncode, "passed": p.returncode == 0}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        out["result"] = json.loads(last)
    except json.JSONDecodeError:
        pass
    score = out.get("result", {}).get("score") if isinstance(out.get("result"), dict) else None
    if isinstance(score, (int, float)) and not isinstance(score, bool) and score == score:
        out["score"] = float(score)
    tail = (p.stderr.strip() or p.stdout.strip())[-300:]
    out["summary"] = json.dumps(out["result"]) if "result" in out else tail
    return out
