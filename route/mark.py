"""The candidate's answers say which prompt the model saw: `+p:<version id>` appended
to the `model` the upstream answered with (`support-agent@v0004+p:ab12cd34ef56`,
`gpt-4o-mini-2024-07-18+p:ab12cd34ef56`).

Why the answer and not a span of the route's own: the agent's instrumentation
records the response's `model` on the very span the build turns into a
transition (openai-v2 and OpenLLMetry as `gen_ai.response.model`, OpenInference
as `llm.model_name`), the way adapter versions are attributed (`name@vNNNN`), so
the attribution needs no `traceparent`, no exporter in the proxy and no join that
could miss. The build strips the mark back off (transform/attribution.py).

The cost is a scan of each streamed piece of a candidate's answer for its data
lines' first `"model":"..."` (only the candidate's: the agent's own prompt needs
no mark, its spans already say what the model saw). An unescaped `"model"` followed
by a colon can only be a key in valid JSON, so the scan needs no parser; lines are
held back until their newline, so a piece cut inside one is marked whole.
"""

from __future__ import annotations

import re

from .rewrite import read

MARK = "+p:"
_DATA_MODEL = re.compile(rb'^(data:[ \t]*[^\n]*?"model"[ \t]*:[ \t]*"(?:[^"\\\n]|\\.)*)"', re.M)
HOLD = 1 << 20  # a line longer than this without its newline goes out unmarked rather than held


def tag(version: str) -> bytes:
    return (MARK + version).encode()


def mark_body(answer: bytes, mark: bytes) -> bytes | None:
    """A JSON answer with `mark` appended to its top-level `model`, or None when it
    has no one string `model` to mark (not JSON, an error without one)."""
    try:
        body = read(answer)
    except RecursionError:
        return None
    if body is None or len(body.models) != 1 or not body.models[0][2]:
        return None
    _, end = body.model_span()
    return b"".join((answer[:end - 1], mark, answer[end - 1:]))


class StreamMarker:
    """Marks an event stream piece by piece: `feed` returns what may go out now,
    `flush` the rest at the end. `marked` counts the events marked."""

    def __init__(self, mark: bytes) -> None:
        self.mark = mark
        self.repl = rb"\1" + mark + b'"'
        self.rest = b""
        self.marked = 0
        self.seen: tuple[bytes, bytes] | None = None  # the first event's `"model": "x"` bytes, and marked

    def feed(self, piece: bytes) -> bytes:
        if not self.rest and piece[-1:] == b"\n":  # the common piece: whole events, nothing held back
            return self._mark(piece)
        data = self.rest + piece if self.rest else piece
        cut = data.rfind(b"\n") + 1
        if not cut:
            self.rest = b"" if len(data) > HOLD else data
            return data if len(data) > HOLD else b""
        self.rest = data[cut:]
        return self._mark(data[:cut] if self.rest else data)

    def flush(self) -> bytes:
        rest, self.rest = self.rest, b""
        return self._mark(rest)

    def _mark(self, block: bytes) -> bytes:
        """Every event of a stream names the same model, in the same bytes: once the
        first is found, the rest are a plain replace (a C loop, 20x cheaper than the
        pattern), and when it made as many marks as the block has `"model"` keys (each
        adds len(mark) bytes) nothing is left to look for; an event naming another
        model still goes through the pattern."""
        if self.seen is not None:
            out = block.replace(*self.seen)
            n = (len(out) - len(block)) // len(self.mark)
            self.marked += n
            if n == block.count(b'"model"'):
                return out
            block = out
        elif b'"model"' not in block:
            return block
        return _DATA_MODEL.sub(self._sub, block)

    def _sub(self, m: re.Match) -> bytes:
        head = m.group(1)
        if head.endswith(self.mark):  # marked by the replace already
            return m.group(0)
        if self.seen is None:
            at = head.rfind(b'"model"')
            self.seen = (head[at:] + b'"', head[at:] + self.mark + b'"')
        self.marked += 1
        return head + self.mark + b'"'
