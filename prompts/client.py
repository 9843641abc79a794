"""The proposer's HTTP client: one OpenAI-compatible chat completion at a time, over
the standard library's `http.client` (TLS for hosted APIs), with a timeout per
try, retries where a retry can help, and an answer checked to be a chat completion.

Its calls never enter the lake as agent traffic. It sends no `traceparent` (its
headers are written here, and only these), and it creates no OpenTelemetry span:
under `opentelemetry-instrument` every call runs with the instrumentation
suppression flags set, which the HTTP client instrumentations honour, and it uses
neither `openai` nor `httpx`/`requests`/`urllib`, which GenAI and HTTP
instrumentations patch. The key comes from the environment variable
`apo.api_key_env` names, is sent as a Bearer token, and is scrubbed from every
message this module raises (an API's 401 may echo part of it).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("nightshift.apo")

RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)
MAX_ANSWER_BYTES = 4 << 20
MAX_WAIT = 30.0


class ProposerError(RuntimeError):
    """A proposer call that gave nothing usable: one sentence saying what happened."""


@dataclass
class Endpoint:
    base_url: str
    model: str
    api_key_env: str = ""
    timeout: float = 120.0
    retries: int = 2
    temperature: float = 1.0
    max_tokens: int = 4096
    max_answer_bytes: int = MAX_ANSWER_BYTES

    def key(self) -> str | None:
        if not self.api_key_env:
            return None
        value = os.environ.get(self.api_key_env, "")
        if not value:
            raise ProposerError(f"apo.api_key_env names {self.api_key_env}, which is not set in the environment")
        return value

    def record(self) -> dict:
        """What a manifest keeps of the proposer: never the key, never credentials in the URL."""
        return {"base_url": safe_url(self.base_url), "model": self.model, "api_key_env": self.api_key_env or None,
                "temperature": self.temperature, "max_tokens": self.max_tokens, "timeout": self.timeout,
                "retries": self.retries}


def safe_url(url: str) -> str:
    """The URL without user:password@ and without its query (`?api-key=` is how some
    gateways take a key)."""
    p = urlsplit(url)
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


@dataclass
class Reply:
    content: str
    model: str | None = None
    usage: dict = field(default_factory=dict)
    attempts: int = 1


@contextlib.contextmanager
def untraced():
    """OpenTelemetry's suppression flags on for the duration (a no-op without the API)."""
    try:
        from opentelemetry import context
    except ImportError:
        yield
        return
    ctx = context.get_current()
    for name in ("_SUPPRESS_INSTRUMENTATION_KEY", "_SUPPRESS_HTTP_INSTRUMENTATION_KEY"):
        key = getattr(context, name, None)
        if key is not None:
            ctx = context.set_value(key, True, ctx)
    ctx = context.set_value("suppress_instrumentation", True, ctx)  # the older instrumentations' plain key
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def _scrub(text: str, key: str | None) -> str:
    if key:
        text = text.replace(key, "***")
        if len(key) > 12:  # "sk-abc...wxyz": a masked echo still should not land in a log
            text = text.replace(key[:8], "***").replace(key[-4:], "***")
    return text


def _target(base_url: str) -> tuple[str, str, int | None, str]:
    p = urlsplit(base_url)
    path = p.path.rstrip("/")
    if not path.endswith("/chat/completions"):
        path += "/chat/completions"
    return p.scheme, p.hostname or "", p.port, path


def _content(body: bytes, where: str) -> tuple[str, dict]:
    """The text of the first choice, or ProposerError saying what came back instead."""
    snippet = body[:200].decode("utf-8", "replace").replace("\n", " ")
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ProposerError(f"{where} answered something that is not JSON: {snippet!r}") from None
    try:
        choice = doc["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ProposerError(f"{where} answered JSON that is not a chat completion (no choices[0].message): "
                            f"{snippet!r}") from None
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        why = message.get("refusal") if isinstance(message, dict) else None
        reason = choice.get("finish_reason") if isinstance(choice, dict) else None
        raise ProposerError(f"{where} answered with no text" + (f" (refused: {why})" if why else "")
                            + (f" (finish reason {reason})" if reason else ""))
    return content, doc


def chat(endpoint: Endpoint, messages: list[dict], *, sleep=None) -> Reply:
    """One chat completion. Retries (up to `endpoint.retries`) a timeout, a refused or
    dropped connection, and 408/409/429/5xx, waiting 1, 2, 4 ... s (or the answer's
    Retry-After, at most 30 s); anything else is a ProposerError at once."""
    key = endpoint.key()
    scheme, host, port, path = _target(endpoint.base_url)
    where = f"the proposer at {safe_url(endpoint.base_url)}"
    body = json.dumps({"model": endpoint.model, "messages": messages, "temperature": endpoint.temperature,
                       "max_tokens": endpoint.max_tokens}).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json", "User-Agent": "nightshift-apo"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    last = ""
    for attempt in range(endpoint.retries + 1):
        wait = min(2.0 ** attempt, MAX_WAIT)
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=endpoint.timeout,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(host, port, timeout=endpoint.timeout)
        try:
            with untraced():
                conn.request("POST", path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read(endpoint.max_answer_bytes + 1)
            status = resp.status
        except (socket.timeout, TimeoutError):
            last = f"{where} did not answer within {endpoint.timeout:g} s"
        except (ConnectionError, OSError, http.client.HTTPException) as e:
            last = f"{where} could not be reached: {type(e).__name__}: {_scrub(str(e), key)}"
        else:
            if len(data) > endpoint.max_answer_bytes:
                raise ProposerError(f"{where} answered more than {endpoint.max_answer_bytes:,} bytes: not a prompt")
            if status == 200:
                content, doc = _content(data, where)
                return Reply(_scrub(content, key), doc.get("model"), doc.get("usage") or {}, attempt + 1)
            text = _scrub(data[:300].decode("utf-8", "replace").replace("\n", " "), key)
            last = f"{where} answered HTTP {status}: {text}"
            if status not in RETRY_STATUS:
                raise ProposerError(last)
            after = resp.getheader("Retry-After")
            if after and after.strip().replace(".", "", 1).isdigit():
                wait = min(float(after), MAX_WAIT)
        finally:
            conn.close()
        if attempt < endpoint.retries:
            log.warning("%s; retrying in %.0f s (%d of %d)", last, wait, attempt + 1, endpoint.retries)
            (sleep or time.sleep)(wait)
    raise ProposerError(last + (f" (after {endpoint.retries + 1} tries)" if endpoint.retries else ""))
