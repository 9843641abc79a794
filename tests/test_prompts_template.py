"""Per-request data inside system prompts: folded into one template, so that an agent
rendering today's date or the user's name into its prompt has one prompt version,
not one per request; and two real versions are never merged into one."""

from __future__ import annotations

import random

from nightshift.schemas import prompt_template as T
from nightshift.schemas.prompt_identity import PromptVersion, canonical_tools, leading_system

NAMES = ["Alice", "Bob", "Mary Jane", "Zed", "Jean-Luc Picard", "Ann"]
BODY = "You are the assistant of {}. Today is {}. Answer in English; use the tools you have, one at a time."


def test_known_kinds_become_slots_and_their_values_come_back():
    text = ("Today is Monday, 24 November 2026 (2026-11-24T10:00:00Z), it is 10:15 UTC. Session "
            "3f2a9c1b-7d4e-4f60-aa11-0123456789ab, user 3f2a9c1b7d4e5f60aa, order 1234567, mail a.b@example.com. "
            "Use at most 3 tools.")
    norm, values = T.normalize(text)
    assert norm == ("Today is {{date}} ({{datetime}}), it is {{time}}. Session {{uuid}}, user {{id}}, order {{number}}, "
                    "mail {{email}}. Use at most 3 tools.")
    assert T.fill(norm, values) == text
    # another day, another user: the same template
    other = text.replace("Monday, 24 November 2026", "Tuesday, 25 November 2026").replace("1234567", "7654321")
    assert T.normalize(other)[0] == norm


def test_names_are_folded_once_three_requests_differ_in_one_short_span():
    texts = [BODY.format(n, "2026-11-2" + str(i % 9)) for i, n in enumerate(NAMES)]
    norm = [T.normalize(t)[0] for t in texts]
    templates = T.infer(norm)
    assert [t.text for t in templates] == [BODY.format("{{var}}", "{{date}}")]
    # a request with a name never seen resolves to it, values included, and fills back to itself
    new = BODY.format("Dr. Who", "24/11/2026")
    tpl, values = T.resolve(new, templates)
    assert tpl == templates[0].text and values["var"] == "Dr. Who"
    assert T.fill(tpl, values) == new


def test_two_values_are_two_versions_not_a_slot():
    """A developer who changed one word made a new version: two values never make a slot."""
    a = "Answer briefly, you are a helpful assistant for our shop and its customers."
    b = "Answer politely, you are a helpful assistant for our shop and its customers."
    assert sorted(t.text for t in T.infer([a] * 50 + [b] * 40)) == sorted([a, b])


def test_long_or_multiline_differences_are_not_folded():
    base = "You help with orders.\n{}\nNever promise refunds."
    likes = ["blue shirts and green hats", "old maps of Lisbon and tea", "fast bikes, loud music, early mornings",
             "nothing we sell, so far", "cheese from the Alps in winter", "a refund on every order ever placed"]
    docs = [base.format(f"Customer profile: {n} has been with us for years and likes {x}; call before delivery.")
            for n, x in zip(NAMES, likes)]
    assert len(T.infer(docs)) == len(docs)  # a pasted profile is not a short span: said in the help


def test_templates_and_ids_do_not_depend_on_the_order_requests_arrived_in():
    texts = [T.normalize(BODY.format(n, "2026-11-20"))[0] for n in NAMES for _ in range(3)]
    first = [t.text for t in T.infer(texts)]
    random.Random(4).shuffle(texts)
    assert [t.text for t in T.infer(texts)] == first


def test_prompts_beyond_the_aligned_ones_are_matched_against_the_templates_found():
    texts = [T.normalize(BODY.format(f"user{i:03d}x", "2026-11-20"))[0] for i in range(30)]
    templates = T.infer(texts, max_aligned=5)
    assert len(templates) == 1 and templates[0].slots == ("var",)


def test_a_request_and_the_lake_compute_the_same_version_id():
    """identity is what a router would call on one request: the leading system block,
    templated, and the tools however the client nested and ordered them."""
    tools_a = [{"type": "function", "function": {"name": "b", "description": "B", "parameters": {}}},
               {"type": "function", "function": {"name": "a", "description": "A", "parameters": {}}}]
    tools_b = [{"name": "a", "description": "A", "parameters": {}}, {"name": "b", "description": "B", "parameters": {}}]
    msgs = [{"role": "system", "content": "S1"}, {"role": "developer", "content": "S2"}, {"role": "user", "content": "u"},
            {"role": "system", "content": "a later reminder is conversation, not prompt"}]
    assert leading_system(msgs) == ["S1", "S2"]
    v1 = PromptVersion.of(leading_system(msgs), canonical_tools(tools_a))
    v2 = PromptVersion.of(["S1", "S2"], canonical_tools(tools_b))
    assert v1.id == v2.id and len(v1.id) == 12
    changed = PromptVersion.of(["S1", "S2"], canonical_tools([dict(tools_b[0], description="A, better"), tools_b[1]]))
    assert changed.id != v1.id and changed.system_hash == v1.system_hash  # a tool's description is part of the version


def test_normalizing_around_the_digits_only_finds_what_a_full_scan_finds():
    """`normalize` runs the patterns only near digits (and everywhere when there is an
    @): on 1,000 random texts it must fold exactly what one pass over the whole text does."""
    rng = random.Random(7)
    pieces = ["Monday, 24 November 2026", "Nov 3, 2025", "2026-11-24", "2026-11-24T10:00:00Z", "10:15 UTC", "3:05 pm",
              "24/11/2026", "3f2a9c1b-7d4e-4f60-aa11-0123456789ab", "abcdefabcdefabcdef12", "deadbeefdeadbeefdeadbeef",
              "1234567", "12345", "v1.2.3", "a.b@example.com", "x" * 70 + "1", "Wednesday", "at most 3 tools", "ok.",
              "\n", "policy", "{{user}}", "2026", "September 24th, 2026"]
    for _ in range(1000):
        text = " ".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        used = set(T.SLOT.findall(text))
        values = {}

        def repl(m):
            name = T._name(m.lastgroup, used)
            values[name] = m.group(0)
            return "{{" + name + "}}"

        assert T.normalize(text) == (T._KIND_RE.sub(repl, text), values), text
