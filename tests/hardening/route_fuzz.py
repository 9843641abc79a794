#!/usr/bin/env python
"""Fuzzing campaign for `nightshift route`: generated requests thrown at a real
proxy process in front of a scripted stand-in for vLLM, each checked against the
answer it must get and against what the upstream may (or must not) receive.

    python tests/hardening/route_fuzz.py                    # 5,000 cases
    python tests/hardening/route_fuzz.py --cases 20000 --write-docs
    python tests/hardening/route_fuzz.py --replay 1:4242    # one case again, printed

Generators (seeded: the same seed gives the same cases) start from requests an
agent sends and break one thing: bodies (nesting 2,000 to 200,000 deep, numbers
past float and int, invalid UTF-8, lone surrogates, duplicate keys, `model` with
escapes, whitespace or a non-string, a `model` nested where it is not the
request's, wrong types, truncation, bodies over the limit, chunked uploads),
headers (not UTF-8, 9 and 70 KB long, Authorization twice, odd Host, Cookie,
X-Forwarded-For and the like, compressed bodies), paths (vLLM's admin routes
spelt every way a router decodes: `%5F`, `%2F`, dot segments, doubled slashes,
case, query strings, absolute form; unknown paths; wrong methods) and the
control API (bad bodies, a foreign Host, a browser's Origin, tokens that are
wrong, doubled or not UTF-8); and prompt routes (issue 27): the agent's system
prompt with its per-request date, in chat and Responses bodies, escaped, spaced,
doubled, split in two messages, given as content parts, beside a routed `model`,
streamed; prompt routes PUT with a text that is not their candidate's, names that
are no id, texts of every wrong type.

Checked on every case: the status is one the case allows; a 5xx is a failure
unless the stand-in upstream itself answered it; a request that must be refused
never reaches the upstream, and one that is forwarded arrives byte for byte (the
body with only the top-level `model`'s value changed, to the version the answer
names; the path canonical; none of the headers that must not cross; for a
prompt case, the system prompt's content replaced by the candidate's, its date
put in, exactly when the answer says `X-Nightshift-Route-Prompt`, and then its
`model` marked `+p:`; an ambiguous body never rewritten). At the end:
the proxy's log holds no traceback, it is still healthy, and SIGTERM stops it
with exit 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from proc import free_port  # noqa: E402

TOKEN = "fuzz-admin-token"
UPSTREAM_KEY = "fuzz-upstream-key"
LIMIT = 1 << 20  # the proxy's max_body_bytes in the campaign: small, so bodies past it cost little
ROUTES = {"agent": {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5},
          "solo": {"serving": "solo@v0003"}}
VERSIONS = {"agent": {"agent@v0001", "agent@v0002"}, "solo": {"solo@v0003"}}
#: the prompt route: the agent's prompt (a template: its date is per request) and a candidate, on half
PROMPT = "You help with orders. Today is {{date}}. Answer briefly."
PROMPT_CANDIDATE = "You help with orders (today: {{date}}). Look the order up before you answer."
DATES = ["2026-11-26", "26/11/2026", "Thursday, 26 November 2026", "Nov 26, 2026"]
#: headers a client sends that must never reach the upstream
NEVER_UP = (b"cookie", b"x-forwarded-for", b"forwarded", b"x-real-ip", b"proxy-authorization", b"x-stainless-lang",
            b"x-nightshift-route-key", b"accept-encoding")


# --- the scripted upstream: a stand-in for vLLM (this campaign is about the proxy) -------------


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _Handler(socketserver.StreamRequestHandler):
    """HTTP/1.1 keep-alive, Content-Length bodies (the proxy always sends one).
    Answers: `fuzz-500` a 500 of its own, `gone@*` vLLM's 404 "does not exist", a
    body with `"stream": true` an SSE stream, anything else a small JSON answer
    naming the model it was asked for; `silent` nothing for 3 s (past a short
    read_timeout), then its answer."""

    def handle(self) -> None:
        try:
            self._serve()
        except OSError:  # the proxy hung up (a client gone, a timeout): as a server sees it
            pass

    def _serve(self) -> None:
        while True:
            line = self.rfile.readline(70000)
            if not line:
                return
            method, target, _ = (line.rstrip(b"\r\n").split(b" ", 2) + [b"", b""])[:3]
            headers = []
            while (h := self.rfile.readline(70000)) not in (b"\r\n", b"\n", b""):
                k, _, v = h.rstrip(b"\r\n").partition(b":")
                headers.append((k.strip(), v.strip()))
            n = next((int(v) for k, v in headers if k.lower() == b"content-length"), 0)
            body = self.rfile.read(n) if n else b""
            self.server.record(Seen(method, target, headers, body))
            self._answer(body)

    def _answer(self, body: bytes) -> None:
        try:
            req = json.loads(body, parse_int=str)  # str: integers past 4,300 digits are valid JSON too
        except (ValueError, RecursionError):
            req = None
        model = req.get("model") if isinstance(req, dict) else None
        model = model if isinstance(model, str) else "-"
        if model == "silent":
            time.sleep(3)
        if model == "fuzz-500":
            return self._send(500, b'{"error": {"message": "the stand-in fails on purpose", "code": 500}}')
        if model.startswith("gone@"):
            return self._send(404, json.dumps({"error": {"message": f"The model `{model}` does not exist.",
                                                         "type": "NotFoundError", "code": 404}}).encode())
        if isinstance(req, dict) and req.get("stream") is True:
            out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            for event in (json.dumps({"model": model, "choices": [{"delta": {"content": "hi"}}]}).encode(), b"[DONE]"):
                data = b"data: " + event + b"\n\n"
                out += b"%x\r\n%s\r\n" % (len(data), data)
            self.wfile.write(out + b"0\r\n\r\n")
            return
        self._send(200, json.dumps({"object": "chat.completion", "model": model}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.wfile.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nSet-Cookie: upstream=1\r\n"
                         b"X-Nightshift-Route: forged\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body))


class Upstream(socketserver.ThreadingTCPServer):
    """The stand-in upstream on a free loopback port; `seen` holds every request."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


# --- the proxy, a real process ------------------------------------------------------------------


@dataclass
class Proxy:
    """A real `nightshift route` process on a free loopback port, logging to a file."""

    upstream: str
    folder: Path
    extra: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / f"route-{self.port}.log"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "nightshift.cli.route_cmd", "route", "--listen", f"127.0.0.1:{self.port}",
                "--upstream", self.upstream, "--state", str(self.folder / f"routes-{self.port}.json"),
                "--drain-timeout", "2", *self.extra]

    def start(self, timeout: float = 30.0) -> "Proxy":
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"route exited {self.proc.returncode}:\n{self.log()}")
            if self.healthy():
                return self
            time.sleep(0.05)
        raise TimeoutError(self.log())

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return -9
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Answer:
    status: int | None  # None: the connection closed without a status line
    headers: dict[str, str]
    body: bytes


def exchange(port: int, data: bytes, method: str = "POST", timeout: float = 20.0) -> Answer:
    """`data` sent raw on a fresh connection; the answer, whole."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(data)
        except OSError:  # the proxy answered (and closed) before the whole upload went
            pass
        r = http.client.HTTPResponse(s, method=method)
        try:
            r.begin()
        except (http.client.RemoteDisconnected, ConnectionError):
            return Answer(None, {}, b"")
        try:
            body = r.read()
        except (http.client.IncompleteRead, ConnectionError) as e:
            body = getattr(e, "partial", b"")
        return Answer(r.status, {k.lower(): v for k, v in r.getheaders()}, body)


def request(method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b"",
            chunked: bool = False) -> bytes:
    head = b"%s %s HTTP/1.1\r\n" % (method.encode(), target)
    if not any(k.lower() == b"host" for k, _ in headers):
        headers = [(b"Host", b"127.0.0.1")] + headers
    if chunked:
        headers = headers + [(b"Transfer-Encoding", b"chunked")]
        pieces = [body[i:i + 997] for i in range(0, len(body), 997)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    elif body or method in ("POST", "PUT"):
        headers = headers + [(b"Content-Length", str(len(body)).encode())]
    return head + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"\r\n" + body


# --- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    """A request and its oracle. `reaches`: True when the upstream must get it,
    False when it must not, None when either is right. `route`: the stable name it
    must be routed for (its `model` value rewritten to the version the answer's
    X-Nightshift-Route names), "" when the body must arrive unchanged, None when
    either (a body Python reads but JSON does not allow)."""

    kind: str
    method: str
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    expect: frozenset[int] = frozenset({200})
    reaches: bool | None = True
    route: str | None = ""
    span: tuple[int, int] | None = None  # where the top-level model's value lies in `body`
    upstream_target: bytes = b"/v1/chat/completions"
    upstream_5xx: bool = False  # the stand-in answers 5xx itself
    prompt: tuple[list[tuple[int, int]], list[bytes]] | None = None  # the prompt route's edits when its candidate
    # is put in (content spans and their new values); None: the body must never be rewritten for a prompt
    chunked: bool = False
    may_close: bool = False  # the proxy refuses before reading the upload: its answer may be lost to a reset

    def wire(self) -> bytes:
        return request(self.method, self.target, self.headers, self.body, self.chunked)


WORDS = ["What is 12 * 7?", "résumé", "日本語", "emoji 🤖", "", "tab\tand\nnewline", 'quote " and \\ back', "x" * 300]
JSON_ESCAPED = [r"\u00e9", r"\ud83e\udd16", r"\ud800", r"\udfff", r"\"", r"\\", r"\/", r"\n", r"\u0000"]


def _ws(rng: random.Random) -> bytes:
    return rng.choice([b"", b"", b"", b" ", b"\n", b"\t", b" \r\n  "])


def _string(rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return b'"' + "".join(rng.choice(JSON_ESCAPED) for _ in range(rng.randrange(1, 4))).encode() + b'"'
    return json.dumps(rng.choice(WORDS), ensure_ascii=rng.random() < 0.5).encode()


def _number(rng: random.Random) -> bytes:
    return rng.choice([b"0", b"-0", b"0.7", b"1e400", b"-1e400", b"1.5e-400", b"1E+2", b"9" * 5000,
                       b"-" + b"1" * 4400, b"123456789012345678901234567890", b"0.1000000000000000055511151231257827"])


def _value(rng: random.Random, depth: int = 0) -> bytes:
    k = rng.randrange(7 if depth < 4 else 4)
    if k == 0:
        return _string(rng)
    if k == 1:
        return _number(rng)
    if k == 2:
        return rng.choice([b"true", b"false", b"null"])
    if k == 3:
        return b'"model"' if rng.random() < 0.5 else _string(rng)
    if k == 4:
        items = [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
        return b"[" + _ws(rng) + (b"," + _ws(rng)).join(items) + _ws(rng) + b"]"
    keys = [b'"model"', b'"role"', b'"content"', b'"m"'] + [_string(rng)]
    items = [rng.choice(keys) + _ws(rng) + b":" + _ws(rng) + _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return b"{" + _ws(rng) + (b"," + _ws(rng)).join(items) + _ws(rng) + b"}"


def _model_key(rng: random.Random) -> bytes:
    return rng.choice([b'"model"', b'"model"', b'"mod\\u0065l"', b'"\\u006dodel"', b'"\\u006D\\u006f\\u0064el"'])


def chat_body(rng: random.Random, model: bytes, key: bytes = b'"model"', extra: bool = True) -> tuple[bytes, tuple[int, int]]:
    """A chat request with `model` (raw JSON) under `key`, in a random place among
    other fields, whitespace anywhere JSON allows; and where the model's value lies."""
    messages = [b'{"role": "system", "content": ' + _string(rng) + b"}",
                b'{"role":"user","content":' + _string(rng) + b"}"]
    fields = [b'"messages"' + _ws(rng) + b":" + _ws(rng) + b"[" + b",".join(messages) + b"]"]
    if extra:
        for name in rng.sample([b'"temperature"', b'"metadata"', b'"max_tokens"', b'"tools"', b'"user"', b'"seed"'],
                               rng.randrange(0, 4)):
            fields.append(name + _ws(rng) + b":" + _ws(rng) + _value(rng))
    at = rng.randrange(len(fields) + 1)
    before, after = fields[:at], fields[at:]
    out = b"{" + _ws(rng)
    for f in before:
        out += f + _ws(rng) + b"," + _ws(rng)
    out += key + _ws(rng) + b":" + _ws(rng)
    span = (len(out), len(out) + len(model))
    out += model
    for f in after:
        out += _ws(rng) + b"," + _ws(rng) + f
    return out + _ws(rng) + b"}", span


def _base_headers(rng: random.Random) -> list[tuple[bytes, bytes]]:
    h = [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer client-key")]
    if rng.random() < 0.3:
        h.append((b"traceparent", b"00-%032x-00f067aa0ba902b7-01" % rng.getrandbits(128)))
    if rng.random() < 0.2:
        h.append((b"X-Request-Id", b"req-%d" % rng.randrange(10**6)))
    return h


def gen_body(rng: random.Random) -> Case:
    """Chat bodies, well formed or broken in one place."""
    h = _base_headers(rng)
    what = rng.randrange(12)
    name = rng.choice([b"agent", b"solo"])
    if what <= 2:  # routed, with escapes, whitespace, huge numbers and nested `model`s around
        body, span = chat_body(rng, b'"' + name + b'"', _model_key(rng))
        return Case("routed", "POST", b"/v1/chat/completions", h, body, route=name.decode(), span=span)
    if what == 3:  # not a route: through untouched
        body, _ = chat_body(rng, rng.choice([b'"tiny"', b'"agent@v0001"', b'"unknown-model"', b'"Agent"']))
        return Case("unrouted", "POST", b"/v1/chat/completions", h, body)
    if what == 4:  # `model` not a string, or absent: through untouched
        body, _ = chat_body(rng, rng.choice([b"5", b"null", b"[]", b'{"model": "agent"}', b"true", b'["agent"]']))
        if rng.random() < 0.3:
            body = rng.choice([b'{"messages": []}', b"[]", b'"agent"', b"17", b"null", b""])
        return Case("model-type", "POST", b"/v1/chat/completions", h, body)
    if what == 5:  # two top-level models: refused when the one a parser keeps is a route, else untouched
        first, last = rng.choice([(b'"tiny"', b'"agent"'), (b'"agent"', b'"agent"'), (b'"agent"', b'"tiny"')])
        body, _ = chat_body(rng, first + b', "model": ' + last, _model_key(rng))
        if last == b'"agent"':
            return Case("duplicate-model", "POST", b"/v1/chat/completions", h, body, frozenset({400}), False)
        return Case("duplicate-model", "POST", b"/v1/chat/completions", h, body)
    if what == 6:  # nested past any parser's stack
        depth = rng.choice([2000, 5000, 20000, 200000])
        nest = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        deep = nest[0] * depth + b"1" + nest[1] * depth
        body = (b'{"model": "' + name + b'", "messages": ' + deep + b"}" if rng.random() < 0.7 else
                b'{"model": "tiny", "metadata": ' + deep + b"}")
        return Case("deep", "POST", b"/v1/chat/completions", h, body, frozenset({400} if len(body) <= LIMIT else {413}),
                    False, may_close=len(body) > LIMIT)
    if what == 7:  # nested, but not deeply: an ordinary request
        depth = rng.randrange(1, 60)
        body, span = chat_body(rng, b'"' + name + b'"')
        body = body[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"
        return Case("nested", "POST", b"/v1/chat/completions", h, body, route=name.decode(), span=span)
    if what == 8:  # not UTF-8 somewhere: not JSON, through untouched for the upstream to judge
        body, _ = chat_body(rng, b'"' + name + b'"')
        i = rng.randrange(1, len(body) - 1)
        body = body[:i] + rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]) + body[i:]
        return Case("not-utf8", "POST", b"/v1/chat/completions", h, body, route=None)
    if what == 9:  # truncated: not JSON, untouched
        body, _ = chat_body(rng, b'"' + name + b'"')
        return Case("truncated", "POST", b"/v1/chat/completions", h, body[:rng.randrange(1, len(body) - 1)], route=None)
    if what == 10:  # Python reads NaN and Infinity; JSON does not: routed or untouched, both honest
        body, span = chat_body(rng, b'"' + name + b'"', extra=False)
        body = body[:-1] + b', "temperature": ' + rng.choice([b"NaN", b"Infinity", b"-Infinity"]) + b"}"
        return Case("non-json-literal", "POST", b"/v1/chat/completions", h, body, route=None, span=span)
    # over the limit, with a length or chunked
    chunked = rng.random() < 0.5
    body = b'{"model": "agent", "messages": [{"role": "user", "content": "' + b"a" * (LIMIT + 10) + b'"}]}'
    return Case("too-large", "POST", b"/v1/chat/completions", h, body, frozenset({413}), False, chunked=chunked,
                may_close=True)


def gen_stream(rng: random.Random) -> Case:
    """Streamed and chunked-upload requests, and the upstream's own errors."""
    h = _base_headers(rng)
    what = rng.randrange(4)
    if what == 0:
        body, span = chat_body(rng, b'"agent"')
        body = body[:-1] + b', "stream": true}'
        return Case("stream", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)
    if what == 1:
        body, span = chat_body(rng, b'"solo"')
        return Case("chunked-upload", "POST", b"/v1/chat/completions", h, body, route="solo", span=span, chunked=True)
    if what == 2:
        body, _ = chat_body(rng, b'"fuzz-500"')
        return Case("upstream-500", "POST", b"/v1/chat/completions", h, body, frozenset({500}), upstream_5xx=True)
    body = json.dumps({"model": "gone@v0009", "prompt": "x"}).encode()
    return Case("upstream-404", "POST", b"/v1/completions", h, body, frozenset({404}),
                upstream_target=b"/v1/completions")


def gen_header(rng: random.Random) -> Case:
    """Odd headers on a routed request."""
    body, span = chat_body(rng, b'"agent"')
    h = [(b"Content-Type", b"application/json")]
    what = rng.randrange(9)
    if what == 0:
        h.append((b"X-Nightshift-Route-Key", rng.choice([b"\xff\xfe", b"caf\xe9", b"\xed\xa0\x80", b"k" * 4000])))
        return Case("route-key", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)
    if what == 1:
        h.append((b"Authorization", rng.choice([b"Bearer \xff\xfe", b"\xc3\x28", b"Basic \x80"])))
        return Case("auth-not-utf8", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)
    if what == 2:
        h += [(b"Authorization", b"Bearer one"), (b"authorization", b"Bearer two")]
        return Case("auth-twice", "POST", b"/v1/chat/completions", h, body, frozenset({400}), False)
    if what == 3:  # past aiohttp's 8 KB line: refused by its parser
        h.append((rng.choice([b"X-Long", b"Authorization", b"Cookie"]), b"a" * rng.choice([9000, 70000])))
        return Case("huge-header", "POST", b"/v1/chat/completions", h, body, frozenset({400, 431}), False,
                    may_close=True)
    if what == 4:  # the Host is the client's business; the upstream gets its own
        h.insert(0, (b"Host", rng.choice([b"evil.example", b"\xff", b"[::1]:1", b"localhost:99999", b"a" * 300])))
        return Case("odd-host", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)
    if what == 5:
        h += [(b"Cookie", b"session=secret"), (b"X-Forwarded-For", b"10.9.8.7"), (b"Forwarded", b"for=10.9.8.7"),
              (b"X-Real-IP", b"10.9.8.7"), (b"Proxy-Authorization", b"Basic eA=="), (b"X-Stainless-Lang", b"python"),
              (b"Accept-Encoding", b"gzip")]
        return Case("must-not-cross", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)
    if what == 6:
        h.append((b"Content-Encoding", rng.choice([b"gzip", b"br", b"zstd"])))
        return Case("compressed", "POST", b"/v1/chat/completions", h, body, frozenset({400}), False)
    if what == 7:
        h += [(b"Content-Type", b"application/json"), (b"Content-Type", b"text/plain")]
        return Case("content-type-twice", "POST", b"/v1/chat/completions", h, body, frozenset({400}), False)
    h.append((b"traceparent", rng.choice([b"00-zz-yy-01", b"\xff", b"00-" + b"0" * 32 + b"-00f067aa0ba902b7-01"])))
    return Case("bad-traceparent", "POST", b"/v1/chat/completions", h, body, route="agent", span=span)


ADMIN = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/sleep", "/wake_up",
         "/reset_prefix_cache", "/pause", "/update_weights", "/start_profile"]
OTHER = ["/tokenize", "/detokenize", "/pooling", "/score", "/rerank", "/v1/rerank", "/classify", "/invocations",
         "/health", "/version", "/ping", "/v1/audio/transcriptions", "/v1/models/tiny", "/docs", "/openapi.json",
         "/", "/v2/rerank", "/inference/v1/generate", "/v1/chat/completions/render", "/v1", "/v1/chat"]


def _spell(rng: random.Random, path: str) -> bytes:
    """`path` as a router would still read it (or read as something else: refused either way)."""
    out = ""
    for c in path:
        r = rng.random()
        if c == "/" and r < 0.15:
            out += rng.choice(["%2F", "%2f", "//", "/./", "/x/../", "/%2e/", "/x/%2E%2E/"])
        elif c != "/" and r < 0.15:
            out += "%" + rng.choice(["%02X", "%02x"]) % ord(c)
        elif c.isalpha() and r < 0.2:
            out += c.upper()
        else:
            out += c
    if rng.random() < 0.3:
        out += rng.choice(["/", "?x=1", "?path=/v1/chat/completions", "?%ff=%00", "#frag"])
    if rng.random() < 0.1:
        out = "http://evil.example" + out
    return out.encode()


def gen_path(rng: random.Random) -> Case:
    h = [(b"Content-Type", b"application/json"), (b"Authorization", b"Bearer client-key")]
    what = rng.randrange(6)
    if what <= 1:  # vLLM's admin API, spelt any way: never reaches it
        body = json.dumps({"lora_name": "x", "lora_path": "/etc", "method": "reload_weights"}).encode()
        method = rng.choice(["POST", "POST", "GET", "PUT"])
        return Case("admin-path", method, _spell(rng, rng.choice(ADMIN)), h, body if method != "GET" else b"",
                    frozenset({400, 403, 404, 405}), False)
    if what == 2:
        method = rng.choice(["GET", "POST"])
        return Case("other-path", method, _spell(rng, rng.choice(OTHER)), h, b"{}" if method == "POST" else b"",
                    frozenset({400, 404, 405}), False)
    if what == 3:  # the inference paths, spelt oddly: forwarded under their canonical name
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"])
        target = b"/" + b"/".join(rng.choice([s, b"." + b"/" + s, s.replace(b"o", b"%6F"), s.replace(b"c", b"%63")])
                                  for s in path.encode().strip(b"/").split(b"/"))
        target = rng.choice([target, b"/" + target, target[:1] + target[1:].replace(b"/", b"%2F", 1),
                             b"/v1/x/.." + path[3:].encode()])
        query = rng.choice([b"", b"?api-version=1", b"?a=%20b&c"])
        body, span = chat_body(rng, b'"agent"')
        return Case("inference-path", "POST", target + query, h, body, route="agent", span=span,
                    upstream_target=path.encode() + query)
    if what == 4:  # wrong methods on inference paths
        path, method = rng.choice([("/v1/chat/completions", "GET"), ("/v1/models", "POST"), ("/v1/models", "DELETE"),
                                   ("/v1/chat/completions", "PUT"), ("/v1/embeddings", "PATCH")])
        return Case("wrong-method", method, path.encode(), h, b"{}" if method != "GET" else b"",
                    frozenset({405}), False)
    bad = rng.choice([b"/v1/models%00", b"/v1/%0a/models", b"/%ff%fe", b"/v1/chat/completions%ZZ",
                      b"/" + b"a/" * 3000, b"/v1/chat/completions/%2e%2e/%2e%2e/load_lora_adapter"])
    return Case("bad-path", "GET", bad, h, expect=frozenset({400, 403, 404}), reaches=False)


def gen_models(rng: random.Random) -> Case:
    target, canonical = rng.choice([(b"/v1/models", b"/v1/models"), (b"/v1/models?x=1", b"/v1/models?x=1"),
                                    (b"/v1//models/", b"/v1/models"), (b"/v1/%6Dodels", b"/v1/models"),
                                    (b"/v1/" + b"%2e%2e/" * 50 + b"v1/models", b"/v1/models")])
    return Case("models", "GET", target, [(b"Authorization", b"Bearer client-key")], upstream_target=canonical)


def gen_control(rng: random.Random, index: int) -> Case:
    """The control API: never the upstream's business."""
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    name = f"fz-{index}".encode()
    good = json.dumps({"serving": "x@v1", "candidate": "x@v2", "share": 0.25}).encode()
    what = rng.randrange(8)
    if what == 0:
        return Case("control-put", "PUT", b"/nightshift/routes/" + name, [auth], good, reaches=False)
    if what == 1:
        bad = rng.choice([b"[" * 200000 + b"]" * 200000, b'{"serving": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                          b"not json", b"\xff\xfe", b'{"serving": 5}', b'{"serving": "a", "share": 1e400}',
                          b'{"serving": "a", "candidate": "b", "share": NaN}', b'{"serving": "a", "extra": 1}',
                          b'"just a string"', b"", b'{"serving": "a", "candidate": "b", "share": ' + b"9" * 5000 + b"}"])
        return Case("control-bad-body", "PUT", b"/nightshift/routes/" + name, [auth], bad, frozenset({400}), False)
    if what == 2:
        host = rng.choice([b"evil.example", b"evil.example:8100", b"localhost.evil.example", b"\xff", b"127.0.0.1.nip.io"])
        return Case("control-foreign-host", rng.choice(["PUT", "GET", "DELETE"]), b"/nightshift/routes/" + name,
                    [(b"Host", host), auth], good, frozenset({403}), False)
    if what == 3:
        origin = rng.choice([b"http://evil.example", b"null", b"http://127.0.0.1:1", b"https://localhost"])
        return Case("control-origin", "PUT", b"/nightshift/routes/" + name, [auth, (b"Origin", origin)], good,
                    frozenset({403}), False)
    if what == 4:
        bad = rng.choice([[], [(b"Authorization", b"Bearer wrong")], [(b"Authorization", b"Bearer \xff\xfe")],
                          [auth, auth], [(b"Authorization", TOKEN.encode())]])
        return Case("control-token", rng.choice(["PUT", "GET", "DELETE"]), b"/nightshift/routes/" + name, bad, good,
                    frozenset({401}), False)
    if what == 5:
        odd = rng.choice([b"%ff", b"%00", b"caf%C3%A9", b"a" * 300, b"%ed%a0%80", b"..", b"a%2Fb", b"x@v1?y=1"])
        return Case("control-odd-name", rng.choice(["GET", "DELETE", "PUT"]), b"/nightshift/routes/" + odd, [auth], good,
                    frozenset({200, 400, 404, 405}), False)
    if what == 6:
        return Case("control-list", rng.choice(["GET", "POST"]), rng.choice([b"/nightshift/routes", b"/nightshift/x",
                    b"//nightshift//routes/", b"/nightshift"]), [auth], b"", frozenset({200, 404, 405}), False)
    return Case("control-delete", "DELETE", b"/nightshift/routes/" + name, [auth], b"", frozenset({200, 404}), False)


def _prompt_id(text: str) -> str:
    from nightshift.schemas.prompt_identity import system_id

    return system_id([text])


def gen_prompt(rng: random.Random) -> Case:
    """Requests carrying the prompt route's prompt (or nearly), and bad prompt routes."""
    h = _base_headers(rng)
    date = rng.choice(DATES)
    text = PROMPT.replace("{{date}}", date)
    want = json.dumps(PROMPT_CANDIDATE.replace("{{date}}", date)).encode()
    content = json.dumps(text, ensure_ascii=rng.random() < 0.5).encode()
    what = rng.randrange(9)
    if what <= 2:  # chat: the prompt first, a model routed or not, extra fields, streamed or not
        model = rng.choice([b'"agent"', b'"tiny"'])
        body, span = chat_body(rng, model)
        head = b'{"role":' + _ws(rng) + b'"system", "content":' + _ws(rng)
        at = body.index(b'[{"role": "system"') + 1
        end = body.index(b"}", body.index(b'"content": ', at)) + 1
        msg = head + content + b"}"
        body = body[:at] + msg + body[end:]
        if span[0] > at:
            span = (span[0] + len(msg) - (end - at), span[1] + len(msg) - (end - at))
        c0 = at + len(head)
        if rng.random() < 0.3:
            body = body[:-1] + b', "stream": true}'
        route = "agent" if model == b'"agent"' else ""
        return Case("prompt-chat", "POST", b"/v1/chat/completions", h, body, route=route,
                    span=span if route else None, prompt=([(c0, c0 + len(content))], [want]))
    if what == 3:  # the Responses API's instructions
        pre = b'{"model": "tiny", "input": "where is my order?", "instructions":' + _ws(rng)
        body = pre + content + b"}"
        return Case("prompt-responses", "POST", b"/v1/responses", h, body,
                    prompt=([(len(pre), len(pre) + len(content))], [want]), upstream_target=b"/v1/responses")
    if what == 4:  # the prompt as two system messages: the template of both is another prompt, untouched
        body = (b'{"model": "tiny", "messages": [{"role": "system", "content": ' + content + b'}, {"role": "system", '
                b'"content": "Be kind."}, {"role": "user", "content": "hi"}]}')
        return Case("prompt-two", "POST", b"/v1/chat/completions", h, body)
    if what == 5:  # ambiguous: content as parts, a doubled content key, two messages keys: never rewritten
        parts = json.dumps([{"type": "text", "text": text}]).encode()
        body = rng.choice([
            b'{"model": "tiny", "messages": [{"role": "system", "content": ' + parts + b'}]}',
            b'{"model": "tiny", "messages": [{"role": "system", "content": "x", "content": ' + content + b'}]}',
            b'{"model": "tiny", "messages": [], "messages": [{"role": "system", "content": ' + content + b'}]}'])
        return Case("prompt-ambiguous", "POST", b"/v1/chat/completions", h, body)
    if what == 6:  # the agent changed its prompt: another id, untouched
        body = json.dumps({"model": "tiny", "messages": [{"role": "system", "content": text + " Be warm."},
                                                         {"role": "user", "content": "hi"}]}).encode()
        return Case("prompt-changed", "POST", b"/v1/chat/completions", h, body)
    auth = (b"Authorization", b"Bearer " + TOKEN.encode())
    name = b"/nightshift/routes/prompt:" + _prompt_id(f"fz {rng.random()}").encode()
    good = {"kind": "prompt", "candidate": _prompt_id(PROMPT_CANDIDATE), "system": PROMPT_CANDIDATE, "share": 0.5}
    bad = rng.choice([{**good, "system": PROMPT_CANDIDATE + " "}, {**good, "candidate": "zz"}, {**good, "system": 5},
                      {**good, "system": []}, {**good, "system": [None]}, {**good, "share": "half"},
                      {**good, "match_system": ["not it"]}, {**good, "agent": "\x00"}, {**good, "kind": "prompts"},
                      {**good, "system": "x" * 300000}, {k: v for k, v in good.items() if k != "share"}])
    target = rng.choice([name, name, b"/nightshift/routes/prompt:nothex", b"/nightshift/routes/prompt:"])
    return Case("control-prompt-bad", "PUT", target, [auth], json.dumps(bad).encode(), frozenset({400}), False)


def generate(rng: random.Random, index: int) -> Case:
    k = rng.random()
    if k < 0.12:
        return gen_prompt(rng)
    if k < 0.35:
        return gen_body(rng)
    if k < 0.45:
        return gen_stream(rng)
    if k < 0.6:
        return gen_header(rng)
    if k < 0.8:
        return gen_path(rng)
    if k < 0.82:
        return gen_models(rng)
    return gen_control(rng, index)


def case_for(seed: int, index: int) -> Case:
    return generate(random.Random(seed * 1_000_003 + index), index)


# --- running ----------------------------------------------------------------------------------


@dataclass
class Failure:
    case_id: str
    kind: str
    what: str
    detail: str = ""


@dataclass
class Result:
    cases: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_code: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # 5xx the stand-in did not answer, or no answer at all
    wrong_code: int = 0
    reached_upstream: int = 0  # refused requests the upstream heard of anyway
    not_forwarded: int = 0  # requests that should have reached it and did not
    altered: int = 0  # forwarded, but not byte for byte (body, path, headers)
    tracebacks: int = 0
    prompt_rewritten: int = 0  # prompt cases whose candidate was put in (and checked): the oracle was exercised
    healthy_after: bool = False
    exit_code: int | None = None
    wall_s: float = 0.0
    failures: list[Failure] = field(default_factory=list)


def _check_forwarded(case: Case, ans: Answer, seen: Seen, upstream_host: bytes) -> str:
    """What is wrong with what the upstream got, or ""."""
    version = ans.headers.get("x-nightshift-route")
    if case.route and not version:
        return f"not routed (no X-Nightshift-Route) for {case.route}"
    if case.route == "" and version:
        return f"routed to {version} though its model is not a route"
    if version and case.route and version not in VERSIONS[case.route]:
        return f"routed to {version}, not a version of {case.route}"
    edits = [(*case.span, json.dumps(version).encode())] if version and case.span is not None else []
    prompted = ans.headers.get("x-nightshift-route-prompt")
    if prompted and case.prompt is None:
        return f"the prompt was rewritten ({prompted}) though it must not be"
    if prompted:
        edits += [(s, e, v) for (s, e), v in zip(*case.prompt)]
        marked = b"+p:" + prompted.encode() in ans.body
        if not marked:
            return f"the answer's model is not marked +p:{prompted}: {ans.body[:200]!r}"
    elif b"+p:" in ans.body:
        return "an answer not rewritten is marked"
    want, last = b"", 0
    for s, e, v in sorted(edits):
        want, last = want + case.body[last:s] + v, e
    want += case.body[last:]
    if seen.body != want and not (case.route is None and seen.body == case.body):
        return f"the body changed beyond its model and prompt ({len(seen.body)} bytes arrived for {len(want)})"
    if seen.target != case.upstream_target:
        return f"the upstream was asked for {seen.target[:100]!r}, not {case.upstream_target!r}"
    names = [k.lower() for k, _ in seen.headers]
    crossed = [n.decode() for n in NEVER_UP if n in names]
    if crossed:
        return f"headers that must not cross reached the upstream: {crossed}"
    auth = [v for k, v in seen.headers if k.lower() == b"authorization"]
    if auth != [b"Bearer " + UPSTREAM_KEY.encode()]:
        return f"the upstream got Authorization {auth!r}, not the proxy's key alone"
    host = [v for k, v in seen.headers if k.lower() == b"host"]
    if host != [upstream_host]:
        return f"the upstream got Host {host!r}, not its own {upstream_host!r}"
    return ""


def run_case(upstream: Upstream, proxy_port: int, case: Case, case_id: str, res: Result) -> None:
    res.cases += 1
    res.by_kind[case.kind] = res.by_kind.get(case.kind, 0) + 1
    before = len(upstream.seen)
    try:
        ans = exchange(proxy_port, case.wire(), case.method)
    except OSError as e:
        ans = Answer(None, {}, str(e).encode())
    got = "none" if ans.status is None else str(ans.status)
    res.by_code[got] = res.by_code.get(got, 0) + 1
    new = upstream.seen[before:]
    if ans.status is None and case.may_close and not new:
        return
    if ans.status is None or (ans.status >= 500 and not case.upstream_5xx):
        res.server_errors += 1
        res.failures.append(Failure(case_id, case.kind, f"server error {got}", ans.body[:300].decode("utf-8", "replace")))
        return
    if ans.status not in case.expect:
        res.wrong_code += 1
        res.failures.append(Failure(case_id, case.kind, f"status {got}, expected {sorted(case.expect)}",
                                    ans.body[:300].decode("utf-8", "replace")))
    if case.reaches is False and new:
        res.reached_upstream += 1
        res.failures.append(Failure(case_id, case.kind, "reached the upstream", repr(new[0].target[:100])))
        return
    if case.reaches and not new:
        res.not_forwarded += 1
        res.failures.append(Failure(case_id, case.kind, "never reached the upstream", got))
        return
    if new and ans.status in case.expect:
        problem = _check_forwarded(case, ans, new[0], b"127.0.0.1:%d" % upstream.server_address[1])
        if not problem and len(new) > 1 and case.kind != "upstream-404":
            problem = f"the upstream got {len(new)} requests for one"
        if not problem and ("set-cookie" in ans.headers or ans.headers.get("x-nightshift-route") == "forged"):
            problem = "the upstream's Set-Cookie or X-Nightshift-Route reached the client"
        if problem:
            res.altered += 1
            res.failures.append(Failure(case_id, case.kind, "forwarded wrong", problem))
        elif ans.headers.get("x-nightshift-route-prompt"):
            res.prompt_rewritten += 1


def start(folder: Path) -> tuple[Upstream, Proxy]:
    upstream = Upstream()
    proxy = Proxy(upstream.url, folder, ["--admin-token", TOKEN, "--upstream-api-key", UPSTREAM_KEY,
                                         "--max-body-bytes", str(LIMIT), "--read-timeout", "5",
                                         "--log-level", "info"]).start()
    prompt = {f"prompt:{_prompt_id(PROMPT)}": {"kind": "prompt", "candidate": _prompt_id(PROMPT_CANDIDATE),
                                               "system": PROMPT_CANDIDATE, "share": 0.5, "model": "tiny"}}
    for name, route in {**ROUTES, **prompt}.items():
        req = urllib.request.Request(f"{proxy.url}/nightshift/routes/{name}", data=json.dumps(route).encode(),
                                     method="PUT", headers={"Authorization": f"Bearer {TOKEN}"})
        urllib.request.urlopen(req, timeout=10).read()
    return upstream, proxy


def campaign(cases: int, seed: int = 1, folder: Path | None = None, progress: bool = True) -> Result:
    """`cases` cases against one proxy process; the result, with the log read at the end."""
    own = folder is None
    folder = Path(tempfile.mkdtemp(prefix="nightshift-route-fuzz-")) if own else folder
    res = Result()
    t0 = time.time()
    upstream, proxy = start(folder)
    try:
        it = range(cases)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, unit="case", desc="route fuzz", file=sys.stderr, mininterval=2)
        for i in it:
            run_case(upstream, proxy.port, case_for(seed, i), f"{seed}:{i}", res)
        res.healthy_after = proxy.healthy()
    finally:
        res.exit_code = proxy.stop()
        upstream.stop()
    log = proxy.log()
    res.tracebacks = log.count("Traceback") + log.count("--- Logging error ---")
    if res.tracebacks:
        i = log.find("Traceback")
        res.failures.append(Failure("log", "traceback", "a traceback in the proxy's log", log[max(0, i - 300):i + 1500]))
    res.wall_s = time.time() - t0
    if own and ok(res):
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return res


def ok(r: Result) -> bool:
    return not (r.server_errors or r.wrong_code or r.reached_upstream or r.not_forwarded or r.altered
                or r.tracebacks) and r.healthy_after and r.exit_code == 0


def report(r: Result) -> str:
    lines = [
        f"cases: {r.cases:,} ({r.wall_s:.0f} s, {r.cases / max(r.wall_s, 1e-9):,.0f} cases/s)",
        f"server errors (5xx the upstream did not answer, or no answer): {r.server_errors}",
        f"wrong status: {r.wrong_code}",
        f"refused requests that reached the upstream: {r.reached_upstream}; forwarded ones that did not: "
        f"{r.not_forwarded}; forwarded but altered: {r.altered}",
        f"tracebacks in the proxy's log: {r.tracebacks}",
        f"prompt cases rewritten to the candidate (and found right): {r.prompt_rewritten}",
        f"healthy afterwards: {r.healthy_after}; SIGTERM exit code: {r.exit_code}",
        "answers: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r.by_code.items())),
        "cases by generator: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r.by_kind.items())),
    ]
    for f in r.failures[:10]:
        lines.append(f"  FAILURE {f.case_id} {f.kind}: {f.what} {f.detail[:300]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--cases", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--replay", help="SEED:INDEX of one case: run it alone against a fresh proxy and print it")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--write-docs", action="store_true", help="put the figures into docs/RELIABILITY.md")
    args = ap.parse_args()
    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        case = case_for(seed, index)
        print(f"{case.kind}: expect {sorted(case.expect)}, reaches {case.reaches}, route {case.route!r}")
        print(repr(case.wire()[:1500]))
        with tempfile.TemporaryDirectory() as d:
            upstream, proxy = start(Path(d))
            res = Result()
            try:
                run_case(upstream, proxy.port, case, args.replay, res)
            finally:
                proxy.stop()
                upstream.stop()
            print(proxy.log()[-3000:])
        print(json.dumps([asdict(f) for f in res.failures], indent=1) if res.failures else "as expected")
        return 1 if res.failures else 0
    r = campaign(args.cases, args.seed)
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(r), indent=1))
    if args.write_docs:
        import docs

        docs.write_section("route-fuzz", docs.route_fuzz_section(asdict(r), args))
    return 0 if ok(r) else 1


if __name__ == "__main__":
    sys.exit(main())
