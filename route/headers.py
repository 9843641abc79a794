"""Which headers cross the proxy, each way.

To the upstream, an allow-list: the upstream trusts the proxy (it may hold
`upstream_api_key`, and uvicorn believes `X-Forwarded-For` from loopback by
default), so a client's header goes on only when the upstream needs it to answer:

    Content-Type, Accept            what the body is and what the client reads
    Authorization                   the client's, unless upstream_api_key replaces it: in front of a
                                    hosted API each agent's own key goes on as it came, byte for byte,
                                    and the proxy never logs or stores it (nor any header's value: a
                                    malformed one is logged by its name, server.why_malformed)
    traceparent, tracestate,        the agent's trace, so vLLM's own spans join it
    baggage
    X-Request-Id                    vLLM echoes it (--enable-request-id-headers)
    User-Agent                      for the upstream's logs

Not forwarded: Host (the upstream's own is sent), hop-by-hop headers, Cookie,
X-Forwarded-* / Forwarded / X-Real-IP (a client could pose as any address),
Accept-Encoding (the proxy reads a 404's body to tell a missing version, so
answers come uncompressed; vLLM does not compress anyway), the OpenAI client's
X-Stainless-* telemetry, Proxy-Authorization and this proxy's own
X-Nightshift-Route-Key. A body the client compressed (Content-Encoding) is
refused: the proxy reads bodies to route them.

To the client, everything the upstream answered except hop-by-hop headers,
Content-Length (recomputed), Set-Cookie (a cookie the upstream sets for its own
host would land on the proxy's) and any X-Nightshift-Route* header (only the
proxy says which version answered).
"""

from __future__ import annotations

from multidict import CIMultiDict

FORWARDED = frozenset((b"content-type", b"accept", b"authorization", b"traceparent", b"tracestate", b"baggage",
                       b"x-request-id", b"user-agent"))
SINGLE = frozenset((b"content-type", b"authorization", b"traceparent", b"content-encoding"))
_HOP = frozenset((b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
                  b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"))
_NOT_BACK = _HOP | {b"set-cookie"}


class HeaderError(ValueError):
    """A request whose headers the proxy will not forward; the message says why."""


def to_upstream(raw_headers, api_key: str) -> list[tuple[bytes, bytes]]:
    """The client's headers the upstream gets, as raw (name, value) pairs, or
    HeaderError for a body the proxy cannot read or a header given twice that must
    be given once (which of two Authorizations would the upstream believe?)."""
    seen: dict[bytes, int] = {}
    out = []
    for k, v in raw_headers:
        name = k.lower()
        seen[name] = seen.get(name, 0) + 1
        if name == b"content-encoding" and v.strip().lower() not in (b"", b"identity"):
            raise HeaderError(f"Content-Encoding {v[:40].decode('latin-1')!r}: send the body uncompressed "
                              "(the proxy reads it to route it)")
        if name in FORWARDED and not (api_key and name == b"authorization"):
            out.append((k, v))
    twice = sorted(n.decode("latin-1") for n, count in seen.items() if count > 1 and n in SINGLE)
    if twice:
        raise HeaderError(f"the request has more than one {', '.join(twice)} header; send one")
    if api_key:
        out.append((b"Authorization", b"Bearer " + api_key.encode()))
    return out


def to_client(raw_headers) -> CIMultiDict:
    """The upstream's answer headers the client gets (str, as aiohttp wants them)."""
    named = {h.strip().lower() for k, v in raw_headers if k.lower() == b"connection" for h in v.split(b",")}
    return CIMultiDict((k.decode("latin-1"), v.decode("utf-8", "replace")) for k, v in raw_headers
                       if (n := k.lower()) not in _NOT_BACK and n not in named
                       and not n.startswith(b"x-nightshift-route"))
