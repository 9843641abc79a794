"""What a prompt trial adds to each request it touches (issue 27's route target:
p99 < 2 ms at 200 streams with prompt rewriting on): the decision is counted in
/metrics, not written to the log at INFO per request, and the answer's mark costs
one replace per piece of whole events once the stream's model is known, with
`marked` counting the events it marked."""

from __future__ import annotations

import logging

from nightshift.route.config import RouteConfig
from nightshift.route.mark import StreamMarker, tag
from nightshift.route.metrics import Metrics
from nightshift.route.proxy import Proxy
from nightshift.route.rewrite import read
from nightshift.route.table import RouteTable, parse
from nightshift.schemas.prompt_identity import system_id

AGENT = "You are the support agent of Acme. Answer in one sentence."
CANDIDATE = "You are Acme's support agent. Check the order status tool before answering."


def test_the_marker_counts_each_event_of_a_piece():
    event = b'data: {"id":"c","model":"gpt-x-2024","choices":[{"delta":{"content":"tok"}}]}\n\n'
    m = StreamMarker(tag("ab12cd34ef56"))
    first = m.feed(event)
    rest = m.feed(event * 3 + b"data: [DONE]\n\n")  # a proxy behind the stream reads several events at once
    assert first + rest + m.flush() == (event * 4).replace(b'"gpt-x-2024"', b'"gpt-x-2024+p:ab12cd34ef56"') \
        + b"data: [DONE]\n\n"
    assert m.marked == 4
    other = b'data: {"model":"gpt-y"}\n\n'  # an event naming another model still goes through the pattern
    assert m.feed(event + other) == (event + other).replace(b'"gpt-x-2024"', b'"gpt-x-2024+p:ab12cd34ef56"') \
        .replace(b'"gpt-y"', b'"gpt-y+p:ab12cd34ef56"') and m.marked == 6


def test_a_prompt_decision_is_counted_and_logged_only_at_debug(tmp_path, caplog):
    route = parse(f"prompt:{system_id([AGENT])}", {"kind": "prompt", "candidate": system_id([CANDIDATE]),
                                                    "system": CANDIDATE, "share": 1.0})
    metrics = Metrics()
    proxy = Proxy(RouteConfig(state=str(tmp_path / "routes.json")), RouteTable(tmp_path / "routes.json"), metrics)
    body = read(b'{"model": "gpt-x", "messages": [{"role": "system", "content": "%s"}, {"role": "user", '
                b'"content": "hi"}]}' % AGENT.encode())
    match = proxy.prompts.find(body, {route.serving: route})
    with caplog.at_level(logging.INFO, logger="nightshift.route"):
        edits, mark = proxy._prompt(match, body, "conversation", "k" * 32)
    assert edits and mark == tag(route.version or proxy.prompts.version(route, body))
    assert not [r for r in caplog.records if "prompt route" in r.getMessage()]
    assert metrics.prompt_decisions.labels(match.name, "candidate", "conversation")._value.get() == 1
    with caplog.at_level(logging.DEBUG, logger="nightshift.route"):
        proxy._prompt(match, body, "conversation", "k" * 32)
    assert [r.levelno for r in caplog.records if "prompt route" in r.getMessage()] == [logging.DEBUG]


def test_a_routing_decision_is_counted_and_logged_only_at_debug(tmp_path, caplog):
    """A line per request at INFO was the most of what the route's own code cost per
    request (the record, its format, a write); the counter says as much at any level."""
    from types import SimpleNamespace

    from multidict import CIMultiDict

    table = RouteTable(tmp_path / "routes.json")
    table.put("agent", parse("agent", {"serving": "agent@v0001", "candidate": "agent@v0002", "share": 0.5}))
    metrics = Metrics()
    proxy = Proxy(RouteConfig(state=str(tmp_path / "routes.json")), table, metrics)
    request = SimpleNamespace(method="POST", headers=CIMultiDict({"X-Nightshift-Route-Key": "conv-1"}))
    body = b'{"model": "agent", "messages": [{"role": "user", "content": "hi"}]}'
    with caplog.at_level(logging.INFO, logger="nightshift.route"):
        span, name, targets, *_ = proxy._plan(request, body)
    assert name == "agent" and targets[0] in ("agent@v0001", "agent@v0002") and not caplog.records
    arm = "candidate" if targets[0] == "agent@v0002" else "serving"
    assert metrics.decisions.labels("agent", targets[0], arm, "header")._value.get() == 1
    with caplog.at_level(logging.DEBUG, logger="nightshift.route"):
        proxy._plan(request, body)
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("route agent -> ")] == [logging.DEBUG]


def test_a_candidate_is_encoded_once_unless_it_has_slots_to_fill():
    """The candidate's JSON text is the same bytes for every request of a route, so
    it is made once; a candidate with the request's own data in slots is filled per
    request (today's date is not yesterday's)."""
    from nightshift.route.prompt import PromptRouter

    agent_t = "You are the support agent of Acme. Today is {{date}}. Answer in one sentence."
    kind = agent_t + " Be kind."
    routes = {
        "plain": parse(f"prompt:{system_id([AGENT])}", {"kind": "prompt", "candidate": system_id([CANDIDATE]),
                                                         "system": CANDIDATE, "share": 1.0}),
        "slots": parse(f"prompt:{system_id([agent_t])}", {"kind": "prompt", "candidate": system_id([kind]),
                                                           "system": kind, "share": 1.0}),
    }
    router = PromptRouter()

    def edit(system: str, route: str) -> bytes:
        body = read(b'{"model": "m", "messages": [{"role": "system", "content": "%s"}, {"role": "user", '
                    b'"content": "hi"}]}' % system.encode())
        m = router.find(body, {routes[route].serving: routes[route]})
        (_, _, data), = router.edits(m, body)
        return data

    first, second = edit(AGENT, "plain"), edit(AGENT, "plain")
    assert first == ('"%s"' % CANDIDATE).encode() and first is second
    day1 = edit(agent_t.replace("{{date}}", "2026-11-26"), "slots")
    day2 = edit(agent_t.replace("{{date}}", "2026-11-27"), "slots")
    assert b"2026-11-26" in day1 and b"2026-11-27" in day2 and b"{{date}}" not in day1 + day2
