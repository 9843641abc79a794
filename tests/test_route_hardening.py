"""`nightshift route` as a trust boundary (issue 24): each finding of the security
review, against a real proxy process in front of a scripted stand-in for vLLM
(tests/hardening/route_fuzz.py's, which records every byte it receives), and a
short run of the proxy's fuzz campaign (the long one writes docs/RELIABILITY.md)."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "hardening"))

import route_fuzz as F  # noqa: E402
from proc import free_port  # noqa: E402
from route_fuzz import Proxy, Upstream, exchange, request  # noqa: E402

CHAT = b"/v1/chat/completions"


@pytest.fixture(scope="module")
def upstream():
    u = Upstream()
    yield u
    u.stop()


@pytest.fixture(scope="module")
def proxy(upstream, tmp_path_factory):
    """The campaign's proxy: an admin token, an upstream API key, routes `agent`
    (half to a candidate) and `solo`."""
    folder = tmp_path_factory.mktemp("route")
    p = Proxy(upstream.url, folder, ["--admin-token", F.TOKEN, "--upstream-api-key", F.UPSTREAM_KEY,
                                     "--allowed-hosts", "nightshift-route", "--log-level", "info"]).start()
    for name, route in F.ROUTES.items():
        a = exchange(p.port, request("PUT", f"/nightshift/routes/{name}".encode(), [
            (b"Authorization", b"Bearer " + F.TOKEN.encode())], json.dumps(route).encode()), "PUT")
        assert a.status == 200, a.body
    yield p
    assert p.stop() == 0
    log = p.log()
    assert "Traceback" not in log, log[-4000:]


def _call(proxy: Proxy, upstream: Upstream, method: str, target: bytes, headers=(), body: bytes = b""):
    """(the answer, what the upstream received for it: [] when nothing)."""
    before = len(upstream.seen)
    answer = exchange(proxy.port, request(method, target, list(headers), body), method)
    return answer, upstream.seen[before:]


def _message(answer: F.Answer) -> str:
    return json.loads(answer.body)["error"]["message"]


ADMIN_TOKEN = (b"Authorization", b"Bearer " + F.TOKEN.encode())


# --- finding 1: the admin API, the headers, the control API's Host --------------------------------


@pytest.mark.parametrize("target", [b"/v1/unload_lora_adapter", b"/v1/load_lora_adapter", b"/v1/load%5Flora_adapter",
                                    b"/v1%2Fload_lora_adapter", b"//v1/./x/../load_lora_adapter?x=/v1/models",
                                    b"/collective_rpc", b"/sleep?level=2", b"/reset_prefix_cache",
                                    b"http://vllm:8000/v1/load_lora_adapter"])
def test_vllms_admin_api_is_refused_however_it_is_spelt_and_never_reaches_vllm(proxy, upstream, target):
    body = json.dumps({"lora_name": "agent@v0001", "lora_path": "/etc", "method": "reload_weights"}).encode()
    for headers in ([], [ADMIN_TOKEN]):  # the admin token moves routes; it does not lend vLLM's admin API
        answer, seen = _call(proxy, upstream, "POST", target, headers, body)
        assert answer.status == 403 and "vLLM's admin API" in _message(answer), answer
        assert seen == []
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as r:
        assert 'nightshift_route_refused_total{status="403"}' in r.read().decode()


def test_only_the_inference_api_passes_under_its_canonical_name(proxy, upstream):
    for target in (b"/tokenize", b"/v1/audio/transcriptions", b"/metrics/../health", b"/V1/CHAT/COMPLETIONS"):
        answer, seen = _call(proxy, upstream, "POST", target, [], b"{}")
        assert answer.status == 404 and "not an inference path" in _message(answer) and seen == []
    answer, seen = _call(proxy, upstream, "GET", CHAT)
    assert answer.status == 405 and answer.headers["allow"] == "POST" and seen == []
    body = json.dumps({"model": "tiny", "messages": []}).encode()
    answer, seen = _call(proxy, upstream, "POST", b"/v1/./chat%2Fcompletions?api-version=1", [], body)
    assert answer.status == 200 and seen[0].target == b"/v1/chat/completions?api-version=1"
    answer, seen = _call(proxy, upstream, "GET", b"//v1/models/")
    assert answer.status == 200 and seen[0].target == b"/v1/models"


def test_the_upstream_gets_only_the_headers_it_needs_and_the_proxys_key(proxy, upstream):
    body = json.dumps({"model": "tiny", "messages": []}).encode()
    answer, seen = _call(proxy, upstream, "POST", CHAT, [
        (b"Host", b"evil.example"), (b"Authorization", b"Bearer client-key"), (b"Cookie", b"session=s3cret"),
        (b"X-Forwarded-For", b"10.0.0.1"), (b"Forwarded", b"for=10.0.0.1"), (b"X-Real-IP", b"10.0.0.1"),
        (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), (b"X-Request-Id", b"r-1"),
        (b"Content-Type", b"application/json")], body)
    assert answer.status == 200
    got = {k.lower(): v for k, v in seen[0].headers}
    assert got[b"authorization"] == b"Bearer " + F.UPSTREAM_KEY.encode()
    assert got[b"host"] == f"127.0.0.1:{upstream.server_address[1]}".encode()
    assert got[b"traceparent"].startswith(b"00-4bf9") and got[b"x-request-id"] == b"r-1"
    assert not {b"cookie", b"x-forwarded-for", b"forwarded", b"x-real-ip"} & set(got)
    # and back: the upstream's Set-Cookie and a forged route header stay behind
    assert "set-cookie" not in answer.headers and "x-nightshift-route" not in answer.headers
    answer, seen = _call(proxy, upstream, "POST", CHAT, [(b"Authorization", b"Bearer a"), (b"Authorization", b"b")],
                         body)
    assert answer.status == 400 and "more than one authorization" in _message(answer) and seen == []


@pytest.mark.parametrize("headers, ok", [
    ([(b"Host", b"evil.example:8100")], False),  # DNS rebinding: a page's own name, re-pointed at 127.0.0.1
    ([(b"Host", b"localhost.evil.example")], False),
    ([(b"Origin", b"http://evil.example")], False),  # a browser's cross-origin request
    ([(b"Origin", b"null")], False),
    ([(b"Sec-Fetch-Site", b"cross-site")], False),
    ([(b"Host", b"127.0.0.1:8100")], True),
    ([(b"Host", b"localhost:8100")], True),
    ([(b"Host", b"[::1]:8100")], True),
    ([(b"Host", b"nightshift-route:8100")], True),  # --allowed-hosts
])
def test_the_control_api_answers_only_to_its_own_names_and_never_a_browser_page(proxy, upstream, headers, ok):
    route = json.dumps({"serving": "x@v2"}).encode()
    answer, _ = _call(proxy, upstream, "PUT", b"/nightshift/routes/host-check", [ADMIN_TOKEN, *headers], route)
    assert answer.status == (200 if ok else 403), answer
    if not ok:
        assert "nightshift route:" in _message(answer)
        shown, _ = _call(proxy, upstream, "GET", b"/nightshift/routes/agent", [ADMIN_TOKEN])
        assert json.loads(shown.body)["route"]["serving"] == "agent@v0001"  # nothing moved


# --- findings 2 and 3: deep JSON, headers that are not UTF-8 ---------------------------------------


def test_json_nested_200000_deep_is_a_400_not_a_500(proxy, upstream):
    deep = b"[" * 200_000 + b"]" * 200_000
    answer, seen = _call(proxy, upstream, "POST", CHAT, [], b'{"model": "agent", "messages": ' + deep + b"}")
    assert answer.status == 400 and "nests too deeply" in _message(answer) and seen == []
    answer, _ = _call(proxy, upstream, "PUT", b"/nightshift/routes/deep", [ADMIN_TOKEN], deep)
    assert answer.status == 400 and "too deeply" in _message(answer)


def test_headers_that_are_not_utf8_get_a_401_or_a_route_not_a_500(proxy, upstream):
    answer, _ = _call(proxy, upstream, "GET", b"/nightshift/routes", [(b"Authorization", b"Bearer \xff\xfe")])
    assert answer.status == 401
    body = json.dumps({"model": "agent", "messages": [{"role": "user", "content": "hi"}]}).encode()
    versions = set()
    for _ in range(3):  # sticky on the key's bytes, whatever they are
        answer, seen = _call(proxy, upstream, "POST", CHAT, [(b"X-Nightshift-Route-Key", b"caf\xe9 \xff")], body)
        assert answer.status == 200 and len(seen) == 1
        versions.add(answer.headers["x-nightshift-route"])
    assert len(versions) == 1 and versions <= F.VERSIONS["agent"]
    answer, seen = _call(proxy, upstream, "POST", CHAT, [(b"Authorization", b"Bearer \xc3\x28")], body)
    assert answer.status == 200 and len(seen) == 1


# --- finding 4: byte for byte ------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b'{"model": "agent", "temperature": 1e400, "max_tokens": 1' + b"0" * 5000 + b', "messages": []}',
    b'{"metadata": {"model": "keep-me"}, "mod\\u0065l" :\t"solo" , "messages": [{"content": "\\ud800 \\u00e9"}]}',
    b'{\n  "messages": [],\n  "model": "solo"\n}\n',
])
def test_a_routed_body_reaches_the_upstream_byte_for_byte_but_its_model(proxy, upstream, body):
    answer, seen = _call(proxy, upstream, "POST", CHAT, [(b"Content-Type", b"application/json")], body)
    version = answer.headers["x-nightshift-route"]
    stable = "agent" if b'"agent"' in body else "solo"
    assert answer.status == 200 and version in F.VERSIONS[stable]
    assert seen[0].body == body.replace(f'"{stable}"'.encode(), json.dumps(version).encode())


def test_a_body_with_two_top_level_models_is_refused_not_guessed(proxy, upstream):
    body = b'{"model": "tiny", "messages": [], "model": "agent"}'
    answer, seen = _call(proxy, upstream, "POST", CHAT, [], body)
    assert answer.status == 400 and "2 top-level `model` keys" in _message(answer) and seen == []


# --- finding 5: TLS to an https upstream --------------------------------------------------------------


class _Answers(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"model": req["model"], "tls": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_an_https_upstream_is_spoken_to_over_verified_tls(tmp_path):
    import security  # the campaigns' self-signed certificate (tests/hardening/security.py)

    cert, key = security.self_signed(tmp_path)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://localhost:{server.server_address[1]}"
    body = json.dumps({"model": "agent", "messages": []}).encode()
    try:
        trusted = Proxy(url, tmp_path, ["--upstream-ca-file", str(cert)]).start()
        untrusted = Proxy(url, tmp_path).start()
        try:
            assert exchange(trusted.port, request("PUT", b"/nightshift/routes/agent", [],
                                                  b'{"serving": "agent@v0001"}'), "PUT").status == 200
            answer = exchange(trusted.port, request("POST", CHAT, [], body))
            assert answer.status == 200 and json.loads(answer.body) == {"model": "agent@v0001", "tls": True}
            answer = exchange(untrusted.port, request("POST", CHAT, [], body))
            assert answer.status == 502, answer
            assert "TLS certificate is not trusted" in _message(answer) and "upstream_ca_file" in _message(answer)
        finally:
            assert trusted.stop() == 0 and untrusted.stop() == 0
    finally:
        server.shutdown()


# --- finding 6: a silent upstream ------------------------------------------------------------------


def test_an_upstream_silent_past_read_timeout_is_a_504_that_says_so(upstream, tmp_path):
    p = Proxy(upstream.url, tmp_path, ["--read-timeout", "0.5"]).start()
    try:
        answer = exchange(p.port, request("POST", CHAT, [], b'{"model": "silent", "messages": []}'))
        assert answer.status == 504
        message = _message(answer)
        assert "nothing came for 0.5 s" in message and "read_timeout" in message, message
        assert "closed the connection" not in message
    finally:
        assert p.stop() == 0


# --- finding 7: start-up failures ----------------------------------------------------------------------


def _start(tmp_path: Path, *args: str, state: bytes | None = None) -> subprocess.CompletedProcess:
    table = tmp_path / "routes.json"
    if state is not None:
        table.write_bytes(state)
    cmd = [sys.executable, "-m", "nightshift.cli.route_cmd", "route", "--state", str(table), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_start_up_failures_are_one_sentence_and_exit_2(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port, free = busy.getsockname()[1], f"127.0.0.1:{free_port()}"
    cases = [
        (["--listen", f"127.0.0.1:{port}"], None, f"cannot listen on 127.0.0.1:{port}"),
        (["--listen", "no-such-host.invalid:8100"], None, "cannot listen on no-such-host.invalid:8100"),
        (["--listen", free, "--upstream", "https://127.0.0.1:1", "--upstream-ca-file",
          str(tmp_path / "missing.pem")], None, "cannot read the upstream's CA file"),
        (["--listen", free], b'{"format": 1, "routes": {"agent": {"serving": "a@v1", "updated": "x"}}}',
         "updated must be unix seconds"),
        (["--listen", free], b"\xff\xfe not json", "cannot read the route table"),
    ]
    try:
        for args, state, says in cases:
            p = _start(tmp_path, *args, state=state)
            assert p.returncode == 2 and says in p.stderr, (args, p.stderr)
            assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    finally:
        busy.close()


# --- the route table's writer -----------------------------------------------------------------------


def test_the_route_table_is_written_by_the_shared_atomic_writer(tmp_path, monkeypatch):
    import nightshift.route.table as table

    writes = []
    real = table.write_atomic
    monkeypatch.setattr(table, "write_atomic", lambda path, data: (writes.append(path), real(path, data)))
    t = table.RouteTable(tmp_path / "routes.json")
    t.put("agent", table.parse("agent", {"serving": "agent@v0001"}))
    assert writes == [tmp_path / "routes.json"] and [p.name for p in tmp_path.iterdir()] == ["routes.json"]
    assert table.RouteTable(tmp_path / "routes.json").load().get("agent").serving == "agent@v0001"


# --- the campaign, short -----------------------------------------------------------------------------


def test_the_fuzz_campaign_short_finds_no_server_error_leak_or_traceback(tmp_path):
    r = F.campaign(700, seed=11, folder=tmp_path, progress=False)
    assert F.ok(r), F.report(r)
    # it reached every kind of answer, so "no failure" means something
    assert {"200", "400", "401", "403", "404", "405", "413", "500"} <= set(r.by_code), r.by_code
    assert r.by_kind.get("routed", 0) > 20 and r.by_kind.get("admin-path", 0) > 20
    assert r.by_kind.get("prompt-chat", 0) > 10 and r.prompt_rewritten > 5 and r.by_kind.get("control-prompt-bad", 0)
