"""Redaction: presets, custom rules, dropped keys, the walk over every value, and the
whole-request screen that must never miss a value the exact rules would change."""

from __future__ import annotations

import random
import re
import string

import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from nightshift.collector.redact import DEFAULT_PRESETS, PRESETS, Redactor, Rule, _luhn_ok

VISA = "4111111111111111"  # Luhn-valid test numbers
MASTERCARD = "5555 5555 5555 4444"
AMEX = "3782-822463-10005"


def presets(*names: str) -> Redactor:
    return Redactor.from_config(list(names), [], [])


# --- presets and rules ------------------------------------------------------------------------


def test_email_preset():
    r = presets("email")
    out, n = r.redact_text("mail jane.doe+tag@mail.example.co.uk or bob@host.io, not @handle or a@b")
    assert n == 2
    assert "jane.doe" not in out and "bob@host.io" not in out
    assert out.count("[REDACTED:email]") == 2
    assert "@handle" in out and "a@b" in out


@pytest.mark.parametrize(
    "secret",
    [
        "sk-proj-" + "A1b2C3d4E5f6G7h8I9j0",
        "sk-ant-" + "x" * 30,
        "pk-live-" + "0123456789abcdef",
        "AKIA" + "ABCDEFGHIJ234567",
        "ghp_" + "a" * 36,
        "xoxb-1234567890-abcdef",
        "AIza" + "S" * 35,
    ],
)
def test_api_key_preset(secret):
    r = presets("api_key")
    out, n = r.redact_text(f"key={secret} end")
    assert n == 1
    assert secret not in out
    assert out.startswith("key=[REDACTED:api_key]")


@pytest.mark.parametrize("text", ["sk-short", "task-" + "a" * 20, "AKIAshort", "my ghp_ tokens"])
def test_api_key_preset_leaves_lookalikes(text):
    assert presets("api_key").redact_text(text) == (text, 0)


def test_bearer_preset_any_case():
    r = presets("bearer")
    for header in ["Authorization: Bearer ", "authorization: bearer\t", "AUTH: BEARER   "]:
        token = "eyJhbGciOiJIUzI1NiJ9.e30.abc_DEF-123="
        out, n = r.redact_text(header + token)
        assert n == 1, header
        assert token[:16] not in out
    assert r.redact_text("Bearer short") == ("Bearer short", 0)


@pytest.mark.parametrize("number", [VISA, MASTERCARD, AMEX, "4111 1111 1111 1111", "4111-1111-1111-1111"])
def test_credit_card_preset_redacts_luhn_valid_numbers(number):
    out, n = presets("credit_card").redact_text(f"card: {number}.")
    assert (out, n) == ("card: [REDACTED:credit_card].", 1)


@pytest.mark.parametrize("number", ["4111111111111112", "4111 1111 1111 1112", "1234567890123456", "555555555555444"])
def test_credit_card_preset_keeps_luhn_invalid_numbers(number):
    assert not _luhn_ok(re.sub(r"\D", "", number))
    text = f"order {number} shipped"
    assert presets("credit_card").redact_text(text) == (text, 0)


def test_credit_card_preset_keeps_short_and_embedded_numbers():
    r = presets("credit_card")
    for text in ["phone 4111 1111", "id abc4111111111111111", "4111111111111111xyz"]:
        assert r.redact_text(text) == (text, 0)


def test_credit_card_followed_by_expiry_is_redacted():
    out, n = presets("credit_card").redact_text("card 4111 1111 1111 1111 10/27")
    assert "4111 1111 1111 1111" not in out and n == 1


def test_luhn():
    assert _luhn_ok("79927398713")
    assert not _luhn_ok("79927398710")
    assert _luhn_ok(VISA) and _luhn_ok("378282246310005")


def test_custom_rule_and_replacement():
    r = Redactor.from_config([], [{"name": "ticket", "pattern": r"TICKET-\d+", "replacement": "<ticket>"},
                                  {"name": "ssn", "pattern": r"\b\d{3}-\d{2}-\d{4}\b"}], [])
    out, n = r.redact_text("TICKET-12 and TICKET-9 for 123-45-6789")
    assert (out, n) == ("<ticket> and <ticket> for [REDACTED:ssn]", 3)


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match="unknown redaction preset 'phone'"):
        Redactor.from_config(["phone"], [], [])


def test_default_presets_and_disabled():
    assert set(DEFAULT_PRESETS) <= set(PRESETS)
    off = Redactor.from_config([], [], [])
    assert not off.enabled
    req = _trace_request("sk-proj-" + "a" * 20)
    before = req.SerializeToString()
    assert off.redact("traces", req, before) == 0
    assert req.SerializeToString() == before


# --- the walk -------------------------------------------------------------------------------

EMAIL = "alice@example.com"
RED = "[REDACTED:email]"


def _kv(key: str, value: str) -> KeyValue:
    kv = KeyValue(key=key)
    kv.value.string_value = value
    return kv


def _trace_request(value: str = EMAIL) -> ExportTraceServiceRequest:
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(_kv("res", value))
    rs.resource.attributes.append(_kv("password", "hunter2"))
    ss = rs.scope_spans.add()
    ss.scope.attributes.append(_kv("scope", value))
    s = ss.spans.add()
    s.trace_id, s.span_id = b"\x01" * 16, b"\x02" * 8
    s.name = f"send to {value}"
    s.status.message = f"failed for {value}"
    s.attributes.append(_kv("plain", value))
    s.attributes.append(_kv("untouched", "nothing here"))
    s.attributes.add(key="num").value.int_value = 5
    arr = s.attributes.add(key="arr").value.array_value.values
    arr.add().string_value = value
    inner = arr.add().array_value.values
    inner.add().string_value = f"deep {value}"
    kvl = s.attributes.add(key="kv").value.kvlist_value.values
    kvl.append(_kv("k", value))
    kvl.append(_kv("password", "nested-secret"))
    kvl.add(key="more").value.kvlist_value.values.append(_kv("x", value))
    s.attributes.append(_kv("password", "hunter3"))
    ev = s.events.add()
    ev.name = f"mail {value}"
    ev.attributes.append(_kv("ev", value))
    ln = s.links.add()
    ln.trace_id, ln.span_id = b"\x03" * 16, b"\x04" * 8
    ln.attributes.append(_kv("ln", value))
    return req


def test_redact_trace_request_everywhere():
    r = Redactor.from_config(["email"], [], ["password"])
    req = _trace_request()
    n = r.redact("traces", req, req.SerializeToString())
    text = str(req)
    assert EMAIL not in text
    assert "hunter" not in text and "nested-secret" not in text
    rs = req.resource_spans[0]
    s = rs.scope_spans[0].spans[0]
    assert [kv.key for kv in rs.resource.attributes] == ["res"]
    assert rs.resource.attributes[0].value.string_value == RED
    assert rs.scope_spans[0].scope.attributes[0].value.string_value == RED
    assert s.name == f"send to {RED}"
    assert s.status.message == f"failed for {RED}"
    at = {kv.key: kv.value for kv in s.attributes}
    assert "password" not in at
    assert at["plain"].string_value == RED
    assert at["untouched"].string_value == "nothing here"
    assert at["num"].int_value == 5
    assert at["arr"].array_value.values[0].string_value == RED
    assert at["arr"].array_value.values[1].array_value.values[0].string_value == f"deep {RED}"
    kvl = {kv.key: kv.value for kv in at["kv"].kvlist_value.values}
    assert set(kvl) == {"k", "more"}
    assert kvl["k"].string_value == RED
    assert kvl["more"].kvlist_value.values[0].value.string_value == RED
    assert s.events[0].name == f"mail {RED}"
    assert s.events[0].attributes[0].value.string_value == RED
    assert s.links[0].attributes[0].value.string_value == RED
    # 12 values rewritten + 3 keys dropped
    assert n == 15


def test_redact_log_request():
    r = Redactor.from_config(["api_key"], [{"name": "user", "pattern": r"user-\d+"}], ["authorization"])
    key = "sk-" + "Z" * 24
    req = ExportLogsServiceRequest()
    rl = req.resource_logs.add()
    rl.resource.attributes.append(_kv("r", key))
    sl = rl.scope_logs.add()
    sl.scope.attributes.append(_kv("s", "user-1"))
    a = sl.log_records.add()
    a.body.string_value = f"called with {key} by user-42"
    a.attributes.append(_kv("authorization", "Basic abc"))
    a.severity_text = "user-7"
    a.event_name = "gen_ai.user.message"
    b = sl.log_records.add()
    msgs = b.body.kvlist_value.values
    msgs.add(key="content").value.string_value = f"my key is {key}"
    msgs.add(key="authorization").value.string_value = "x"
    arr = msgs.add(key="list").value.array_value.values
    arr.add().string_value = "user-99"
    c = sl.log_records.add()
    c.body.bytes_value = key.encode()  # bytes are not text: left alone
    n = r.redact("logs", req, req.SerializeToString())
    assert rl.resource.attributes[0].value.string_value == "[REDACTED:api_key]"
    assert sl.scope.attributes[0].value.string_value == "[REDACTED:user]"
    assert a.body.string_value == "called with [REDACTED:api_key] by [REDACTED:user]"
    assert list(a.attributes) == []
    assert a.severity_text == "[REDACTED:user]"
    assert a.event_name == "gen_ai.user.message"
    body = {kv.key: kv.value for kv in b.body.kvlist_value.values}
    assert set(body) == {"content", "list"}
    assert body["content"].string_value == "my key is [REDACTED:api_key]"
    assert body["list"].array_value.values[0].string_value == "[REDACTED:user]"
    assert c.body.bytes_value == key.encode()
    assert n == 9


def test_nothing_to_redact_returns_zero_and_leaves_request():
    r = Redactor.from_config(["email", "api_key", "bearer", "credit_card"], [{"name": "c", "pattern": "zz+top"}], ["pw"])
    req = _trace_request("harmless text")
    before = req.SerializeToString()
    assert r.redact("traces", req, before) == 0
    assert req.SerializeToString() == before


@pytest.mark.parametrize("key", ["user.email", "a b", "x[0]", "k+v", "(paren)", "dollar$", "tab\tkey", "ключ"])
def test_drop_keys_with_special_characters(key):
    r = Redactor.from_config([], [], [key])
    req = ExportTraceServiceRequest()
    s = req.resource_spans.add().scope_spans.add().spans.add()
    s.attributes.append(_kv(key, "v"))
    s.attributes.append(_kv("keep", "v"))
    raw = req.SerializeToString()
    assert r.might_match(raw)
    assert r.redact("traces", req, raw) == 1
    assert [kv.key for kv in s.attributes] == ["keep"]
    other = ExportTraceServiceRequest()
    other.resource_spans.add().scope_spans.add().spans.add().attributes.append(_kv("unrelated", "v"))
    assert not r.might_match(other.SerializeToString())


# --- the screen never misses ------------------------------------------------------------------

CUSTOM = {
    "anchored": r"^secret-\d+$",
    "word": r"\bpassword\b\s*[:=]\s*\S+",
    "lookbehind": r"(?<=key=)[A-Za-z0-9]{8}",
    "neg-look": r"(?<!\w)id-\d{4}(?!\d)",
    "inline-flag": r"(?i)token_[a-f0-9]{8}",
    "non-boundary": r"\Bxyz\B",
    "end": r"[A-Z]{3}\d\Z",
    "scoped-flag": r"(?i:acct)#\d{3,}",
}

FRAGMENTS = [
    "sk-", "sk-proj-", "pk-live-", "rk-test-", "AKIA", "ghp_", "gho_", "xoxb-", "xoxp-", "AIza", "Bearer ", "bearer\t",
    "BEARER  ", "@", ".", "-", "_", " ", "4111", "1111", "5555 5555", "4242-4242", "378282246310005", "secret-",
    "password", "Password", "=", ":", "key=", "id-", "token_", "TOKEN_", "xyz", "acct#", "ACCT#", "\n", "é", "ß", "€",
    "\u200b", "example.com", "user", "com", "\x00", "\x7f", "\"", "{", "}",
]
ALPHABET = string.ascii_letters + string.digits + " -_.@/+=:~#"


def _luhn_number(rng: random.Random) -> str:
    n = rng.randint(13, 19)
    digits = [rng.choice(string.digits) for _ in range(n - 1)]
    for check in string.digits:
        if _luhn_ok("".join(digits) + check):
            digits.append(check)
            break
    sep = rng.choice(["", " ", "-"])
    out = ""
    for i, d in enumerate(digits):
        out += d
        if sep and i % 4 == 3 and i < n - 1:
            out += sep
    return out


def _positive(rng: random.Random, name: str) -> str:
    word = lambda k, a=string.ascii_letters + string.digits: "".join(rng.choice(a) for _ in range(k))  # noqa: E731
    return {
        "email": lambda: f"{word(rng.randint(1, 10))}@{word(rng.randint(1, 8))}.{word(rng.randint(2, 4), string.ascii_letters)}",
        "api_key": lambda: rng.choice(["sk-", "sk-proj-", "rk-live-", "AKIA", "ghp_", "xoxp-", "AIza"]) + word(rng.randint(14, 40)).upper(),
        "bearer": lambda: rng.choice(["Bearer", "bearer", "BEARER"]) + rng.choice([" ", "  ", "\t"]) + word(rng.randint(14, 30)),
        "credit_card": lambda: _luhn_number(rng),
        "anchored": lambda: f"secret-{rng.randint(0, 10**6)}",
        "word": lambda: f"password{rng.choice(['=', ': ', ' = '])}{word(rng.randint(1, 9))}",
        "lookbehind": lambda: f"key={word(rng.randint(6, 10))}",
        "neg-look": lambda: f"id-{rng.randint(0, 9999):04d}",
        "inline-flag": lambda: rng.choice(["token_", "TOKEN_"]) + word(8, "abcdefABCDEF0123456789"),
        "non-boundary": lambda: word(rng.randint(0, 3)) + "xyz" + word(rng.randint(0, 3)),
        "end": lambda: word(3, string.ascii_uppercase) + rng.choice(string.digits),
        "scoped-flag": lambda: rng.choice(["acct", "ACCT", "AcCt"]) + "#" + word(rng.randint(2, 5), string.digits),
    }[name]()


def _noise(rng: random.Random, k: int) -> str:
    parts = []
    for _ in range(k):
        x = rng.random()
        if x < 0.4:
            parts.append(rng.choice(FRAGMENTS))
        elif x < 0.9:
            parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 12))))
        else:
            parts.append(rng.choice(string.digits) * rng.randint(1, 20))
    return "".join(parts)


def _value(rng: random.Random, name: str) -> str:
    shape = rng.random()
    if shape < 0.25:
        return _positive(rng, name)  # the whole value
    if shape < 0.5:
        return _noise(rng, rng.randint(0, 3)) + _positive(rng, name) + _noise(rng, rng.randint(0, 3))
    if shape < 0.6:
        return _noise(rng, rng.randint(0, 3)) + rng.choice(["\n", " "]) + _positive(rng, name)
    return _noise(rng, rng.randint(1, 10))


def _request_around(rng: random.Random, value: str):
    """A traces or logs request holding `value` somewhere, with random bytes and
    strings around it."""
    def junk() -> KeyValue:
        kv = KeyValue(key="".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 8))))
        if rng.random() < 0.5:
            kv.value.bytes_value = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        else:
            kv.value.string_value = _noise(rng, rng.randint(0, 4))
        return kv

    where = rng.randrange(7)
    if where == 6:
        req = ExportLogsServiceRequest()
        rec = req.resource_logs.add().scope_logs.add().log_records.add()
        rec.attributes.append(junk())
        target = rec.body.kvlist_value.values.add(key="content").value
        target.string_value = value
        rec.attributes.append(junk())
        return "logs", req, target
    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.append(junk())
    s = rs.scope_spans.add().spans.add()
    s.trace_id = bytes(rng.randrange(256) for _ in range(16))
    s.span_id = bytes(rng.randrange(256) for _ in range(8))
    s.attributes.append(junk())
    target = {
        0: lambda: s.attributes.add(key="v").value,
        1: lambda: rs.resource.attributes.add(key="v").value,
        2: lambda: s.events.add(name="e").attributes.add(key="v").value,
        3: lambda: s.attributes.add(key="arr").value.array_value.values.add(),
        4: lambda: s.attributes.add(key="kv").value.kvlist_value.values.add(key="v").value,
        5: lambda: s.links.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8).attributes.add(key="v").value,
    }[where]()
    target.string_value = value
    s.attributes.append(junk())
    return "traces", req, target


RULES = [(n, PRESETS[n]) for n in PRESETS] + list(CUSTOM.items())


@pytest.mark.parametrize("name,pattern", RULES, ids=[n for n, _ in RULES])
def test_screen_never_misses(name, pattern):
    rng = random.Random(f"screen-{name}")
    if name in PRESETS:
        r = Redactor.from_config([name], [], [])
        assert r.rules[0].preset
    else:
        r = Redactor.from_config([], [{"name": name, "pattern": pattern}], [])
        assert r.rules[0].screen is not None  # it was rewritten, not given up on
    changed = screened_out = 0
    for i in range(300):
        value = _value(rng, name)
        new, n = r.redact_text(value)
        signal, req, target = _request_around(rng, value)
        raw = req.SerializeToString()
        hit = r.might_match(raw)
        if n:
            changed += 1
            assert hit, f"screen missed {value!r} (rule {name})"
            assert r.redact(signal, req, raw) >= 1
            assert target.string_value == new
        elif not hit:
            screened_out += 1
            assert r.redact(signal, req, raw) == 0
            assert target.string_value == value
    # the loop exercised both sides
    assert changed >= 40, changed
    assert screened_out >= 10, screened_out


def test_screen_lets_clean_requests_through():
    selective = {k: CUSTOM[k] for k in ("anchored", "word", "neg-look", "inline-flag", "scoped-flag")}
    r = Redactor.from_config(list(PRESETS), [{"name": n, "pattern": p} for n, p in selective.items()], ["pw"])
    req = _trace_request("just a normal sentence")
    assert not r.might_match(req.SerializeToString())
    assert r.redact("traces", req, req.SerializeToString()) == 0


def test_custom_rule_that_cannot_be_screened_walks_every_request():
    rule = Rule("cond", r"(a)?(?(1)b|c)")
    assert rule.screen is None
    r = Redactor([rule])
    assert r.might_match(b"\x00\x01anything")


def test_screen_agrees_with_credit_card_rule_on_non_ascii_digits():
    # The rule and its RE2 screen both take ASCII digits only, so they agree: a
    # fullwidth number is neither screened in nor rewritten (never rewritten
    # unscreened, which would be the dangerous disagreement).
    r = presets("credit_card")
    value = "\uff14\uff11\uff11\uff11" * 4  # "4111" x4 in fullwidth digits
    assert r.redact_text(value)[1] == 0
    ascii_value = "4111111111111111"
    assert r.redact_text(ascii_value)[1] == 1
    _, req, _ = _request_around(random.Random(1), ascii_value)
    assert r.might_match(req.SerializeToString())


def test_screen_with_backreference_into_a_lookaround():
    pattern = r"""(?<=(['"]))\w+\1"""
    r = Redactor.from_config([], [{"name": "quoted", "pattern": pattern}], [])
    value = "say 'secret' now"
    assert r.redact_text(value)[1] == 1
    _, req, _ = _request_around(random.Random(2), value)
    assert r.might_match(req.SerializeToString())


def test_hyperscan_and_re2_screens_agree():
    """Both screening engines answer the same for every preset screen."""
    from nightshift.collector import screen
    from nightshift.collector.redact import PRESET_SCREENS

    pats = list(PRESET_SCREENS.values()) + [re.escape("user.password")]
    hs, r2 = screen._hyperscan(pats), screen._re2(pats)
    if hs is None:
        pytest.skip("hyperscan is not installed on this platform")
    rng = random.Random(7)
    samples = [b"", b"nothing here", b"\x00\xffsk-", b"Bearer x", b"a@b", b"4111 1111 1111 1111", b"user.password",
               b"ghp_", b"xoxb-", b"AIza", b"AKIA", b"bearer"]
    samples += [bytes(rng.randrange(256) for _ in range(rng.randrange(64))) for _ in range(300)]
    for s in samples:
        assert hs(s) == r2(s), s
