"""Prompt routes (issue 27, item 4): `nightshift route` puts a candidate system prompt
in a sticky share of one agent's conversations, matched by the id of the prompt the
agent sends, in front of a stand-in upstream (an OpenAI-compatible echo server,
named as such: it answers with what it received, so the test sees every byte the
route sent on). Only the body's leading system messages change; streaming, tools,
errors and the agent's own credentials pass as they came; the candidate's answers
say which prompt the model saw (`+p:<version>` on their `model`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from openai import BadRequestError, OpenAI

from nightshift.route.choose import point
from nightshift.route.mark import StreamMarker, mark_body, tag
from nightshift.route.prompt import Ambiguous, PromptRouter
from nightshift.route.rewrite import edited, read
from nightshift.route.table import TableError, parse
from nightshift.schemas.prompt_identity import canonical_tools, system_id, version_id
from nightshift.schemas.prompt_template import normalize
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)

AGENT = "You are the support agent of Acme. Today is {day}. Answer in one sentence."
AGENT_T = "You are the support agent of Acme. Today is {{date}}. Answer in one sentence."
CANDIDATE = "You are Acme's support agent ({{date}}). Check the order status tool before answering."
OTHER = "You are the billing agent. Be brief."
MATCH, CAND = system_id([AGENT_T]), system_id([CANDIDATE])
SECRET = "sk-agent-own-secret-4242"
TOOLS = [{"type": "function", "function": {"name": "order_status", "description": "the status of an order",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}}]


def _route(share: float = 0.5, **kw):
    return parse(f"prompt:{MATCH}", {"kind": "prompt", "candidate": CAND, "system": CANDIDATE, "share": share,
                                     "agent": "support", "model": "gpt-x", **kw})


# --- the table: a candidate is checked against its id --------------------------------------------


@pytest.mark.parametrize("change,says", [
    ({"system": CANDIDATE + " "}, "hashes to"),
    ({"candidate": "XYZ"}, "12-hex system id"),
    ({"candidate": MATCH, "system": AGENT_T}, "both"),
    ({"share": 1.5}, "share must be"),
    ({"match_system": ["another prompt"]}, "match_system hashes to"),
    ({"surprise": 1}, "unknown field"),
    ({"system": [""]}, "text"),
])
def test_a_bad_prompt_route_is_refused_naming_what_is_wrong(change, says):
    body = {"kind": "prompt", "candidate": CAND, "system": CANDIDATE, "share": 0.5, **change}
    with pytest.raises(TableError, match=says):
        parse(f"prompt:{MATCH}", body)
    with pytest.raises(TableError, match="prompt:<the 12-hex"):
        parse("prompt:nothex", {**body, **change})


# --- the body: only the leading system messages change, byte for byte elsewhere -----------------


def _chat(system: list[str], extra: str = "") -> bytes:
    msgs = "".join('{"role":  "system", "content": %s},\n ' % json.dumps(s, ensure_ascii=False) for s in system)
    return ('{ "model":"gpt-x" , "messages": [%s{"role": "user", "content": "wo ist   meine Bestellung? é"}],'
            '"temperature": 1e400, "tools": %s%s}' % (msgs, json.dumps(TOOLS), extra)).encode()


def _apply(body: bytes, share: float = 1.0, **kw) -> tuple[bytes, str]:
    router, r = PromptRouter(), _route(share, **kw)
    parsed = read(body)
    m = router.find(parsed, {r.serving: r})
    assert m is not None
    return edited(body, router.edits(m, parsed)), router.version(r, parsed)


def test_the_candidate_replaces_the_system_message_with_the_requests_own_data_and_nothing_else():
    body = _chat([AGENT.format(day="2026-11-26")])
    out, vid = _apply(body)
    want = body.replace(json.dumps(AGENT.format(day="2026-11-26")).encode(),
                        json.dumps(CANDIDATE.replace("{{date}}", "2026-11-26")).encode())
    assert out == want  # `1e400`, the spacing and the non-ASCII user text as sent
    assert vid == version_id([CANDIDATE], canonical_tools(TOOLS))


def test_two_leading_system_messages_become_the_candidates_one_and_a_later_system_message_stays():
    two = [AGENT.format(day="2026-11-26"), "Never promise refunds."]
    r = parse(f"prompt:{system_id([AGENT_T, 'Never promise refunds.'])}", {
        "kind": "prompt", "candidate": CAND, "system": CANDIDATE, "share": 1.0})
    body = _chat(two, ', "x": [{"role": "system", "content": "later"}]')
    router, parsed = PromptRouter(), read(body)
    m = router.find(parsed, {r.serving: r})
    got = json.loads(edited(body, router.edits(m, parsed)))
    assert [x["content"] for x in got["messages"]] == [CANDIDATE.replace("{{date}}", "2026-11-26"),
                                                        "wo ist   meine Bestellung? é"]
    assert got["x"] == [{"role": "system", "content": "later"}]


def test_the_responses_api_instructions_are_rewritten():
    body = json.dumps({"model": "gpt-x", "instructions": AGENT.format(day="Nov 26, 2026"), "input": "hi"}).encode()
    out, _ = _apply(body)
    assert json.loads(out) == {"model": "gpt-x", "instructions": CANDIDATE.replace("{{date}}", "Nov 26, 2026"),
                               "input": "hi"}


@pytest.mark.parametrize("body,why", [
    (b'{"model": "gpt-x", "messages": [{"role": "system", "content": [{"type": "text", "text": %s}]}]}'
     % json.dumps(AGENT.format(day="2026-11-26")).encode(), "list of parts"),
    (b'{"model": "gpt-x", "messages": [], "messages": [{"role": "system", "content": %s}]}'
     % json.dumps(AGENT.format(day="2026-11-26")).encode(), "2 top-level `messages`"),
])
def test_an_ambiguous_prompt_is_not_guessed(body, why):
    router, r = PromptRouter(), _route(1.0)
    parsed = read(body)
    if "parts" in why:  # its hash is of the parts' JSON: matched only by a route made for that
        r = parse(f"prompt:{system_id([normalize(json.dumps(parsed.obj['messages'][0]['content'], sort_keys=True, ensure_ascii=False))[0]])}",
                  {"kind": "prompt", "candidate": CAND, "system": CANDIDATE, "share": 1.0})
    m = router.find(parsed, {r.serving: r})
    assert m is not None
    with pytest.raises(Ambiguous, match=why):
        router.edits(m, parsed)


def test_a_prompt_with_a_lone_surrogate_is_hashed_not_a_crash():
    """JSON's "\\ud800" is text Python cannot encode as UTF-8: system_id raised
    UnicodeEncodeError inside the request path (a 500 and a traceback, found by the
    fuzz campaign); it is a prompt like any other, matching no route."""
    router, r = PromptRouter(), _route(1.0)
    assert router.find(read(b'{"model": "m", "messages": [{"role": "system", "content": "a\\ud800"}]}'),
                       {r.serving: r}) is None


def test_other_prompts_and_a_changed_prompt_do_not_match():
    router, r = PromptRouter(), _route(1.0)
    assert router.find(read(_chat([OTHER])), {r.serving: r}) is None
    assert router.find(read(_chat([AGENT.format(day="2026-11-26") + " Be warm."])), {r.serving: r}) is None


# --- the answer's mark ---------------------------------------------------------------------------


def test_the_mark_lands_on_every_streamed_event_however_the_pieces_are_cut():
    events = b"".join(b'data: {"id":"c","model":"gpt-x-2024","choices":[{"delta":{"content":"say \\"model\\": '
                      b'\\"no\\" %d"}}]}\n\n' % i for i in range(5)) + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(events)):
        m = StreamMarker(tag("ab12cd34ef56"))
        out = b"".join(m.feed(events[i:i + size]) for i in range(0, len(events), size)) + m.flush()
        assert out == events.replace(b'"gpt-x-2024"', b'"gpt-x-2024+p:ab12cd34ef56"'), size
        assert m.marked == 5
    assert json.loads(mark_body(b'{"model": "m@v0004", "choices": []}', tag("ab12cd34ef56")))["model"] == \
        "m@v0004+p:ab12cd34ef56"
    assert mark_body(b'{"error": {"message": "x"}}', tag("ab12cd34ef56")) is None


# --- end to end: a real route process in front of a stand-in upstream ----------------------------


class Echo(BaseHTTPRequestHandler):
    """The stand-in upstream (a hosted OpenAI-compatible API's shapes): answers with
    the system prompt it received, streamed or not; `bad` is a 400."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        req = json.loads(raw)
        type(self).seen.append((raw, self.headers))  # case-insensitive, as HTTP is
        if req.get("user") == "bad":
            body = b'{"error": {"message": "bad request", "type": "invalid_request_error", "code": 400}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        system = req["messages"][0]["content"] if req["messages"][0]["role"] == "system" else ""
        model = "gpt-x-2024-11-20"
        msg = {"role": "assistant", "content": system}
        if req.get("tools"):
            msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "order_status", "arguments": json.dumps({"id": system[-12:]})}}]}
        if not req.get("stream"):
            body = json.dumps({"id": "c1", "object": "chat.completion", "created": 1, "model": model, "choices": [
                {"index": 0, "message": msg, "finish_reason": "tool_calls" if req.get("tools") else "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        words = [system[i:i + 9] for i in range(0, len(system), 9)]
        for w in words:
            ev = json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [
                {"index": 0, "delta": {"content": w}, "finish_reason": None}]})
            data = f"data: {ev}\n\n".encode()
            for piece in (data[:17], data[17:]):  # cut inside the event, as TCP may
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
        end = json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}]})
        data = f"data: {end}\n\ndata: [DONE]\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))


@pytest.fixture
def echo():
    Echo.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _messages(conv: int, day: str = "2026-11-26", system: str = AGENT) -> list[dict]:
    return [{"role": "system", "content": system.format(day=day)}, {"role": "user", "content": f"order {conv}?"}]


def test_a_share_of_one_agents_conversations_gets_the_candidate_and_says_so(echo, route_factory):  # noqa: F811
    r = route_factory(echo).start()
    code, bad = r.call("PUT", f"/nightshift/routes/prompt:{MATCH}", {"kind": "prompt", "candidate": CAND,
                                                                     "system": CANDIDATE + "!", "share": 0.5})
    assert code == 400 and "hashes to" in bad["error"]["message"]
    r.put(f"prompt:{MATCH}", kind="prompt", candidate=CAND, system=CANDIDATE, share=0.5, agent="support", model="gpt-x")
    client = OpenAI(base_url=f"{r.url}/v1", api_key=SECRET, max_retries=0)
    seen_vid = version_id([CANDIDATE], [])
    arms = {}
    for conv in range(60):
        day = f"2026-11-{1 + conv % 28:02d}"
        got = []
        for turn in range(2):  # a conversation's calls stay on one prompt
            raw = client.chat.completions.with_raw_response.create(model="gpt-x", messages=_messages(conv, day))
            answer = raw.parse()
            got.append((answer.choices[0].message.content, answer.model, raw.headers.get("x-nightshift-route-prompt")))
        assert got[0] == got[1]
        text, model, header = got[0]
        if text == CANDIDATE.replace("{{date}}", day):
            arms[conv] = "candidate"
            assert model == f"gpt-x-2024-11-20+p:{seen_vid}" and header == seen_vid
        else:
            arms[conv] = "serving"
            assert text == AGENT.format(day=day) and model == "gpt-x-2024-11-20" and header is None
    assert 15 <= list(arms.values()).count("candidate") <= 45
    # what reached the upstream: the agent's own credentials, the rest of the body as sent
    for raw, headers in Echo.seen:
        assert headers["Authorization"] == f"Bearer {SECRET}"
    # another agent's prompt (and another prompt of any agent) passes byte for byte
    before = len(Echo.seen)
    body = json.dumps({"model": "gpt-x", "messages": _messages(1, system=OTHER)}).encode()
    req = urllib.request.Request(f"{r.url}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"})
    assert json.loads(urllib.request.urlopen(req, timeout=10).read())["model"] == "gpt-x-2024-11-20"
    assert Echo.seen[before][0] == body
    # streamed and with tools: the same prompt per conversation, every chunk marked
    cand = next(c for c, a in arms.items() if a == "candidate")
    day = f"2026-11-{1 + cand % 28:02d}"
    chunks = list(client.chat.completions.create(model="gpt-x", messages=_messages(cand, day), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        CANDIDATE.replace("{{date}}", day)
    assert {c.model for c in chunks} == {f"gpt-x-2024-11-20+p:{seen_vid}"}
    tooled = client.chat.completions.create(model="gpt-x", messages=_messages(cand, day), tools=TOOLS)
    assert tooled.choices[0].message.tool_calls[0].function.name == "order_status"
    assert tooled.model == f"gpt-x-2024-11-20+p:{version_id([CANDIDATE], canonical_tools(TOOLS))}"
    # an upstream error reaches the client as it came, unmarked
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="gpt-x", messages=_messages(cand, day), user="bad")
    assert e.value.body == {"message": "bad request", "type": "invalid_request_error", "code": 400}
    # the agent changes its own prompt: nothing is rewritten, and the log says so once
    for conv in range(4):
        changed = client.chat.completions.create(model="gpt-x", messages=_messages(conv, system=AGENT + " Be warm."))
        assert changed.choices[0].message.content == (AGENT + " Be warm.").format(day="2026-11-26")
        assert "+p:" not in changed.model
    _, doc = r.call("GET", "/nightshift/routes")
    seen = doc["prompts"][f"prompt:{MATCH}"]
    assert seen["changed"] == system_id([(AGENT_T + " Be warm.")]) and seen["rewritten"] >= 30
    assert r.log().count("it does not match; if the agent changed its own prompt") == 1
    # a body that cannot be rewritten without guessing passes unchanged, counted, logged once
    key = next(k for k in map(str, range(1000)) if point(k, CAND) < 0.5)  # a conversation on the candidate
    twice = json.dumps({"model": "gpt-x", "messages": []})[:-1].encode() + b', "messages": ' + json.dumps(
        _messages(7)).encode() + b"}"
    for _ in range(2):
        before = len(Echo.seen)
        req = urllib.request.Request(f"{r.url}/v1/chat/completions", data=twice, headers={
            "Content-Type": "application/json", "X-Nightshift-Route-Key": key})
        assert json.loads(urllib.request.urlopen(req, timeout=10).read())["model"] == "gpt-x-2024-11-20"
        assert Echo.seen[before][0] == twice
    assert r.metric("nightshift_route_prompt_skipped_total", route=f"prompt:{MATCH}") == 2
    assert r.log().count("a matched request passes through unchanged: the body has 2 top-level `messages`") == 1
    # a malformed Authorization (a stray control character) is refused by the HTTP parser, whose message quoted
    # the header whole into the log: now the reason and the header's name only
    for bad in (b"Bearer " + SECRET.encode() + b"\x01", b"Bearer " + SECRET.encode() + b"x" * 9000):
        with socket.create_connection(("127.0.0.1", r.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: " + bad +
                         b"\r\nContent-Length: 2\r\n\r\n{}")
            assert b" 400 " in sock.recv(100)
    deadline = time.time() + 10
    while r.log().count("refused a malformed request") < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert "in the Authorization header; what was sent is not logged" in r.log()
    # the agent's key is in no log line and not in the route table's file
    assert SECRET not in r.log() and SECRET not in r.state.read_text()
    assert r.metric("nightshift_route_prompt_decisions_total", route=f"prompt:{MATCH}", arm="candidate") > 0
    # the CLI: a stored candidate's folder put on the route, shown, and a folder that is none refused
    folder = r.state.parent / "store" / "support" / "v0001"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"parent": {"system_hash": MATCH}, "model": "gpt-x", "candidate": {
        "system_hash": CAND, "system": CANDIDATE}}))
    (folder / "parent").mkdir()
    (folder / "parent" / "prompt.json").write_text(json.dumps({"version_id": "x", "system": [AGENT_T], "tools": []}))
    cli = [sys.executable, "-m", "nightshift.cli.route_cmd", "route"]
    done = subprocess.run([*cli, "prompt", "--from", str(folder), "--share", "0", "--url", r.url], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and f"prompt:{MATCH} (agent support): candidate {CAND} at 0 %" in done.stdout, done
    assert r.call("GET", f"/nightshift/routes/prompt:{MATCH}")[1]["route"]["match_system"] == [AGENT_T]
    shown = subprocess.run([*cli, "show", "--url", r.url], capture_output=True, text=True, timeout=60)
    assert f"prompt:{MATCH} (agent support): candidate {CAND} at 0 %" in shown.stdout
    assert f"the agent now sends prompt {system_id([AGENT_T + ' Be warm.'])}: the trial no longer applies" in shown.stdout
    bad = subprocess.run([*cli, "prompt", "--from", str(folder.parent), "--share", "0", "--url", r.url],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not a stored prompt candidate" in bad.stderr and "Traceback" not in bad.stderr


def test_a_stream_whose_events_name_other_models_is_marked_once_each():
    events = (b'data: {"model": "a", "x": {"model": {"type": "string"}}}\n\n'
              b'data: {"model":"a"}\n\ndata: {"model": "b"}\n\ndata: {"model": "a"}\n\n')
    m = StreamMarker(tag("ab12cd34ef56"))
    out = m.feed(events[:30]) + m.feed(events[30:]) + m.flush()
    assert out == events.replace(b'"a"', b'"a+p:ab12cd34ef56"').replace(b'"b"', b'"b+p:ab12cd34ef56"')


def test_the_responses_api_input_messages_and_stream_events_are_handled():
    body = json.dumps({"model": "gpt-x", "input": [{"role": "developer", "content": AGENT.format(day="2026-11-26")},
                                                    {"role": "user", "content": "hi"}]}).encode()
    out, _ = _apply(body)
    assert json.loads(out)["input"][0] == {"role": "developer", "content": CANDIDATE.replace("{{date}}", "2026-11-26")}
    stream = (b'event: response.created\ndata: {"type":"response.created","response":{"id":"r1","instructions":'
              b'"say \\"model\\": \\"x\\"","model":"gpt-x-2024","output":[]}}\n\n'
              b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n')
    m = StreamMarker(tag("ab12cd34ef56"))
    out = m.feed(stream[:50]) + m.feed(stream[50:]) + m.flush()
    assert out == stream.replace(b'"gpt-x-2024"', b'"gpt-x-2024+p:ab12cd34ef56"') and m.marked == 1


def test_a_template_with_alignment_slots_matches_each_rendering_and_fills_the_candidate():
    """`nightshift prompts` folds names and the like into {{var}} slots by aligning the
    agent's prompts; the route gets that template in `match_system` and recognises one
    request's rendering of it by its literal text."""
    templ = "You help {{var}} with their orders. Today is {{date}}. Be brief."
    cand = "You help {{var}} with their orders ({{date}}). Look the order up first."
    r = parse(f"prompt:{system_id([templ])}", {"kind": "prompt", "candidate": system_id([cand]), "system": cand,
                                                "share": 1.0, "match_system": [templ]})
    router = PromptRouter()
    for name in ("Alice", "Bob Stone"):
        body = _chat([f"You help {name} with their orders. Today is 2026-11-26. Be brief."])
        parsed = read(body)
        m = router.find(parsed, {r.serving: r})
        assert m is not None, name
        got = json.loads(edited(body, router.edits(m, parsed)))
        assert got["messages"][0]["content"] == f"You help {name} with their orders (2026-11-26). Look the order up first."
    assert router.find(read(_chat(["You help Alice with refunds. Today is 2026-11-26. Be brief."])),
                       {r.serving: r}) is None


def test_the_fold_cache_is_bounded_in_entries_and_size():
    """Agents whose prompt embeds per-request data send a new text every time; long
    ones (a pasted document) are not kept at all, so the cache stays under 16 M
    characters whatever agents send (it held 4,096 texts of any length before)."""
    from nightshift.route import prompt as P

    router, r = PromptRouter(), _route(1.0)
    for i in range(P.CACHE + 50):
        router.find(read(_chat([f"Prompt number {i} " + "x" * (200 if i % 2 else P.CACHE_CHARS + 1)])), {r.serving: r})
    assert len(router.folded) <= P.CACHE
    assert all(sum(map(len, k)) <= P.CACHE_CHARS for k in router.folded)


def test_prompts_that_cannot_match_are_not_folded():
    """Folding is the costly part of matching (a 100 KB prompt full of numbers took
    190 ms, on the request path): a prompt without the route's template text in it, or
    far longer than any route's, is passed over before it."""
    from nightshift.route import prompt as P

    r = _route(1.0, match_system=[AGENT_T])
    router, routes = PromptRouter(), {r.serving: r}
    dense = " ".join(f"order {i} on 2026-11-{i % 28 + 1:02d} at 10:{i % 60:02d}" for i in range(3000))
    assert router.find(read(_chat([dense])), routes) is None and not router.folded
    assert router.find(read(_chat([AGENT.format(day="2026-11-26") + " " + "x" * P.MATCH_CHARS])), routes) is None
    assert not router.folded
    assert router.find(read(_chat([AGENT.format(day="2026-11-26")])), routes) is not None and len(router.folded) == 1
    blind = _route(1.0)  # no template given: every prompt up to MATCH_CHARS is folded to be told
    assert PromptRouter().find(read(_chat([AGENT.format(day="2026-11-26")])), {blind.serving: blind}) is not None


def test_a_long_prompt_full_of_numbers_folds_as_a_full_pass_does():
    """The fold on the request path is linear now (whitespace found once, slot names
    counted on): it must name and fold exactly what a plain pass of the patterns does,
    on a long prompt with no newline and thousands of values."""
    from nightshift.schemas import prompt_template as T

    text = " ".join(f"order {i} of 2026-11-{i % 28 + 1:02d} at 10:{i % 60:02d} id {1000000 + i}" for i in range(600))
    used, values = set(), {}

    def repl(m):
        name, n = m.lastgroup, 1
        while name in used:
            n += 1
            name = f"{m.lastgroup}_{n}"
        used.add(name)
        values[name] = m.group(0)
        return "{{" + name + "}}"

    assert T.normalize(text) == (T._KIND_RE.sub(repl, text), values)
