"""Prompt routes on the request path: which prompt route a request's system prompt
matches, and the body with the candidate's text in its place, every other byte as
the agent sent it.

The match is the id the lake names the prompt by (`schemas.prompt_identity.system_id`
of the leading system messages, per-request data folded by
`schemas.prompt_template`): the same code on both sides, or the route and
`nightshift prompts` would disagree on what the agent sends. Another agent, or this
agent once it changes its own prompt, hashes to another id and is not touched. The
candidate is a template too: the request's own values (today's date, the user's
name) go into its slots.

Only what can be rewritten without guessing is: the chat API's leading system (or
developer) messages with string contents, the Responses API's `instructions` (or
the leading system messages of its `input`). A body with two `messages` keys, a
system message whose content is a list of parts, both `instructions` and system
messages in `input`, or a candidate of several texts for a different number of
messages passes through unchanged, counted (`nightshift_route_prompt_skipped`) and
logged once per route and reason: an agent's request is never refused for a trial.

The candidate's answer is marked: `+p:<version id>` is appended to the `model`
the upstream answered with (`mark.py`), which every instrumentation records as the
response model, so the build knows which prompt the model saw even when the agent
sends no `traceparent` (docs/prompts.md, "Attribution"). The id is the one the
route was given with the candidate (`Route.version`: the trial's own), so the
watch joins marks and trials on one id by construction.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from json.decoder import scanstring

from nightshift.schemas.prompt_identity import SYSTEM_ROLES, canonical_tools, leading_system, system_id, version_id
from nightshift.schemas.prompt_template import SLOT, Template, fill, normalize

from .rewrite import DECODER, Body
from .table import Route

log = logging.getLogger("nightshift.route")

_WS = re.compile(r"[ \t\n\r]*")
_ALIGNED = re.compile(r"var(?:_\d+)?")  # the slots alignment names (schemas.prompt_template._name("var", ...))
ALIKE = 0.6  # share of words two prompts keep in common to be one agent's edit
MATCH_CHARS = 32768  # a longer system prompt is matched only when a route's own template is as long
ANCHOR = 8  # shortest literal piece of a route's template worth looking for before folding a prompt
CACHE = 1024  # distinct system prompts remembered with their id and values
CACHE_CHARS = 16384  # ... each at most this long: the cache holds at most 16 M characters, whatever agents send


class Ambiguous(ValueError):
    """A matched request whose prompt cannot be replaced without guessing; the
    message is the reason, the same words for every such request (a metric label)."""


@dataclass
class Seen:
    """What one prompt route has done since the proxy started (GET /nightshift/routes)."""

    matched: int = 0
    rewritten: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    changed: str | None = None  # a new prompt id seen for the route's model after it matched


@dataclass
class Match:
    route: Route
    name: str
    texts: list[str]  # the request's leading system texts, as sent
    values: dict[str, str]  # the per-request data in them, by slot


def _templates(route: Route) -> list[Template]:
    return [Template(t, tuple(s for s in dict.fromkeys(SLOT.findall(t)) if _ALIGNED.fullmatch(s)))
            for t in route.match_system]


def request_system(obj: dict) -> tuple[str, list[str]]:
    """(where, texts): the request's leading system texts and where they are
    (`messages`, `instructions` or `input`); ("", []) when it has none."""
    messages = obj.get("messages")
    if isinstance(messages, list):
        return "messages", leading_system([m if isinstance(m, dict) else {} for m in messages])
    instructions = obj.get("instructions")
    if isinstance(instructions, str):
        return "instructions", [instructions]
    inp = obj.get("input")
    if isinstance(inp, list):
        return "input", leading_system([m if isinstance(m, dict) else {} for m in inp])
    return "", []


class PromptRouter:
    """Matches requests to prompt routes and makes the candidate's edits; remembers
    the ids of the prompts it folded (`CACHE` of them), so a steady prompt costs a
    dict lookup, not a pattern scan."""

    def __init__(self) -> None:
        self.folded: OrderedDict[tuple[str, ...], tuple[list[str], dict[str, str], str]] = OrderedDict()
        self.versions: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.encoded: OrderedDict[tuple[str, ...], list[bytes]] = OrderedDict()  # candidates without slots
        self.seen: dict[str, Seen] = {}
        self.models: dict[str, set[str]] = {}  # a prompt route's model -> prompt ids asked with it
        self.logged: set[tuple[str, str]] = set()
        self.texts: dict[str, str] = {}  # a prompt route's match -> the first prompt it matched, folded
        self._anchored: tuple[object, list[str] | None, int] = (None, None, MATCH_CHARS)

    def _anchors(self, routes: dict[str, Route]) -> tuple[list[str] | None, int]:
        """Per table (the table replaces its dict on every change): each route's longest
        literal piece of text (None when a route gave no template, or one too short to
        look for), and the longest prompt worth folding."""
        if self._anchored[0] is not routes:
            anchors: list[str] | None = []
            longest = MATCH_CHARS
            for r in routes.values():
                longest = max(longest, 2 * sum(map(len, r.match_system)))
                pieces = [p.strip() for p in SLOT.split(r.match_system[0])[::2]] if r.match_system else []
                best = max(pieces, key=len, default="")
                if anchors is not None and len(best) >= ANCHOR:
                    anchors.append(best)
                else:
                    anchors = None
            self._anchored = (routes, anchors, longest)
        return self._anchored[1], self._anchored[2]

    def _worth_folding(self, texts: list[str], model: object, routes: dict[str, Route]) -> bool:
        """Whether a prompt could match a route, told without folding it (folding a
        prompt full of dates and numbers costs 0.5 ms a 2 KB, 8 ms at 16 KB, 190 ms at
        100 KB: on the request path only when it may matter). A prompt for a route's
        model is folded to notice that the agent changed it."""
        anchors, longest = self._anchors(routes)
        if sum(map(len, texts)) > longest:
            return False
        if anchors is None or (isinstance(model, str) and model in self.models):
            return True
        return any(a in texts[0] for a in anchors)

    def _fold(self, texts: list[str]) -> tuple[list[str], dict[str, str], str]:
        """The texts folded, their values and the id they hash to."""
        key = tuple(texts)
        got = self.folded.get(key)
        if got is None:
            norms, values = [], {}
            for t in texts:
                n, v = normalize(t)
                norms.append(n)
                for k, x in v.items():
                    values.setdefault(k, x)
            got = (norms, values, system_id(norms))
            if sum(map(len, texts)) <= CACHE_CHARS:
                self.folded[key] = got
                if len(self.folded) > CACHE:
                    self.folded.popitem(last=False)
        return got

    def find(self, body: Body, routes: dict[str, Route]) -> Match | None:
        """The prompt route this request's system prompt matches, or None."""
        where, texts = request_system(body.obj)
        if not texts or not self._worth_folding(texts, body.obj.get("model"), routes):
            return None
        norms, values, sid = self._fold(texts)
        route = routes.get(sid)
        if route is None:
            for r in routes.values():
                tpl = _templates(r) if any("{{var" in t for t in r.match_system) else []
                if len(tpl) != len(norms):
                    continue
                got = [t.match(n) for t, n in zip(tpl, norms)]
                if all(g is not None for g in got):
                    route, values = r, dict(values)  # the cached values stay as folded
                    for g in got:
                        for k, x in g.items():
                            values.setdefault(k, x)
                    break
        model = body.obj.get("model")
        if route is None:
            self._unmatched(sid, norms, model, routes)
            return None
        if isinstance(model, str) and route.model == model:
            self.models.setdefault(model, set()).add(sid)
            self.texts.setdefault(route.serving, "\n".join(norms))
        self.seen.setdefault(route.serving, Seen()).matched += 1
        return Match(route, "prompt:" + route.serving, texts, values)

    def _unmatched(self, sid: str, norms: list[str], model: object, routes: dict[str, Route]) -> None:
        """A prompt never seen for a prompt route's model, after the route matched
        that model's requests, and much like the one it matched: the agent's prompt
        has likely changed, and the trial no longer applies. Said once per route (the
        route itself rewrites nothing it does not match). Another agent's prompt on
        the same model is not alike, and says nothing."""
        if not isinstance(model, str) or model not in self.models:
            return
        known = self.models[model]
        if sid in known or len(known) > CACHE:
            return
        known.add(sid)
        text = "\n".join(norms)
        for r in routes.values():
            s = self.seen.get(r.serving)
            if r.model == model and s is not None and s.matched and s.changed is None \
                    and _alike(text, self.texts.get(r.serving, "")):
                s.changed = sid
                log_once(self, r, "changed", "prompt route prompt:%s%s: requests for %s now come with a system "
                         "prompt %s it does not match; if the agent changed its own prompt, the trial of %s no longer "
                         "applies (nothing is rewritten)", r.serving, f" (agent {r.agent})" if r.agent else "", model,
                         sid, r.candidate)

    def skip(self, m: Match, reason: str) -> None:
        s = self.seen[m.route.serving]
        s.skipped[reason] = s.skipped.get(reason, 0) + 1
        log_once(self, m.route, reason, "prompt route %s: a matched request passes through unchanged: %s (said once "
                 "for this route; counted in nightshift_route_prompt_skipped)", m.name, reason)

    def version(self, route: Route, body: Body) -> str:
        """The id a rewritten answer is marked with: the prompt version the route
        applies (`route.version`, the trial's `version_id`, sent with the route), so
        that the watch finds the trial's arm by that id and nothing else. The lake names
        a version by the tools the agent's spans record, which may be none (openai-v2),
        while the request carries them: a mark computed here from the request could then
        never be the trial's id. A route PUT without a version (before issue 27's
        attribution fix) is marked as it was: the candidate's texts with the request's
        tools."""
        if route.version:
            return route.version
        spans = body.spans.get("tools") or []
        raw = body.text[spans[0][0]:spans[0][1]] if len(spans) == 1 else ""
        key = (route.candidate or "", raw)
        vid = self.versions.get(key)
        if vid is None:
            tools = body.obj.get("tools")
            vid = self.versions[key] = version_id(list(route.system),
                                                   canonical_tools(tools if isinstance(tools, (list, str)) else None))
            if len(self.versions) > CACHE:
                self.versions.popitem(last=False)
        return vid

    def _encoded(self, m: Match) -> list[bytes]:
        """The candidate's texts filled with the request's values, as JSON strings; a
        candidate without slots is the same for every request, and encoded once."""
        system = m.route.system
        got = self.encoded.get(system)
        if got is not None:
            return got
        got = [json.dumps(fill(t, m.values)).encode() for t in system]
        if not any(SLOT.search(t) for t in system):
            self.encoded[system] = got
            if len(self.encoded) > CACHE:
                self.encoded.popitem(last=False)
        return got

    def edits(self, m: Match, body: Body) -> list[tuple[int, int, bytes]]:
        """The byte edits that put the candidate in the request, or Ambiguous."""
        where, _ = request_system(body.obj)
        if where == "instructions":
            if "input" in body.spans and any(_leading(body.obj.get("input"))):
                raise Ambiguous("the request has both `instructions` and system messages in `input`")
            (start, end), = _one(body, "instructions")
            filled = [fill(t, m.values) for t in m.route.system]
            return [(*body.byte_span(start, end), json.dumps("\n\n".join(filled)).encode())]
        filled = self._encoded(m)
        # the parsed body says how many leading system messages there are: the scan stops there
        items = _leading_items(body.text, _one(body, where)[0][0], len(m.texts))
        n = len(items)
        if n != len(m.texts):
            raise Ambiguous("the request's system messages could not be read where they were parsed")
        if len(filled) == n:
            return [(*body.byte_span(c0, c1), t) for (_, _, c0, c1), t in zip(items, filled)]
        if len(filled) == 1:
            (_, e0, c0, c1), (_, eN, _, _) = items[0], items[-1]
            return [(*body.byte_span(c0, c1), filled[0]), (*body.byte_span(e0, eN), b"")]
        raise Ambiguous(f"the candidate has {len(filled)} system texts for the request's {n} system messages")


def _alike(a: str, b: str) -> bool:
    """Two prompts that are one edited into the other (most words kept, in order),
    not two agents' prompts: another agent on the same model is not a change."""
    x, y = a.split(), b.split()
    m = difflib.SequenceMatcher(None, x, y, autojunk=False)
    return m.quick_ratio() >= ALIKE and m.ratio() >= ALIKE


def _leading(messages: object) -> list:
    if not isinstance(messages, list):
        return []
    return leading_system([m if isinstance(m, dict) else {} for m in messages])


def _one(body: Body, key: str) -> list[tuple[int, int]]:
    spans = body.spans.get(key) or []
    if len(spans) != 1:
        raise Ambiguous(f"the body has {len(spans)} top-level `{key}` keys")
    return spans


def _leading_items(text: str, i: int, limit: int) -> list[tuple[int, int, int, int]]:
    """(element start, element end, content start, content end) of each leading
    system message of the JSON array starting at text[i], at most `limit` of them
    (the parsed body's count: the element after them, a user's message with its
    history, need not be scanned). Ambiguous for one whose content is not a string
    or whose role or content is given twice."""
    ws, scan = _WS.match, DECODER.scan_once
    out: list[tuple[int, int, int, int]] = []
    i = ws(text, i + 1).end()
    while text[i:i + 1] == "{":
        start = i
        i = ws(text, i + 1).end()
        keys: dict[str, list[tuple[int, int, object]]] = {}
        if text[i:i + 1] == "}":
            i += 1
        else:
            while True:
                key, i = scanstring(text, i + 1, True)
                i = ws(text, ws(text, i).end() + 1).end()  # past the colon
                vstart = i
                value, i = scan(text, vstart)
                keys.setdefault(key, []).append((vstart, i, value))
                i = ws(text, i).end()
                c, i = text[i:i + 1], i + 1
                if c == "}":
                    break
                i = ws(text, i).end()
        roles = keys.get("role", [])
        role = roles[-1][2] if roles else None  # json.loads keeps the last of duplicate keys
        if role not in SYSTEM_ROLES:
            break
        contents = keys.get("content", [])
        if len(roles) != 1 or len(contents) != 1:
            raise Ambiguous("a system message gives its role or content more than once (or no content)")
        c0, c1, content = contents[0]
        if not isinstance(content, str):
            raise Ambiguous("a system message's content is a list of parts, not a text")
        out.append((start, i, c0, c1))
        if len(out) == limit:
            break
        i = ws(text, i).end()
        if text[i:i + 1] != ",":
            break
        i = ws(text, i + 1).end()
    return out


def log_once(router: PromptRouter, route: Route, reason: str, msg: str, *args) -> None:
    key = (route.serving + "\x00" + (route.candidate or ""), reason)
    if key in router.logged:
        return
    router.logged.add(key)
    log.warning(msg, *args)
