"""The one change the proxy makes to a request: the value of the body's top-level
`model`, replaced in the raw bytes. Everything else reaches the upstream byte for
byte: re-serializing the parsed body would turn a valid `1e400` into `Infinity`
(not JSON), reorder nothing but still rewrite escapes and whitespace, and hand
the upstream a body the client never sent.

Only the top level counts (a `model` inside `metadata` or a tool's schema is the
client's), keys are compared decoded (`"mod\\u0065l"` is `model`), and a body
with two top-level `model` keys is refused: the proxy would route on one while
the upstream's parser, on its own rule, might read the other.
"""

from __future__ import annotations

import json
import re

# A JSON string (escapes skipped whole), or one structural character. Numbers,
# literals and whitespace fall between tokens: the body was parsed before this runs.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]', re.DOTALL)
_OPEN, _CLOSE, _COMMA, _COLON, _QUOTE = b"{[", b"}]", ord(","), ord(":"), ord('"')


class RewriteError(ValueError):
    """A body whose `model` cannot be replaced safely; the message says why."""


def _is_model(key: bytes) -> bool:
    if key == b'"model"':
        return True
    return b"\\" in key and json.loads(key) == "model"


def model_span(body: bytes) -> tuple[int, int]:
    """Where the top-level `model`'s string value lies in `body` (a JSON object
    already known to parse, whose `model` is a string), quotes included."""
    depth, want_key, key_is_model, after_colon = 0, False, False, False
    spans: list[tuple[int, int] | None] = []
    for m in _TOKEN.finditer(body):
        c = body[m.start()]
        if after_colon:  # the token right after a top-level `"model":`
            after_colon = False
            spans.append(m.span() if c == _QUOTE else None)
        if c == _QUOTE:
            if depth == 1 and want_key:
                want_key, key_is_model = False, _is_model(m.group())
        elif c in _OPEN:
            depth += 1
            want_key = depth == 1 and c == ord("{")
        elif c in _CLOSE:
            depth -= 1
        elif depth == 1:
            if c == _COMMA:
                want_key = True
            elif c == _COLON and key_is_model:
                key_is_model, after_colon = False, True
    if len(spans) != 1:
        raise RewriteError(f"the body has {len(spans)} top-level `model` keys; send one")
    if spans[0] is None:
        raise RewriteError("the body's top-level `model` is not a string")
    return spans[0]


def with_model(body: bytes, span: tuple[int, int], model: str) -> bytes:
    """`body` with the value at `span` replaced by `model`, as a JSON string."""
    start, end = span
    return b"".join((body[:start], json.dumps(model).encode(), body[end:]))
