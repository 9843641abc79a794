"""Which paths the proxy forwards: the inference API agents call, matched on the
path as the upstream's router will read it, and nothing else.

The proxy stands between agents and vLLM, and vLLM's own routes include its
admin API: `/v1/load_lora_adapter` (any `lora_path` on its disk),
`/v1/unload_lora_adapter`, and in dev mode `/collective_rpc`, `/sleep`,
`/reset_prefix_cache`, ... (of which `--api-key` guards only the `/v1` ones). A
proxy that forwarded every path, adding `upstream_api_key`, would lend all of it
to anyone who can reach the proxy. So it forwards an allow-list:

    GET  /v1/models                     the OpenAI client's models.list(); agents check names
    POST /v1/chat/completions           the call agents make
    POST /v1/completions                the legacy text API (prompt in, text out)
    POST /v1/responses                  the Responses API (choose.py keys on its instructions/input)
    GET  /v1/responses/<id>             ... a background response, fetched
    POST /v1/responses/<id>/cancel      ... or cancelled
    POST /v1/embeddings                 the OpenAI client's embeddings.create()

Left out, each on purpose: vLLM's admin and dev routes (403: publishing talks to
vLLM directly at publish.vllm_url and never through the proxy, so nothing needs
them here, and the admin token is a credential to move traffic, not to load
files into vLLM); `/tokenize`, `/detokenize`, `/pooling`, `/score`, `/rerank`,
`/classify`, `/invocations`, `/v1/audio/*` and vLLM's `/health`, `/metrics`,
`/version` (404: not what an agent's OpenAI client calls; the proxy has its own
`/healthz` and `/metrics`). Adding a path is one line in FORWARDED.

The match is on the path the upstream's router (Starlette, behind uvicorn) would
route: percent-decoded once (`%5F` is `_`, `%2F` a separator), with empty and dot
segments resolved here, and case-sensitive as Starlette is. The query string takes
no part in the match. What goes upstream is the canonical path this produced, so
the upstream routes exactly what was checked, however the client spelled it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes, urlsplit

_ID = r"[A-Za-z0-9_.:-]{1,200}"

#: (method, path pattern, what it is): the inference API the proxy forwards.
FORWARDED: tuple[tuple[str, str, str], ...] = (
    ("GET", "/v1/models", "the served models"),
    ("POST", "/v1/chat/completions", "chat completions"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/responses", "the Responses API"),
    ("GET", f"/v1/responses/{_ID}", "a stored response"),
    ("POST", f"/v1/responses/{_ID}/cancel", "cancelling a background response"),
    ("POST", "/v1/embeddings", "embeddings"),
)
_FORWARDED = [(method, re.compile(pattern), what) for method, pattern, what in FORWARDED]
_EXACT: dict[str, list[str]] = {}  # the paths without an id: one lookup on the hot path
for _method, _pattern, _ in FORWARDED:
    if _ID not in _pattern:
        _EXACT.setdefault(_pattern, []).append(_method)

#: vLLM's routes that change or inspect the server (0.3x: serve/lora, serve/dev, rl, profiling,
#: elastic EP). Refused like any path outside FORWARDED; these get a 403 that says why.
ADMIN = frozenset((
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/collective_rpc", "/sleep", "/wake_up", "/is_sleeping",
    "/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache", "/pause", "/resume", "/is_paused",
    "/update_weights", "/init_weight_transfer_engine", "/update_weight_version", "/finish_weight_update",
    "/weight_info", "/weight_checker", "/get_world_size", "/start_profile", "/stop_profile", "/scale_elastic_ep",
    "/is_scaling_elastic_ep", "/server_info",
))

_UNSAFE_QUERY = re.compile(rb"[^\x21-\x7e]|#")
_PLAIN = re.compile(rb"[A-Za-z0-9/_.~@:!$&'()*+,;=-]*")


class PathError(ValueError):
    """A request target that cannot be read as a path; the message says why."""


@dataclass(frozen=True)
class Target:
    """A request's path, decoded and resolved (`path`), and its query string made
    safe to forward (`query`, without the `?`)."""

    path: str
    query: bytes = b""

    def upstream(self) -> bytes:
        """The request target sent to the upstream: the canonical path, re-encoded."""
        path = quote(self.path, safe="/@:!$&'()*+,;=-._~").encode()
        return path + (b"?" + self.query if self.query else b"")


def parse(raw: str) -> Target:
    """The request target as aiohttp gives it (`request.raw_path`: origin form, or
    absolute form whose host is ignored), or PathError."""
    data = raw.encode("utf-8", "surrogateescape")
    if not data.startswith(b"/"):
        parts = urlsplit(raw)
        if parts.scheme.lower() not in ("http", "https") or not parts.path.startswith("/"):
            raise PathError(f"the request target {raw[:80]!r} is not a path")
        data = (parts.path + ("?" + parts.query if parts.query else "")).encode("utf-8", "surrogateescape")
    path, _, query = data.partition(b"?")
    if b"//" not in path and b"/." not in path and _PLAIN.fullmatch(path) and not _UNSAFE_QUERY.search(query):
        return Target(path.decode().rstrip("/") or "/", query)  # what agents send: nothing to decode or resolve
    try:
        decoded = unquote_to_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise PathError("the path is not UTF-8 once percent-decoded") from None
    if any(ord(c) < 32 or c == "\x7f" for c in decoded):
        raise PathError("the path holds control characters once percent-decoded")
    segments: list[str] = []
    for seg in decoded.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if segments:
                segments.pop()
            continue
        segments.append(seg)
    query = _UNSAFE_QUERY.sub(lambda m: b"%%%02X" % m.group()[0], query)
    return Target("/" + "/".join(segments), query)


@dataclass(frozen=True)
class Verdict:
    """Whether a request may go upstream: `status` 0 when it may, else the status
    to answer with (403 admin, 404 unknown, 405 method) and the `message`."""

    status: int = 0
    message: str = ""
    allow: str = ""  # the methods the path takes, for a 405's Allow header


def judge(method: str, path: str) -> Verdict:
    """May `method path` (canonical) go to the upstream?"""
    methods = _EXACT.get(path) or [m for m, pattern, _ in _FORWARDED if pattern.fullmatch(path)]
    if method in methods:
        return Verdict()
    if methods:
        return Verdict(405, f"{method} {path}: this path takes {', '.join(methods)}", ", ".join(methods))
    if path.lower() in ADMIN:
        return Verdict(403, f"{path} is vLLM's admin API, which nightshift route does not forward: publishing "
                            "talks to vLLM directly (publish.vllm_url)")
    known = ", ".join(f"{m} {p.replace(_ID, '<id>')}" for m, p, _ in FORWARDED)
    return Verdict(404, f"{method} {path} is not an inference path nightshift route forwards (it forwards {known}; "
                        "its own: /healthz, /metrics, /nightshift/routes)")
