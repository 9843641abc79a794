"""Per-request data inside a system prompt, folded out so that one template gets one
hash.

Agents often render their system prompt per request: today's date, the user's
name, an account id. Hashed raw, every request would be a new "prompt version"
and nothing could be learned or compared. Two steps fold such data into `{{slot}}`
markers:

1. Known kinds, by pattern, in one pass (`normalize`): dates (ISO, 24/11/2026,
   "Monday, 24 November 2026", "Nov 24, 2026"), date-times, clock times, UUIDs,
   hex ids of 16+ digits, e-mail addresses, digit runs of 6+ (order, phone and
   account numbers). Small numbers stay: "use at most 3 tools" is an instruction.
2. Anything else that varies (names, cities, plan tiers), by alignment across the
   agent's prompts (`infer`): prompts that are the same text but for a few short
   spans (at most `MAX_SPANS` of them, each at most `MAX_SPAN_TOKENS` words and
   `MAX_SPAN_CHARS` characters, on one line, the common text at least half of the
   longer prompt) are one template, and each differing span that took at least
   `MIN_VALUES` different values becomes a slot. Two values are not enough: a
   developer who changed "briefly" to "politely" made two versions, not a slot.

What it does not detect, said so in `nightshift prompts`' help: a value seen in
only one or two distinct prompts (a slot appears once three values were seen, and
the template's hash changes that once); per-request text longer than a line or
than `MAX_SPAN_CHARS` (a retrieved document, a user profile pasted in): such an
agent shows many versions with one call each; data whose span moves between
requests. Slots are matched back on new requests by the template's literal text
(`Template.match`), which is what a router needs to recognise a prompt from one
request (no polars here, nothing but the standard library). In schemas/ beside
`prompt_identity`: the route folds a request's prompt with the same code the lake
used to name it, or the two would disagree on its id.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

#: A slot in a template: `{{date}}`, `{{var_2}}`. The agent's own unrendered
#: placeholders (`{{user}}` left in by a template engine) are slots too: kept as they are.
SLOT = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}")

_MONTHS = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
           r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_DAYS = r"(?:Mon|Tue(?:s)?|Wed(?:nes)?|Thu(?:rs)?|Fri|Sat(?:ur)?|Sun)(?:day)?"
#: Kinds in the order they are tried at a position (a date-time before its date).
KINDS: tuple[tuple[str, str], ...] = (
    ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    ("datetime", r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?(?:Z|UTC|[+-]\d{2}:?\d{2}))?(?![\w:])"),
    ("date", rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
             rf"|\b(?:{_DAYS},?\s+)?(?:\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTHS}\.?,?\s+\d{{4}}"
             rf"|{_MONTHS}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}})\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:UTC|GMT))?(?![\w:])"),
    ("email", r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"),
    ("id", r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{16,}\b"),
    ("number", r"(?<![\w.])\d{6,}(?![\w.])"),
)
_KIND_RE = re.compile("|".join(f"(?P<{k}>{p})" for k, p in KINDS))
_KIND_RE_NO_AT = re.compile("|".join(f"(?P<{k}>{p})" for k, p in KINDS if k != "email"))  # a text without @
_TOKEN = re.compile(r"\w+|\s+|[^\w\s]")
_WORD = re.compile(r"\b\w+")

MAX_SPANS = 4
MAX_SPAN_TOKENS = 8  # words, spaces and punctuation: "Mary Jane" is 3
MAX_SPAN_CHARS = 60
MIN_VALUES = 3
#: distinct prompts aligned at most per agent (most frequent first); the rest are
#: matched against the templates found, which is cheap
MAX_ALIGNED = 400


def _name(kind: str, used: set[str], last: dict[str, int] | None = None) -> str:
    """The first of kind, kind_2, kind_3... not in `used` (added to it). `last`: where
    each kind's search stopped before, for a caller naming many (names are only ever
    added, so the first free one is never below it): a prompt with thousands of dates
    cost a scan from kind_1 for each, quadratic."""
    n = last.get(kind, 1) if last is not None else 1
    name = kind if n == 1 else f"{kind}_{n}"
    while name in used:
        n += 1
        name = f"{kind}_{n}"
    used.add(name)
    if last is not None:
        last[kind] = n
    return name


def _digits(text: str) -> list[int]:
    """Where the ASCII digits are, by `str.find` (a memchr per digit: ten scans of a
    prompt cost less than one pass of a pattern over it). Other digits (Arabic-Indic,
    fullwidth) are not per-request data any pattern here matches."""
    out = []
    for d in "0123456789":
        i = text.find(d)
        while i >= 0:
            out.append(i)
            i = text.find(d, i + 1)
    return sorted(out)


#: how far before a token with a digit a known kind can start ("Wednesday, September
#: 24th") and after it end ("3:05 pm UTC"); whole tokens are added on both sides.
#: Every kind but an e-mail address holds a digit.
_BEFORE, _AFTER = 24, 12


_SPACE = re.compile(r"[ \n\t]")


def _space_before(text: str, i: int) -> int:
    return max(text.rfind(" ", 0, i), text.rfind("\n", 0, i), text.rfind("\t", 0, i)) + 1 if i > 0 else 0


def _space_after(text: str, i: int) -> int:
    ends = [e for e in (text.find(" ", i), text.find("\n", i), text.find("\t", i)) if e >= 0]
    return min(ends) if ends else len(text)


def _regions(text: str) -> list[tuple[int, int]]:
    """Where a known kind can be: around the digits, widened to whole tokens (all of
    the text when it has an @). Most of a prompt is words: the patterns run on a
    fraction of it (a 940-character prompt with a name and a date: 4x faster)."""
    if "@" in text:
        return [(0, len(text))]
    out: list[list[int]] = []
    n = len(text)
    token_end = -1
    # where the whitespace is, found once: `_space_before`/`_space_after` search for each
    # digit's token, and a newline far away (or none) made each search run to the text's
    # end: quadratic on a long prompt full of numbers (100 KB: 190 ms)
    spaces = [m.start() for m in _SPACE.finditer(text)]

    def before(i: int) -> int:
        k = bisect.bisect_left(spaces, i)
        return spaces[k - 1] + 1 if i > 0 and k else 0

    def after(i: int) -> int:
        k = bisect.bisect_left(spaces, i)
        return spaces[k] if k < len(spaces) else n

    for pos in _digits(text):
        if pos < token_end:  # another digit of the token just taken
            continue
        token_start, token_end = before(pos), after(pos)
        b = after(min(n, token_end + _AFTER))
        if out and token_start < out[-1][1]:  # inside the last region: it may reach further
            out[-1][1] = max(out[-1][1], b)
            continue
        a = before(max(0, token_start - _BEFORE))
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def normalize(text: str) -> tuple[str, dict[str, str]]:
    """`text` with each known kind of per-request value replaced by a `{{kind}}` slot
    (`{{date_2}}` for the second date), and the values taken out, by slot."""
    used = set(SLOT.findall(text)) if "{{" in text else set()
    counters: dict[str, int] = {}
    values: dict[str, str] = {}
    parts, last = [], 0
    kinds = _KIND_RE if "@" in text else _KIND_RE_NO_AT
    for a, b in _regions(text):
        pos = a
        while (w := _WORD.search(text, pos, b)) is not None:  # every kind starts a word
            m = kinds.match(text, w.start(), b)
            if m is None:
                pos = w.end()
                continue
            name = _name(m.lastgroup or "value", used, counters)
            values[name] = m.group(0)
            parts += [text[last:m.start()], "{{" + name + "}}"]
            last = pos = m.end()
    return "".join(parts) + text[last:], values


@dataclass(frozen=True)
class Template:
    """A normalized prompt with slots where requests put their own values. `slots`:
    the ones alignment found (`var`, `var_2`, ...), matched by `match`; the known
    kinds are already folded by `normalize` before any match."""

    text: str
    slots: tuple[str, ...] = ()
    values_seen: dict = field(default_factory=dict, compare=False, hash=False)  # slot -> distinct values seen

    def match(self, normalized: str) -> dict[str, str] | None:
        """The values of this template's alignment slots in `normalized` (a text
        through `normalize`), or None when it is not this template."""
        if not self.slots:
            return {} if normalized == self.text else None
        m = _pattern(self.text, self.slots).fullmatch(normalized)
        return None if m is None else dict(zip(self.slots, m.groups()))


_PATTERNS: dict[tuple[str, tuple[str, ...]], re.Pattern] = {}


def _pattern(text: str, slots: tuple[str, ...]) -> re.Pattern:
    key = (text, slots)
    if key not in _PATTERNS:
        wanted = set(slots)
        parts, last = [], 0
        for m in SLOT.finditer(text):
            if m.group(1) in wanted:
                parts.append(re.escape(text[last:m.start()]))
                parts.append(f"([^\\n]{{1,{MAX_SPAN_CHARS}}}?)")
                last = m.end()
        parts.append(re.escape(text[last:]))
        if len(_PATTERNS) > 4096:
            _PATTERNS.clear()
        _PATTERNS[key] = re.compile("".join(parts), re.DOTALL)
    return _PATTERNS[key]


def fill(template: str, values: dict[str, str]) -> str:
    """A template with its slots replaced by `values`; a slot without a value stays
    as it is (the agent's own placeholder, which it fills itself)."""
    return SLOT.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def placeholders(text: str) -> list[str]:
    """The slots of a template, in order of first appearance."""
    return list(dict.fromkeys(SLOT.findall(text)))


# --- alignment ----------------------------------------------------------------------------


_ANCHOR = 4  # tokens that must agree after a differing span for the two texts to be back in step


def _in_step(a: list[str], i: int, b: list[str], j: int) -> bool:
    k = min(_ANCHOR, len(a) - i, len(b) - j)
    if k < _ANCHOR and (len(a) - i != k or len(b) - j != k):
        return False  # near an end, both must end together
    return a[i:i + k] == b[j:j + k]


def _spans(a: list[str], b: list[str]) -> list[tuple[int, int, int, int]] | None:
    """The differing spans of two token lists when they are one template's renderings
    (only replacements, few, short, on one line, the common text the larger part), else None.

    One pass, no general diff: at each difference, the nearest pair of skips (at most
    MAX_SPAN_TOKENS each side) after which ANCHOR tokens agree again. Linear in the
    prompt's length, where difflib's alignment was quadratic on repetitive prompts
    (15 ms a pair on a 900-character one)."""
    la, lb = sum(map(len, a)), sum(map(len, b))
    if not la or not lb or abs(la - lb) > max(la, lb) * 0.5:
        return None
    i = j = same = 0
    spans: list[tuple[int, int, int, int]] = []
    n, m = len(a), len(b)
    while i < n and j < m:
        if a[i] == b[j]:
            same += len(a[i])
            i, j = i + 1, j + 1
            continue
        step = None
        for total in range(2, 2 * MAX_SPAN_TOKENS + 1):
            for di in range(max(1, total - MAX_SPAN_TOKENS), min(total - 1, MAX_SPAN_TOKENS) + 1):
                if i + di <= n and j + total - di <= m and _in_step(a, i + di, b, j + total - di):
                    step = (di, total - di)
                    break
            if step:
                break
        if step is None:
            return None
        ta, tb = "".join(a[i:i + step[0]]), "".join(b[j:j + step[1]])
        if (max(len(ta), len(tb)) > MAX_SPAN_CHARS or "\n" in ta or "\n" in tb or "{{" in ta or "{{" in tb
                or len(spans) == MAX_SPANS):
            return None
        spans.append((i, i + step[0], j, j + step[1]))
        i, j = i + step[0], j + step[1]
    if i < n or j < m or not spans or same < max(la, lb) * 0.5 or same < 16:
        return None
    return spans


def _template(rep: list[str], members: list[list[str]]) -> Template | None:
    """The template of a cluster: the representative's differing ranges that took at
    least MIN_VALUES values become slots; None when none did."""
    ranges: list[list[int]] = []
    for m in members:
        for i1, i2, _, _ in _spans(rep, m) or ():
            ranges.append([i1, i2])
    ranges.sort()
    merged: list[list[int]] = []
    for r in ranges:
        if merged and r[0] <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], r[1])
        else:
            merged.append(r)
    # the value each member puts in each merged range: the representative's tokens there,
    # with the member's replacements (each inside one merged range) put in
    values: list[set[str]] = [{"".join(rep[a:b])} for a, b in merged]
    for m in members:
        subs = _spans(rep, m) or []
        for k, (a, b) in enumerate(merged):
            inside = [s for s in subs if a <= s[0] and s[1] <= b]
            if not inside:
                continue
            parts, pos = [], a
            for i1, i2, j1, j2 in inside:
                parts += rep[pos:i1] + m[j1:j2]
                pos = i2
            values[k].add("".join(parts + rep[pos:b]))
    keep = [k for k, v in enumerate(values) if len(v) >= MIN_VALUES]
    if not keep:
        return None
    used = set(SLOT.findall("".join(rep)))
    out, last, slots, seen = [], 0, [], {}
    for k in keep:
        a, b = merged[k]
        out.append("".join(rep[last:a]))
        name = _name("var", used)
        out.append("{{" + name + "}}")
        slots.append(name)
        seen[name] = len(values[k])
        last = b
    out.append("".join(rep[last:]))
    return Template("".join(out), tuple(slots), seen)


def infer(texts: Iterable[str] | Counter, max_aligned: int = MAX_ALIGNED) -> list[Template]:
    """Templates for a set of normalized prompts (one agent's, one message position),
    the most frequent first. A prompt no template covers is its own (no slots).
    Deterministic for a given set of prompts: ordered by frequency, then text."""
    counts = texts if isinstance(texts, Counter) else Counter(texts)
    pending = sorted(counts, key=lambda t: (-counts[t], t))
    aligned, rest = pending[:max_aligned], pending[max_aligned:]
    out: list[Template] = []
    while aligned:
        rep_text = aligned[0]
        rep = _TOKEN.findall(rep_text)
        members = [_TOKEN.findall(t) for t in aligned[1:]]
        close = [m for m in members if _spans(rep, m)]
        tpl = _template(rep, close) if len(close) + 1 >= MIN_VALUES else None
        if tpl is None:
            out.append(Template(rep_text))
            aligned = aligned[1:]
            continue
        out.append(tpl)
        aligned = [t for t in aligned[1:] if tpl.match(t) is None]
    templated = [t for t in out if t.slots]
    for text in rest:
        if not any(t.match(text) is not None for t in templated):
            out.append(Template(text))
    return out


def resolve(text: str, templates: list[Template]) -> tuple[str, dict[str, str]]:
    """One request's prompt as (its template's text, the values it put in the slots):
    known kinds folded, then the first template whose literal text it matches."""
    norm, values = normalize(text)
    for t in templates:
        if t.slots:
            got = t.match(norm)
            if got is not None:
                return t.text, {**values, **got}
    return norm, values


def templated(normalized: str, templates: list[Template]) -> str:
    """The template text of an already normalized prompt (`resolve` without the values)."""
    for t in templates:
        if t.slots and t.match(normalized) is not None:
            return t.text
    return normalized
