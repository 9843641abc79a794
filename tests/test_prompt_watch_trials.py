"""The prompt watch counts exactly a trial's candidate calls, by the id the trial gave
the route (issue 27 item 5): the route marks a rewritten answer with the version it
APPLIED (the trial's `version_id`), not one recomputed from the request, so marks
and trials join by construction. Agents whose spans record no tools (openai-v2, the
agent world's) while their requests carry them, two trials of two agents sharing
nothing, and a prompt already promoted on another of one agent's prompts: each
trial's arms are what the upstream received, not another agent's calls, not the
promoted prompt's, not the other arm's.

A real `nightshift route` process in front of a stand-in upstream (named as such),
a real transitions lake, `watch_prompts` as `nightshift watch` runs it (dry run)."""

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

from nightshift.judge.prompt_watch import watch_prompts
from nightshift.judge.watch import WatchSettings
from nightshift.prompts import store as cands
from nightshift.publish import prompt_canary as trials
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient, RouteError, prompt_name
from nightshift.schemas import transitions
from nightshift.schemas.prompt_identity import PromptVersion
from nightshift.transform.attribution import unmark

MODEL = "gpt-x"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look an order up.",
                                           "parameters": {"type": "object", "properties": {}}}}]
PLAN = "You plan the support agent's next step. Be brief."
PLAN_C = "You plan the support agent's next step. Look the order up first. Be brief."
SUMMARY = "You summarize a finished support conversation in one line."
SUMMARY_C = "You summarize a finished support conversation in one line, naming the order."
WRITE = "You write the reply a customer reads, politely."
WRITE_C = "You write the reply a customer reads, politely, and sign it Acme."


class Upstream(BaseHTTPRequestHandler):
    """A STAND-IN for a hosted OpenAI-compatible API: answers with the system prompt it
    received as the content, so the test knows what the model saw."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["tools"] == TOOLS  # the agent's tools reach the model, whatever its spans record
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


def _candidate(store: str, agent: str, parent: str, text: str) -> cands.Candidate:
    """Named as the lake names them: the agent's spans record no tools."""
    p, c = PromptVersion.of([parent], []), PromptVersion.of([text], [])
    return cands.commit(store, agent, {"system.txt": text}, {
        "kind": "prompt", "model": MODEL,
        "parent": {"ref": "lake", "version_id": p.id, "system_hash": p.system_hash, "system": parent},
        "candidate": {"version_id": c.id, "system_hash": c.system_hash, "system": text, "chars": len(text)}})


def _chat(route_url: str, system: str, user: str) -> tuple[str, str]:
    """(the prompt the model saw, the answer's model) of one call with tools."""
    body = json.dumps({"model": MODEL, "tools": TOOLS, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()
    req = urllib.request.Request(f"{route_url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
    return answer["choices"][0]["message"]["content"], answer["model"]


def test_each_trial_counts_exactly_its_candidates_calls(tmp_path, upstream, route_factory):  # noqa: F811
    r = route_factory(upstream).start()
    data, store = tmp_path / "data", str(tmp_path / "store")
    client = RouteClient(r.url)
    # the planner's summary prompt was tried and promoted earlier: the route applies it to every call
    earlier = trials.start(store, _candidate(store, "planner", SUMMARY, SUMMARY_C), client, 0.5, agent="planner")
    trials.promote(store, earlier, client, SUMMARY_C, "shown better")
    plan = trials.start(store, _candidate(store, "planner", PLAN, PLAN_C), client, 0.5, agent="planner")
    write = trials.start(store, _candidate(store, "writer", WRITE, WRITE_C), client, 0.5, agent="writer")

    rewarded = {PLAN: 0.0, PLAN_C: 1.0, SUMMARY_C: 0.5, WRITE: 0.25, WRITE_C: 0.75}  # the prompt the model saw
    rows, saw = [], []
    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=5)
    for i in range(16):
        for agent, system in (("planner", PLAN), ("planner", SUMMARY), ("writer", WRITE)):
            seen, model = _chat(r.url, system, f"order {i}: {agent} {system[:12]}")
            answered, mark = unmark(model)
            assert answered == "gpt-x-2024-11-20"
            when += dt.timedelta(seconds=7)
            x = row([msg("system", system), msg("user", f"order {i}")], "ok", rewarded[seen],
                    trajectory=f"{agent}-{system[:8]}-{i}", agent=agent, model=MODEL, when=when)  # no tools recorded
            x["prompt_seen"] = mark
            rows.append(x)
            saw.append((agent, seen, when))
    folder = data / "transitions" / f"date={when.date().isoformat()}"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=transitions.SCHEMA), folder / "part-0.parquet")

    verdicts, _ = watch_prompts(str(data), store, WatchSettings(min_trajectories=1), CanarySettings(max_hours=72),
                                act=False)
    got = {v.candidate: v for v in verdicts}
    for trial, own, cand in ((plan, PLAN, PLAN_C), (write, WRITE, WRITE_C)):
        first = min(t for a, s, t in saw if a == trial["agent"] and s == cand)
        want_cand = sum(a == trial["agent"] and s == cand for a, s, _ in saw)
        want_base = sum(a == trial["agent"] and s == own and t >= first for a, s, t in saw)
        v = got[f"prompt {trial['version']}"]
        assert 3 <= want_cand <= 13 and want_base >= 3  # both arms exist: the share split the conversations
        # before the fix the planner's arm also held every promoted summary call (its marks were the only
        # ones after the trial's start carrying no exact id): 16 more, and a mean below 1
        assert (v.n_candidate, v.n_baseline) == (want_cand, want_base), trial["agent"]
        assert v.diff == pytest.approx(rewarded[cand] - rewarded[own])  # no other prompt's reward in either arm


def test_the_route_marks_what_it_applied_and_refuses_a_malformed_version(tmp_path, upstream, route_factory):  # noqa: F811
    r = route_factory(upstream).start()
    client = RouteClient(r.url)
    c = PromptVersion.of([WRITE_C], [])
    with pytest.raises(RouteError, match="version must be the 12-hex id"):
        client.set_prompt(PromptVersion.of([WRITE], []).system_hash, c.system_hash, WRITE_C, 1.0, version="v0001")
    client.set_prompt(PromptVersion.of([WRITE], []).system_hash, c.system_hash, WRITE_C, 1.0, version="ab" * 6)
    assert client.get(prompt_name(PromptVersion.of([WRITE], []).system_hash))["version"] == "ab" * 6
    seen, model = _chat(r.url, WRITE, "hello")
    assert (seen, model) == (WRITE_C, "gpt-x-2024-11-20+p:" + "ab" * 6)
