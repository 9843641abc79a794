"""`nightshift route` as a real process on free loopback ports, in front of the real
`nightshift serve` stand-in (the openai client, stream and not, tools, sticky
versions, a lost adapter) or of a scripted upstream for what a real server does
only when it fails (errors, a connection dropped mid-stream)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai import APIStatusError, OpenAI

from conftest import free_port
from nightshift.route.choose import choose, point, sticky_key
from nightshift.route.client import RouteClient, RouteError
from nightshift.route.table import Route, TableError, parse
from transitions_data import CALC_TOOL

Q = [{"role": "user", "content": "What is 12 * 7?"}]
TOKEN = "s3cret"


@dataclass
class RouteProcess:
    upstream: str
    state: Path
    log_path: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RouteProcess":
        cmd = [sys.executable, "-m", "nightshift.cli.route_cmd", "route", "--listen", f"127.0.0.1:{self.port}",
               "--upstream", self.upstream, "--state", str(self.state), "--drain-timeout", "2", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))
        deadline = time.time() + 30
        while time.time() < deadline:
            assert self.proc.poll() is None, f"route exited {self.proc.returncode}:\n{self.log()}"
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1)
                return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(self.log())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            return self.proc.wait(20)
        return self.proc.returncode if self.proc else 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def call(self, method: str, path: str, body=None, token: str = "", raw: bytes | None = None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def put(self, name: str, token: str = "", **route) -> dict:
        code, body = self.call("PUT", f"/nightshift/routes/{name}", route, token)
        assert code == 200, body
        return body

    def metric(self, name: str, **labels) -> float:
        want = [f'{k}="{v}"' for k, v in labels.items()]
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name) and all(w in line for w in want):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
def route_factory(tmp_path, request):
    started: list[RouteProcess] = []

    def make(upstream: str, state: Path | None = None, extra: list[str] | None = None) -> RouteProcess:
        r = RouteProcess(upstream, state or tmp_path / "routes.json", tmp_path / f"route-{len(started)}.log",
                         extra or [])
        started.append(r)
        return r

    yield make
    for r in started:
        if r.proc and r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait(10)
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for r in started:
            print(f"--- route log {r.log_path} ---\n{r.log()[-6000:]}")


# --- a scripted upstream for the failures a real server shows only when it fails ---------------


class Scripted(BaseHTTPRequestHandler):
    """vLLM's shapes: models in `known` answer (stream or not); others 404 "does not
    exist". `error-*` answers a 400 with a header of its own; `break` streams two
    chunks and drops the connection; `paced` streams 6 chunks 50 ms apart, `slow` 200."""

    protocol_version = "HTTP/1.1"
    known = {"agent@v0001", "agent@v0002", "tiny"}
    seen: list = []
    cut: list = []

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, headers: dict) -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        req = json.loads(raw)
        model = req["model"]
        type(self).seen.append((model, self.headers, req))  # case-insensitive, as HTTP is
        if model.startswith("error-"):
            return self._send(400, b'{"error": {"message": "max_tokens is too large: 99999", "type": '
                              b'"BadRequestError", "param": "max_tokens", "code": 400}}',
                              {"Content-Type": "application/json", "X-Request-Id": "req-42"})
        if model not in self.known and not model.startswith(("break", "slow", "paced")):
            return self._send(404, json.dumps({"error": {"message": f"The model `{model}` does not exist.", "type":
                              "NotFoundError", "param": "model", "code": 404}}).encode(),
                              {"Content-Type": "application/json"})
        head = {"id": "chatcmpl-1", "created": 1, "model": model}
        if not req.get("stream"):
            return self._send(200, json.dumps({**head, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": "fine"}, "finish_reason": "stop"}]}).encode(),
                {"Content-Type": "application/json"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = {"slow": 200, "break": 2, "paced": 6}.get(model.split("@")[0], 3)
        for i in range(n):
            ev = json.dumps({**head, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": f"part{i} "}, "finish_reason": None}]})
            data = f"data: {ev}\n\n".encode()
            try:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            except OSError:  # the proxy closed the request: a real server stops generating here
                type(self).cut.append(model)
                return
            time.sleep(0.05 if n != 3 else 0)
        if model.startswith("break"):  # the server dies mid-answer: no last chunk, no [DONE]
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        done = b'data: {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "%s", ' \
               b'"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n' % model.encode()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


@pytest.fixture
def scripted():
    Scripted.seen, Scripted.cut = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _client(r: RouteProcess, **kw) -> OpenAI:
    return OpenAI(base_url=f"{r.url}/v1", api_key="client-key", max_retries=0, **kw)


# --- pure functions ------------------------------------------------------------------------------


def test_the_sticky_key_prefers_the_header_then_the_trace_then_the_conversation():
    conv = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    grown = {"messages": conv["messages"] + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert sticky_key({"X-Nightshift-Route-Key": "c-1", "traceparent": tp}, conv) == ("header", "c-1")
    assert sticky_key({"traceparent": tp}, conv) == ("trace", "4bf92f3577b34da6a3ce929d0e0e4736")
    assert sticky_key({"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"}, conv)[0] == "conversation"
    assert sticky_key({}, conv) == sticky_key({}, grown)  # the history grows, the key stays
    assert sticky_key({}, conv) != sticky_key({}, {**conv, "user": "someone else"})
    assert sticky_key({}, {"messages": []})[0] == "random"


def test_raising_the_share_keeps_the_conversations_already_on_the_candidate():
    keys = [f"conv-{i}" for i in range(2000)]
    small, big = Route("a@v1", "a@v2", 0.1), Route("a@v1", "a@v2", 0.5)
    on_small = {k for k in keys if choose(small, k)[0] == "a@v2"}
    on_big = {k for k in keys if choose(big, k)[0] == "a@v2"}
    assert on_small <= on_big and 1300 < 2 * len(on_big) < 2700
    # another candidate draws other conversations: not the same unlucky tenth every night
    other = {k for k in keys if point(k, "a@v3") < 0.1}
    assert len(other & on_small) < 0.5 * len(on_small)


@pytest.mark.parametrize("body, says", [
    ({"serving": "a@v1", "candidate": "a@v2", "share": 1.5}, "share must be a number in [0, 1], got 1.5"),
    ({"serving": "a@v1", "candidate": "a@v2", "share": float("nan")}, "got nan"),
    ({"serving": "a@v1", "candidate": "a@v2", "share": True}, "share must be a number"),
    ({"serving": "a@v1", "candidate": "a@v2"}, "share is missing"),
    ({"serving": "a@v1", "share": 0.2}, "without a candidate"),
    ({"serving": "", "candidate": "a@v2", "share": 0.2}, "serving must be a model name"),
    ({"serving": "a@v1", "candidate": "a@v1", "share": 0.2}, "candidate and serving are both"),
    ({"serving": "a@v1", "weight": 0.2}, "unknown field(s) 'weight'"),
    (["a@v1"], "must be a JSON object"),
])
def test_bad_routes_are_refused_with_what_is_wrong(body, says):
    with pytest.raises(TableError) as e:
        parse("agent", body)
    assert says in str(e.value)


# --- the control API -----------------------------------------------------------------------------


def test_routes_persist_across_restarts_and_the_token_guards_the_control_api(scripted, route_factory, tmp_path):
    r = route_factory(scripted, extra=["--admin-token", TOKEN]).start()
    body = {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.25}
    code, answer = r.call("PUT", "/nightshift/routes/agent", body)
    assert code == 401 and "admin token" in answer["error"]["message"]
    assert r.call("GET", "/nightshift/routes", token="wrong")[0] == 401
    answer = r.put("agent", TOKEN, **body)
    assert answer["previous"] is None and answer["route"]["share"] == 0.25
    # written (and fsync'd) before the 200: the file says so now
    assert json.loads((tmp_path / "routes.json").read_text())["routes"]["agent"]["candidate"] == "agent@v0002"
    assert r.metric("nightshift_route_candidate_share", route="agent", candidate="agent@v0002") == 0.25
    assert r.stop() == 0
    r2 = route_factory(scripted, extra=["--admin-token", TOKEN]).start()
    code, doc = r2.call("GET", "/nightshift/routes", token=TOKEN)
    assert code == 200 and [(x["name"], x["serving"], x["candidate"], x["share"]) for x in doc["routes"]] == \
        [("agent", "agent@v0001", "agent@v0002", 0.25)]
    # promote: the candidate takes all traffic
    answer = r2.put("agent", TOKEN, serving="agent@v0002")
    assert answer["previous"]["candidate"] == "agent@v0002" and answer["route"]["candidate"] is None
    assert r2.call("GET", "/nightshift/routes/agent", token=TOKEN)[1]["route"]["serving"] == "agent@v0002"
    assert r2.call("DELETE", "/nightshift/routes/agent", token=TOKEN)[0] == 200
    assert r2.call("DELETE", "/nightshift/routes/agent", token=TOKEN)[0] == 404
    assert "route agent: agent@v0001, candidate agent@v0002 at 25 %" in r.log()
    assert "route agent: all to agent@v0002 (was: agent@v0001, candidate agent@v0002 at 25 %)" in r2.log()


@pytest.mark.parametrize("raw, says", [
    (b'{"serving": "a@v1", "candidate": "a@v2", "share": 1.5}', "share must be a number in [0, 1], got 1.5"),
    (b'{"serving": "a@v1", "candidate": "a@v2", "share": NaN}', "got nan"),
    (b'{"serving": "a@v1", "candidate": "a@v2", "share": 0.1, "note": "x"}', "unknown field(s) 'note'"),
    (b'serving=a@v1', "the body is not JSON"),
])
def test_bad_admin_input_is_a_400_that_says_why_and_changes_nothing(scripted, route_factory, raw, says):
    r = route_factory(scripted).start()
    r.put("agent", serving="agent@v0001")
    code, answer = r.call("PUT", "/nightshift/routes/agent", raw=raw)
    assert code == 400 and says in answer["error"]["message"], answer
    assert r.call("GET", "/nightshift/routes/agent")[1]["route"]["candidate"] is None


def test_the_cli_sets_shows_and_deletes_routes(scripted, route_factory):
    r = route_factory(scripted, extra=["--admin-token", TOKEN]).start()

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "nightshift.cli.route_cmd", "route", *args, "--url", r.url],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "NIGHTSHIFT_ROUTE_ADMIN_TOKEN": TOKEN})

    p = cli("set", "agent", "--serving", "agent@v0001", "--candidate", "agent@v0002", "--share", "0.1")
    assert p.returncode == 0 and p.stdout.strip() == "agent: agent@v0001, candidate agent@v0002 at 10 %", p.stderr
    assert cli("show").stdout.strip() == "agent: agent@v0001, candidate agent@v0002 at 10 %"
    # what the nightly job calls
    assert RouteClient(r.url, TOKEN).get("agent")["share"] == 0.1 and RouteClient(r.url, TOKEN).get("nope") is None
    with pytest.raises(RouteError, match="admin token"):
        RouteClient(r.url).routes()
    bad = cli("set", "agent", "--serving", "agent@v0001", "--candidate", "agent@v0002", "--share", "2")
    assert bad.returncode == 1 and "share must be a number in [0, 1], got 2.0" in bad.stderr
    assert cli("delete", "agent").returncode == 0
    assert "no routes" in cli("show").stdout


# --- the request path, against a scripted upstream ----------------------------------------------


def test_a_share_lands_near_its_target_and_each_conversation_stays_on_one_version(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="agent@v0001", candidate="agent@v0002", share=0.3)
    client = _client(r)
    n, on_candidate = 400, 0
    for i in range(n):
        history = [{"role": "system", "content": "You help."}, {"role": "user", "content": f"task {i}"}]
        first = client.chat.completions.with_raw_response.create(model="agent", messages=history)
        version = first.headers["x-nightshift-route"]
        assert first.parse().model == version  # the upstream answered for the version chosen
        on_candidate += version == "agent@v0002"
        if i % 20 == 0:  # later calls of the same conversation: the history only grows
            history += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "and then?"}]
            for _ in range(2):
                assert client.chat.completions.create(model="agent", messages=history).model == version
    # 400 conversations at 30 %: mean 120, sd 9.2; outside 120 +- 46 (5 sd) is a broken choice
    assert 74 <= on_candidate <= 166, on_candidate
    assert r.metric("nightshift_route_decisions_total", route="agent", arm="candidate", key="conversation") \
        >= on_candidate
    # one trace, one version, whatever the messages
    tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    versions = {client.chat.completions.create(model="agent", messages=[{"role": "user", "content": f"q{i}"}],
                                               extra_headers={"traceparent": tp}).model for i in range(12)}
    assert len(versions) == 1
    # only `model` was rewritten; the client's Authorization went through unchanged
    model, headers, req = Scripted.seen[-1]
    assert model in ("agent@v0001", "agent@v0002") and headers["Authorization"] == "Bearer client-key"
    assert req["messages"] == [{"role": "user", "content": "q11"}]


def test_unrouted_models_and_paths_pass_through_untouched(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="agent@v0001")
    raw = _client(r).chat.completions.with_raw_response.create(model="agent@v0002", messages=Q)
    assert raw.parse().model == "agent@v0002" and "x-nightshift-route" not in raw.headers
    assert r.metric("nightshift_route_decisions_total") == 0
    # GET paths the scripted upstream does not have: its own 501, not the proxy's
    code = urllib.request.Request(f"{r.url}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(code, timeout=10)
    assert e.value.code == 501


def test_upstream_errors_reach_the_client_verbatim(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="error-v1")
    body = json.dumps({"model": "agent", "messages": Q, "max_tokens": 99999}).encode()
    req = urllib.request.Request(f"{r.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and e.value.headers["X-Request-Id"] == "req-42"
    assert e.value.read() == (b'{"error": {"message": "max_tokens is too large: 99999", "type": "BadRequestError", '
                              b'"param": "max_tokens", "code": 400}}')
    assert r.metric("nightshift_route_requests_total", route="agent", version="error-v1", status="400") == 1
    # an upstream that is not there: a 502 an OpenAI client retries, saying which upstream
    down = route_factory(f"http://127.0.0.1:{free_port()}", state=r.state.with_name("down.json")).start()
    with pytest.raises(APIStatusError) as e:
        _client(down).chat.completions.create(model="tiny", messages=Q)
    assert e.value.status_code == 502 and "is unreachable" in e.value.message


def test_missing_versions_fall_back_to_serving_then_to_the_stable_name(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="agent@v0001", candidate="agent@v0009", share=1.0)
    client = _client(r)
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="agent", messages=Q)
        assert raw.parse().model == "agent@v0001" and raw.headers["x-nightshift-route-fallback"] == "agent@v0009"
    # the upstream was asked for the missing version once; then it was remembered
    assert [m for m, _, _ in Scripted.seen].count("agent@v0009") == 1
    assert r.metric("nightshift_route_fallbacks_total", route="agent", missing="agent@v0009", to="agent@v0001") == 3
    assert "does not have agent@v0009" in r.log()
    assert r.call("GET", "/nightshift/routes")[1]["missing"].keys() == {"agent@v0009"}
    # both versions gone: the stable name itself (here the upstream does not have it either: its 404, verbatim)
    Scripted.known = {"agent"}
    try:
        r.put("other", serving="other@v0001", candidate="other@v0002", share=1.0)
        with pytest.raises(APIStatusError) as e:
            client.chat.completions.create(model="other", messages=Q)
        assert e.value.status_code == 404 and "The model `other` does not exist." in e.value.message
        r.put("agent", serving="agent@v0003", candidate="agent@v0004", share=0.5)
        raw = client.chat.completions.with_raw_response.create(model="agent", messages=Q)
        assert raw.parse().model == "agent" and raw.headers["x-nightshift-route"] == "agent"
    finally:
        Scripted.known = {"agent@v0001", "agent@v0002", "tiny"}


def test_an_upstream_that_dies_mid_stream_is_an_error_for_the_client_not_a_short_answer(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="break@v1")
    got = []
    with pytest.raises(Exception) as e:  # noqa: PT011 - httpx's or openai's: what matters is that it raises
        for chunk in _client(r).chat.completions.create(model="agent", messages=Q, stream=True):
            got.append(chunk.choices[0].delta.content)
    assert got == ["part0 ", "part1 "], (got, e.value)
    assert r.metric("nightshift_route_stream_aborts_total", by="upstream") == 1
    # on the wire: the chunks that came, and no ending
    s = socket.create_connection(("127.0.0.1", r.port))
    body = json.dumps({"model": "agent", "messages": Q, "stream": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    wire = b""
    while chunk := s.recv(65536):
        wire += chunk
    assert b"part1" in wire and not wire.endswith(b"0\r\n\r\n") and b"[DONE]" not in wire


def test_a_proxy_killed_mid_stream_is_an_error_for_the_client(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="slow@v1")
    stream = _client(r, timeout=20).chat.completions.create(model="agent", messages=Q, stream=True)
    got = []
    with pytest.raises(Exception):  # noqa: B017,PT011 - any error, never a clean end
        for chunk in stream:
            got.append(chunk.choices[0].delta.content)
            if len(got) == 3:
                r.stop(signal.SIGKILL)
    assert 3 <= len(got) < 200


def test_a_client_that_hangs_up_mid_stream_closes_its_upstream_request(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="slow@v1")
    with _client(r).chat.completions.create(model="agent", messages=Q, stream=True) as stream:
        assert next(iter(stream)).choices[0].delta.content == "part0 "
    deadline = time.time() + 10
    while not Scripted.cut and time.time() < deadline:  # 200 chunks 50 ms apart: 10 s if nobody closes it
        time.sleep(0.1)
    assert Scripted.cut == ["slow@v1"]
    assert r.metric("nightshift_route_stream_aborts_total", by="client") == 1
    assert "the client went away inside a streamed answer from slow@v1" in r.log()


def test_sigterm_lets_a_short_answer_finish_and_exits_0(scripted, route_factory):
    r = route_factory(scripted).start()
    r.put("agent", serving="paced@v1")
    stream = iter(_client(r).chat.completions.create(model="agent", messages=Q, stream=True))
    first = next(stream)
    r.proc.send_signal(signal.SIGTERM)
    rest = [c.choices[0].delta.content for c in stream if c.choices]
    assert first.choices[0].delta.content == "part0 " and rest == [f"part{i} " for i in range(1, 6)] + [None]
    assert r.proc.wait(20) == 0


# --- in front of the real stand-in ---------------------------------------------------------------


def test_the_openai_client_through_the_proxy_in_front_of_nightshift_serve(serve_factory, tool_adapter,
                                                                          route_factory):
    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    for name in ("agent@v0001", "agent@v0002"):
        req = urllib.request.Request(f"{s.url}/v1/load_lora_adapter", data=json.dumps(
            {"lora_name": name, "lora_path": str(tool_adapter)}).encode(), headers={"Content-Type": "application/json"})
        assert urllib.request.urlopen(req, timeout=60).status == 200
    r = route_factory(s.url).start()
    r.put("agent", serving="agent@v0001", candidate="agent@v0002", share=0.5)
    client = _client(r)
    # non-stream, with tools: the adapter's tool call, answered under the version chosen
    raw = client.chat.completions.with_raw_response.create(model="agent", messages=Q, tools=CALC_TOOL, max_tokens=40,
                                                           temperature=0)
    full = raw.parse()
    version = raw.headers["x-nightshift-route"]
    assert full.model == version and version in ("agent@v0001", "agent@v0002")
    call = full.choices[0].message.tool_calls[0]
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12*7"}
    # streamed: the same answer, chunk by chunk, the same version (same conversation)
    chunks = list(client.chat.completions.create(model="agent", messages=Q, tools=CALC_TOOL, max_tokens=40,
                                                 temperature=0, stream=True))
    assert {c.model for c in chunks} == {version}
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "calculator" and json.loads(calls[0].function.arguments) == {"expression": "12*7"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # the base model and /v1/models pass through untouched
    assert client.chat.completions.create(model="tiny", messages=Q, max_tokens=3).model == "tiny"
    assert {m.id for m in client.models.list()} == set(s.models())
    # the server loses the candidate: its share falls back to the serving version, and says so
    unload = urllib.request.Request(f"{s.url}/v1/unload_lora_adapter", data=b'{"lora_name": "agent@v0002"}',
                                    headers={"Content-Type": "application/json"})
    assert urllib.request.urlopen(unload, timeout=60).status == 200
    r.put("agent", serving="agent@v0001", candidate="agent@v0002", share=1.0)
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model="agent", messages=Q, max_tokens=3)
        assert raw.parse().model == "agent@v0001" and raw.headers["x-nightshift-route-fallback"] == "agent@v0002"
    assert r.metric("nightshift_route_fallbacks_total", route="agent", missing="agent@v0002", to="agent@v0001") == 2
    assert s.metric('nightshift_serve_requests_total{route="/v1/chat/completions",status="404"}') == 1
    assert "does not have agent@v0002" in r.log()
