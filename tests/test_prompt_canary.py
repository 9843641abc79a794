"""Prompt canaries judged like adapter canaries (issue 27 item 6): a stored prompt
candidate on a share of one agent's conversations through a real `nightshift route`
process (in front of a stand-in upstream, named as such), production's rewards in a
real transitions lake, the watch's mSPRT deciding, the route moved, the record kept;
a promoted prompt retired once the agent sends a prompt of its own that the route no
longer matches."""

from __future__ import annotations

import datetime as dt
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)
from transitions_data import msg, row

from nightshift.cli.main import main
from nightshift.judge import gatelog
from nightshift.judge.prompt_watch import watch_prompts
from nightshift.judge.watch import WatchSettings
from nightshift.prompts import store as cands
from nightshift.publish import prompt_canary as trials
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient, prompt_name
from nightshift.schemas import transitions
from nightshift.schemas.prompt_identity import PromptVersion, system_id

AGENT = "You are the support agent of Acme. Answer in one sentence."
GOOD = "You are the support agent of Acme. Look the order up before you answer. Answer in one sentence."
BAD = "You are the support agent of Acme."
MODEL = "gpt-x"


class Upstream(BaseHTTPRequestHandler):
    """A STAND-IN for a hosted OpenAI-compatible API: answers every chat completion
    with the system prompt it received, as the model that answered."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        body = json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": "gpt-x-2024-11-20",
                           "choices": [{"index": 0, "finish_reason": "stop", "message": {
                               "role": "assistant", "content": req["messages"][0]["content"]}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def upstream():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _candidate(store: str, text: str) -> cands.Candidate:
    parent, cand = PromptVersion.of([AGENT], []), PromptVersion.of([text], [])
    return cands.commit(store, "support", {"system.txt": text}, {
        "kind": "prompt", "model": MODEL,
        "parent": {"ref": "lake", "version_id": parent.id, "system_hash": parent.system_hash, "system": AGENT},
        "candidate": {"version_id": cand.id, "system_hash": cand.system_hash, "system": text, "chars": len(text)}})


def _lake(data, start: dt.datetime, arms: dict[str, tuple[str | None, float]], n: int, tag: str) -> None:
    """`n` one-call trajectories of agent `support` per arm: (prompt the model saw, or
    None for the agent's own; success rate), spread over the hour after `start`."""
    rows = []
    for arm, (seen, rate) in arms.items():
        for i in range(n):
            when = start + dt.timedelta(seconds=30 * i + 1)
            r = row([msg("system", AGENT), msg("user", f"order {tag} {arm} {i}")], "ok",
                    1.0 if i < rate * n else 0.0, trajectory=f"{tag}-{arm}-{i}", agent="support", model=MODEL,
                    when=when)
            r["prompt_seen"] = seen
            rows.append(r)
    schema = transitions.SCHEMA  # version 3: prompt_seen, the prompt version the model saw (the route's mark)
    folder = data / "transitions" / f"date={start.date().isoformat()}"
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / f"part-{tag}.parquet")


def _chat(route_url: str, system: str) -> str:
    body = json.dumps({"model": MODEL, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": "where is my order?"}]}).encode()
    req = urllib.request.Request(f"{route_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk-agent"})
    return json.loads(urllib.request.urlopen(req, timeout=10).read())["model"]


def test_a_prompt_canary_is_promoted_kept_until_the_agent_changes_its_prompt_and_a_worse_one_stopped(
        tmp_path, upstream, route_factory, capsys):  # noqa: F811
    r = route_factory(upstream).start()
    data, store, ckpt = tmp_path / "data", str(tmp_path / "store"), tmp_path / "ckpt"
    ckpt.mkdir()
    client = RouteClient(r.url)
    w, c = WatchSettings(min_trajectories=30), CanarySettings(route_url=r.url, max_hours=72)
    good = _candidate(store, GOOD)
    match = system_id([AGENT])

    trial = trials.start(store, good, client, 0.3, agent="support")
    route = client.get(prompt_name(match))
    assert (route["kind"], route["candidate"], route["share"]) == ("prompt", system_id([GOOD]), 0.3)
    with pytest.raises(trials.TrialError, match="already has prompt candidate v0001 on trial"):
        trials.start(store, _candidate(store, BAD), client, 0.3, agent="support")

    # too few trajectories yet: the canary keeps running, nothing moves
    start = dt.datetime.fromisoformat(trial["time"]) + dt.timedelta(minutes=1)
    _lake(data, start, {"own": (None, 0.3), "cand": (good.version_id, 0.9)}, 10, "a")
    verdicts, lines = watch_prompts(str(data), store, w, c, checkpoints=str(ckpt))
    assert [v.decision for v in verdicts] == ["too_few"] and client.get(prompt_name(match))["share"] == 0.3
    # 30 % against 90 % over 40 trajectories a side: better, promoted to every conversation of that prompt
    _lake(data, start + dt.timedelta(minutes=5), {"own": (None, 0.3), "cand": (good.version_id, 0.9)}, 30, "b")
    verdicts, lines = watch_prompts(str(data), store, w, c, checkpoints=str(ckpt))
    assert [v.decision for v in verdicts] == ["better"], lines
    assert (verdicts[0].n_baseline, verdicts[0].n_candidate) == (40, 40)
    assert client.get(prompt_name(match))["share"] == 1.0
    assert any("promoted" in x for x in lines)
    entries = trials.read(store)
    assert entries[-1]["role"] == "canary_end" and entries[-1]["outcome"] == "promoted"
    logged = [e for e in gatelog.read(str(ckpt))[0] if e.get("prompt")]
    assert logged[-1]["action"] == "promoted" and logged[-1]["agent"] == "support"

    # no new trial on top of it: the route holds one candidate per prompt
    with pytest.raises(trials.TrialError, match="is replaced by promoted candidate v0001 on the route"):
        trials.start(store, _candidate(store, BAD), client, 0.3, agent="support")

    # the route applies it; once the agent sends a changed prompt of its own, the promotion is retired
    assert "+p:" in _chat(r.url, AGENT)
    _, lines = watch_prompts(str(data), store, w, c)
    assert any("still applied" in x for x in lines) and trials.applied(trials.read(store))
    # `nightshift watch` looks at the prompt canaries too (the adapter lane has nothing to compare here)
    cfg = tmp_path / "nightshift.yaml"
    cfg.write_text(json.dumps({"apo": {"candidates_dir": store}, "nightly": {"canary": {"route_url": r.url}}}))
    assert main(["watch", "--config", str(cfg), "--data", str(data), "--checkpoints", str(ckpt)]) == 0
    assert "prompt v0001 of support still applied by the route" in capsys.readouterr().out
    assert "+p:" not in _chat(r.url, AGENT + " Be warm.")
    _, lines = watch_prompts(str(data), store, w, c)
    assert any("retired" in x and system_id([AGENT + " Be warm."]) in x for x in lines), lines
    assert trials.read(store)[-1]["role"] == "retired" and not trials.applied(trials.read(store))

    # a candidate that drops what the task needs: stopped, the route's prompt route gone
    bad = _candidate(store, BAD)
    trial = trials.start(store, bad, client, 0.3, agent="support")
    later = dt.datetime.fromisoformat(trial["time"]) + dt.timedelta(hours=2)
    _lake(data, later, {"own": (None, 0.9), "cand": (bad.version_id, 0.2)}, 40, "c")
    verdicts, lines = watch_prompts(str(data), store, w, c, checkpoints=str(ckpt))
    assert [v.decision for v in verdicts] == ["worse"], lines
    assert client.get(prompt_name(match)) is None
    assert trials.read(store)[-1]["outcome"] == "stopped"


def test_an_unreadable_trials_record_is_one_sentence_and_starts_nothing(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    (store / "trials.json").write_text("{not json")
    with pytest.raises(trials.TrialError, match=r"trials\.json is not JSON: move it aside"):
        trials.read(str(store))
    (store / "trials.json").write_text(json.dumps({"trials": [{"agent": "a", "role": "party"}]}))
    with pytest.raises(trials.TrialError, match=r"trial entry 0 has no 'match' text"):
        trials.read(str(store))


def test_a_prompt_with_per_request_data_folded_by_alignment_is_matched_through_its_parent_template(
        tmp_path, upstream, route_factory):  # noqa: F811
    """A customer's name in the system prompt is folded by alignment across the lake's
    requests (`{{var_1}}`), which no pattern finds in one request: the route can match
    the agent's requests only with the parent's template (`match_system`, from the
    candidate's parent/prompt.json), here and after promotion. Without it nothing is
    rewritten and the trial measures nothing."""
    r = route_factory(upstream).start()
    store = str(tmp_path / "store")
    client = RouteClient(r.url)
    template = "You are the support agent of Acme. The customer is {{var_1}}. Answer in one sentence."
    better = "You are the support agent of Acme. The customer is {{var_1}}. Look the order up first."
    parent, cand = PromptVersion.of([template], []), PromptVersion.of([better], [])
    prompt_json = json.dumps({"version_id": parent.id, "system": [template], "tools": []})
    candidate = cands.commit(store, "support", {"system.txt": better, "parent/prompt.json": prompt_json}, {
        "kind": "prompt", "model": MODEL,
        "parent": {"ref": "lake", "version_id": parent.id, "system_hash": parent.system_hash, "system": template},
        "candidate": {"version_id": cand.id, "system_hash": cand.system_hash, "system": better,
                      "chars": len(better)}})
    trial = trials.start(store, candidate, client, 1.0, agent="support")
    sent = "You are the support agent of Acme. The customer is Ingrid Larsen. Answer in one sentence."
    assert _chat(r.url, sent).endswith(f"+p:{cand.id}")
    assert trial["match_system"] == [template]
    trials.promote(store, trial, client, [better], "test")
    assert client.get(prompt_name(parent.system_hash))["match_system"] == [template]
    assert _chat(r.url, sent).endswith(f"+p:{cand.id}")
