"""Killed between the route's change and the trials record (issue 27: "a crash
between the route's change and the trials record is not reconciled"), a prompt
canary's start, stop or promotion leaves the route and `<store>/trials.json`
agreeing once the next command (`nightshift watch`, or the nightly job, which
calls the same `reconcile`) has run: nothing pending, and the route rewrites
exactly the prompts the record says are on trial or promoted, at the recorded
share. Real processes: `nightshift route` in front of a stand-in upstream (named
as such in test_prompt_canary.py), and the change itself in a subprocess killed
with SIGKILL at each failpoint (publish/failpoints.py)."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from test_prompt_canary import upstream  # noqa: F401  (the fixture: a stand-in hosted API)
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)
from transitions_data import msg, row

from nightshift.prompts import store as cands
from nightshift.publish import prompt_canary as trials
from nightshift.publish.failpoints import ENV
from nightshift.route.client import RouteClient, prompt_name
from nightshift.schemas import transitions
from nightshift.schemas.prompt_identity import PromptVersion, system_id

MODEL = "gpt-x"
START = ("import sys\nfrom nightshift.prompts import store as cands\nfrom nightshift.publish import prompt_canary as t\n"
         "from nightshift.route.client import RouteClient\nstore, url, agent = sys.argv[1:4]\n"
         "t.start(store, cands.read(store + '/' + agent, 'v0001'), RouteClient(url), 0.3, agent=agent)\n")


def _candidate(store: str, agent: str, own: str, text: str) -> cands.Candidate:
    parent, cand = PromptVersion.of([own], []), PromptVersion.of([text], [])
    return cands.commit(store, agent, {"system.txt": text}, {
        "kind": "prompt", "model": MODEL,
        "parent": {"ref": "lake", "version_id": parent.id, "system_hash": parent.system_hash, "system": own},
        "candidate": {"version_id": cand.id, "system_hash": cand.system_hash, "system": text, "chars": len(text)}})


def _lake(data: Path, agent: str, own: str, start: dt.datetime, cand_id: str, own_rate: float, cand_rate: float) -> None:
    """40 one-call trajectories a side after `start`: the agent's own prompt and the candidate's."""
    rows = []
    for arm, seen, rate in (("own", None, own_rate), ("cand", cand_id, cand_rate)):
        for i in range(40):
            r = row([msg("system", own), msg("user", f"order {arm} {i}")], "ok", 1.0 if i < rate * 40 else 0.0,
                    trajectory=f"{agent}-{arm}-{i}", agent=agent, model=MODEL,
                    when=start + dt.timedelta(seconds=30 * i + 1))
            r["prompt_seen"] = seen
            rows.append(r)
    folder = data / "transitions" / f"date={start.date().isoformat()}"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=transitions.SCHEMA), folder / f"part-{agent}.parquet")


def _killed(args: list[str], point: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, env={**env, ENV: point})
    assert p.returncode == -9, f"not killed at {point}: exit {p.returncode}\n{p.stdout}\n{p.stderr}"


def _watch(cfg: Path, data: Path, ck: Path) -> tuple[int, str]:
    from nightshift.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["watch", "--config", str(cfg), "--data", str(data), "--checkpoints", str(ck)])
    return code, out.getvalue()


def _agree(stores: list[str], client: RouteClient) -> dict[str, tuple[str, float]]:
    """Nothing pending, and the route's prompt routes are exactly those the records
    (one store per agent here, one route for all) have on trial (at the trial's
    share) or promoted (at 1.0); returns them."""
    recorded = {}
    for store in stores:
        assert trials.pending(store) is None, store
        entries = trials.read(store)
        recorded |= {prompt_name(t["match"]): (t["candidate"], float(t["share"])) for t in trials.running(entries)}
        recorded |= {prompt_name(p["match"]): (p["candidate"], 1.0) for p in trials.applied(entries)}
    served = {}
    for name in client.routes().get("prompts") or {}:
        route = client.get(name)
        served[name] = (route["candidate"], float(route["share"]))
    assert served == recorded, (served, recorded)
    return served


def test_a_prompt_canary_killed_at_every_step_is_settled_by_the_next_watch(tmp_path, upstream, route_factory):  # noqa: F811
    r = route_factory(upstream).start()
    client = RouteClient(r.url)
    ck = tmp_path / "ck"
    ck.mkdir()
    points = ("prompt_start.pending", "prompt_start.routed", "prompt_stop.pending", "prompt_stop.routed",
              "prompt_promote.pending", "prompt_promote.routed")
    stores: list[str] = []
    for i, point in enumerate(points):
        agent, own = f"agent{i}", f"You are agent {i} of Acme. Answer in one sentence."
        store, data = str(tmp_path / f"store{i}"), tmp_path / f"data{i}"
        cand = _candidate(store, agent, own, own + " Look the order up first.")
        match = prompt_name(system_id([own]))
        cfg = tmp_path / f"n{i}.yaml"
        cfg.write_text(json.dumps({"apo": {"candidates_dir": store},
                                   "nightly": {"canary": {"route_url": r.url}, "watch": {"min_trajectories": 30}}}))
        if point.startswith("prompt_start"):
            _killed(["-c", START, store, r.url, agent], point)
        else:
            trial = trials.start(store, cand, client, 0.3, agent=agent)
            better = point.startswith("prompt_promote")
            _lake(data, agent, own, dt.datetime.fromisoformat(trial["time"]) + dt.timedelta(minutes=1),
                  cand.version_id, 0.3 if better else 0.9, 0.9 if better else 0.2)
            _killed(["-m", "nightshift.cli", "watch", "--config", str(cfg), "--data", str(data), "--checkpoints",
                     str(ck)], point)
        assert trials.pending(store) is not None, point  # the kill left the change half-done

        code, out = _watch(cfg, data, ck)
        assert code in (0, 3) and "repaired: the " in out, (point, out)
        served = {k: v for k, v in _agree(stores + [store], client).items() if k == match}
        stores.append(store)
        last = trials.read(store)[-1] if trials.read(store) else {}
        if point == "prompt_start.pending":  # the route never took it: dropped, nothing served
            assert served == {} and not trials.read(store), out
        elif point == "prompt_start.routed":  # the route serves it: recorded now, judged from here on
            assert served == {match: (cand.manifest["candidate"]["system_hash"], 0.3)} and last["role"] == "canary", out
        elif point.startswith("prompt_stop"):  # production judged it worse: the stop is finished
            assert served == {} and (last["role"], last["outcome"]) == ("canary_end", "stopped"), out
        else:  # promoted: recorded, or dropped and promoted again by the same look's fresh decision
            assert served == {match: (cand.manifest["candidate"]["system_hash"], 1.0)}, out
            assert (last["role"], last["outcome"]) == ("canary_end", "promoted"), out
