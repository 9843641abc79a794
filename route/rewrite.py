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
from dataclasses import dataclass, field
from json.decoder import scanstring

_WS = re.compile(r"[ \t\n\r]*")


class RewriteError(ValueError):
    """A body whose `model` cannot be replaced safely; the message says why."""


def _big_int(text: str) -> int | str:
    """Integers past Python's 4,300 digits read as their text: valid JSON, which the
    proxy reads only for `model` and the sticky key, and passes on as sent."""
    return int(text) if len(text) < 4300 else text


DECODER = json.JSONDecoder(parse_int=_big_int)


@dataclass
class Body:
    """A request body read as a JSON object: `obj` as json.loads would give it (the
    last of duplicate keys kept), and where each top-level `model` value lies."""

    obj: dict
    text: str
    ascii: bool  # one byte per character: text offsets are byte offsets
    models: list[tuple[int, int, bool]]  # (start, end) in `text` and whether it is a string
    spans: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # WATCHED keys' values in `text`

    def byte_span(self, start: int, end: int) -> tuple[int, int]:
        """A span of `text` as a span of the body's bytes."""
        if self.ascii:
            return start, end
        first = len(self.text[:start].encode())
        return first, first + len(self.text[start:end].encode())

    def model_span(self) -> tuple[int, int]:
        """The byte span of the one top-level `model`'s string value, quotes included."""
        if len(self.models) != 1:
            raise RewriteError(f"the body has {len(self.models)} top-level `model` keys; send one")
        start, end, is_string = self.models[0]
        if not is_string:
            raise RewriteError("the body's top-level `model` is not a string")
        return self.byte_span(start, end)


#: Top-level keys whose value's place is kept besides `model`'s: where a prompt route
#: finds the system prompt (chat's `messages`, the Responses API's `instructions` and
#: `input`) and the tools that name its version.
WATCHED = frozenset(("messages", "instructions", "input", "tools"))


def read(body: bytes) -> Body | None:
    """The body as a JSON object, or None when it is not one (not UTF-8, not JSON,
    not an object: the upstream answers it as sent). RecursionError when it nests
    deeper than Python's parser goes. One pass: the top level walked here, each
    value parsed by json's own C scanner, which also says where the value ends."""
    if body[:1] not in (b"{", b" ", b"\n", b"\r", b"\t"):
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return None
    ws, scan = _WS.match, DECODER.scan_once
    obj: dict = {}
    models: list[tuple[int, int, bool]] = []
    spans: dict[str, list[tuple[int, int]]] = {}
    try:
        i = ws(text, 0).end()
        if text[i:i + 1] != "{":
            return None
        i = ws(text, i + 1).end()
        if text[i:i + 1] == "}":
            i += 1
        else:
            while True:
                if text[i:i + 1] != '"':
                    return None
                key, i = scanstring(text, i + 1, True)
                i = ws(text, i).end()
                if text[i:i + 1] != ":":
                    return None
                start = ws(text, i + 1).end()
                value, i = scan(text, start)
                if key == "model":
                    models.append((start, i, isinstance(value, str)))
                elif key in WATCHED:
                    spans.setdefault(key, []).append((start, i))
                obj[key] = value
                i = ws(text, i).end()
                c, i = text[i:i + 1], i + 1
                if c == "}":
                    break
                if c != ",":
                    return None
                i = ws(text, i).end()
        if ws(text, i).end() != len(text):
            return None
    except (ValueError, StopIteration):  # JSONDecodeError, or the scanner's "no value here"
        return None
    return Body(obj, text, len(text) == len(body), models, spans)


def with_model(body: bytes, span: tuple[int, int], model: str) -> bytes:
    """`body` with the value at `span` replaced by `model`, as a JSON string."""
    start, end = span
    return b"".join((body[:start], json.dumps(model).encode(), body[end:]))


def edited(body: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    """`body` with each (start, end) byte span replaced by its bytes; the spans do not overlap."""
    parts, last = [], 0
    for start, end, data in sorted(edits):
        parts += [body[last:start], data]
        last = end
    parts.append(body[last:])
    return b"".join(parts)
