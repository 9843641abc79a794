"""Redaction before the log write: matching string values are rewritten and listed
attribute keys dropped, so a redacted value never reaches the disk.

The walk over every attribute is costly, so each request is first screened as a
whole: the patterns, with their zero-width assertions removed (which can only add
matches), run over the request bytes decoded as UTF-8. Only requests that might
hold a match are walked; the walk applies the exact patterns value by value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .screen import compile_screen


def _luhn_ok(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = ord(ch) - 48
        if i % 2 == parity:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


#: Named rules users switch on with `redact.presets`.
PRESETS: dict[str, str] = {
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    "api_key": (
        r"\b(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{16,}"
        r"|\bAKIA[0-9A-Z]{16}\b|\bgh[pousr]_[A-Za-z0-9]{30,}\b|\bxox[abprs]-[A-Za-z0-9-]{10,}|\bAIza[0-9A-Za-z_-]{35}"
    ),
    "bearer": r"(?i:\bbearer\s+)[A-Za-z0-9._~+/-]{16,}=*",
    # Digits in groups, 13-19 in all; replaced only when the Luhn checksum holds.
    "credit_card": r"\b[0-9](?:[ -]?[0-9]){12,18}\b",
}
DEFAULT_PRESETS = ("api_key", "bearer")

#: For each preset, a pattern that every match of it also matches, run on the raw
#: request bytes by `screen` (Hyperscan or RE2: GB/s, where Python's `re` over a
#: whole request manages tens of MB/s). Plain syntax both engines accept.
PRESET_SCREENS: dict[str, str] = {
    # The presets without their \b (which can only add matches): selective, so
    # ordinary text ("task-based", "risk-free") does not send a request to the walk.
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}",
    "api_key": (
        r"(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_-]{16,}"
        r"|AKIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}|xox[abprs]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
    ),
    # Python's \s also takes Unicode spaces the engines' \s does not: screen the word.
    "bearer": r"(?i:bearer)",
    "credit_card": r"[0-9](?:[ -]?[0-9]){12,18}",
}


@dataclass
class Rule:
    name: str
    pattern: str
    replacement: str = ""

    def __post_init__(self) -> None:
        self.replacement = self.replacement or f"[REDACTED:{self.name}]"
        self.regex = re.compile(self.pattern)
        self.preset = PRESETS.get(self.name) == self.pattern
        self.screen = None if self.preset else _screen(self.pattern)
        self.luhn = self.preset and self.name == "credit_card"

    def apply(self, text: str) -> tuple[str, int]:
        if self.luhn:
            n = 0

            def sub(m: re.Match) -> str:
                nonlocal n
                span = _card_in(m.group(0))
                if span is None:
                    return m.group(0)
                n += 1
                a, b = span
                return m.group(0)[:a] + self.replacement + m.group(0)[b:]

            return self.regex.sub(sub, text), n
        return self.regex.subn(self.replacement, text)


def _card_in(text: str) -> tuple[int, int] | None:
    """The longest run of whole digit groups in `text` with 13-19 digits that passes
    Luhn (a card number followed by, say, an expiry date is still found)."""
    groups = [(m.start(), m.end()) for m in re.finditer(r"[0-9]+", text)]
    best = None
    for i in range(len(groups)):
        digits = ""
        for j in range(i, len(groups)):
            digits += text[groups[j][0] : groups[j][1]]
            if len(digits) > 19:
                break
            if len(digits) >= 13 and _luhn_ok(digits):
                if best is None or groups[j][1] - groups[i][0] > best[1] - best[0]:
                    best = (groups[i][0], groups[j][1])
    return best


def _screen(pattern: str) -> re.Pattern | None:
    """The pattern without anchors, word boundaries or lookarounds, or None if it
    cannot be rewritten (then every request is walked)."""
    try:
        from re import _compiler, _constants as C, _parser  # type: ignore[attr-defined]

        def strip(sub):
            data = []
            for op, av in sub.data:
                if op in (C.AT, C.ASSERT, C.ASSERT_NOT):
                    continue
                if op in (C.SUBPATTERN,):
                    av = (av[0], av[1], av[2], strip(av[3]))
                elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
                    av = (av[0], av[1], strip(av[2]))
                elif op is C.BRANCH:
                    av = (av[0], [strip(b) for b in av[1]])
                elif op in (C.ATOMIC_GROUP,):
                    av = strip(av)
                elif op in (C.GROUPREF_EXISTS, C.GROUPREF, getattr(C, "GROUPREF_IGNORE", None)):
                    raise ValueError("backreferences: screen by walking")
                data.append((op, av))
            sub.data = data
            return sub

        parsed = _parser.parse(pattern, 0)
        stripped = strip(parsed)
        if stripped is None:
            return None
        return _compiler.compile(stripped, 0)
    except Exception:  # private API moved, or an exotic construct
        return None


@dataclass
class Redactor:
    rules: list[Rule] = field(default_factory=list)
    drop_keys: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, presets, rules, drop_keys) -> "Redactor":
        out = []
        for name in presets or ():
            if name not in PRESETS:
                raise ValueError(f"unknown redaction preset {name!r}; known: {', '.join(sorted(PRESETS))}")
            out.append(Rule(name, PRESETS[name]))
        for r in rules or ():
            out.append(Rule(r["name"], r["pattern"], r.get("replacement", "")))
        return cls(out, frozenset(drop_keys or ()))

    def __post_init__(self) -> None:
        alternatives = [PRESET_SCREENS[r.name] for r in self.rules if r.preset]
        alternatives += [re.escape(k) for k in sorted(self.drop_keys)]
        self._screen = compile_screen(alternatives)
        self._custom = [r for r in self.rules if not r.preset]

    @property
    def enabled(self) -> bool:
        return bool(self.rules or self.drop_keys)

    def might_match(self, raw: bytes) -> bool:
        if self._screen is not None and self._screen(raw):
            return True
        if not self._custom:
            return False
        text = raw.decode("utf-8", "surrogateescape")
        return any(r.screen is None or r.screen.search(text) for r in self._custom)

    def redact_text(self, text: str) -> tuple[str, int]:
        n = 0
        for r in self.rules:
            text, k = r.apply(text)
            n += k
        return text, n

    # --- the walk -----------------------------------------------------------------------

    def _value(self, v) -> int:
        kind = v.WhichOneof("value")
        if kind == "string_value":
            new, n = self.redact_text(v.string_value)
            if n:
                v.string_value = new
            return n
        if kind == "array_value":
            return sum(self._value(x) for x in v.array_value.values)
        if kind == "kvlist_value":
            return self._attrs(v.kvlist_value.values)
        return 0

    def _attrs(self, kvs) -> int:
        n = 0
        if self.drop_keys:
            drop = [i for i, kv in enumerate(kvs) if kv.key in self.drop_keys]
            for i in reversed(drop):
                del kvs[i]
            n += len(drop)
        for kv in kvs:
            n += self._value(kv.value)
        return n

    def _text_field(self, msg, name: str) -> int:
        new, n = self.redact_text(getattr(msg, name))
        if n:
            setattr(msg, name, new)
        return n

    def redact(self, signal: str, req, raw: bytes) -> int:
        """Redacts `req` in place; returns how many values were changed or dropped."""
        if not self.enabled or not self.might_match(raw):
            return 0
        n = 0
        if signal == "traces":
            for rs in req.resource_spans:
                n += self._attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    n += self._attrs(ss.scope.attributes)
                    for s in ss.spans:
                        n += self._attrs(s.attributes) + self._text_field(s, "name")
                        n += self._text_field(s.status, "message")
                        for ev in s.events:
                            n += self._attrs(ev.attributes) + self._text_field(ev, "name")
                        for link in s.links:
                            n += self._attrs(link.attributes)
        elif signal == "logs":
            for rl in req.resource_logs:
                n += self._attrs(rl.resource.attributes)
                for sl in rl.scope_logs:
                    n += self._attrs(sl.scope.attributes)
                    for r in sl.log_records:
                        n += self._attrs(r.attributes) + self._value(r.body)
                        n += self._text_field(r, "severity_text") + self._text_field(r, "event_name")
        return n
