"""Which prompt the model saw, when it is not the one the agent's spans recorded.

`nightshift route` may put a candidate system prompt in a share of an agent's
conversations (issue 27): the agent's instrumentation then records the prompt
the agent sent, not the one the model answered. The route marks those answers:
`+p:<prompt version id>` appended to the response's `model`, which every
instrumentation records as the response model on the call's own span
(`route/mark.py` says why this rather than a span of the route's own). Here the
mark becomes the transition's `prompt_seen`, and comes off `model` and
`response_model` (the served version, `name@v0004`, reads as it did: `policy_version`
is taken again from the unmarked names).

A row without a mark saw its `input_messages`' prompt: `prompt_seen` stays null
and `nightshift prompts` hashes the prompt it recorded.
"""

from __future__ import annotations

import re

from . import calls as C

#: The route's mark at the end of a model name: `+p:` and a prompt version's 12 hex digits.
MARK = re.compile(r"\+p:([0-9a-f]{12})$")


def unmark(name: str | None) -> tuple[str | None, str | None]:
    """(the model name without the route's mark, the prompt version id it named or None)."""
    if not name or "+p:" not in name:
        return name, None
    m = MARK.search(name)
    return (name[:m.start()], m.group(1)) if m else (name, None)


def attribute(rows: list[dict]) -> list[dict]:
    """Each row with `prompt_seen` set (None unless its answer was marked), the mark
    taken off its model names and its `policy_version` read again from them."""
    for r in rows:
        if not any(n and "+p:" in n for n in (r.get("response_model"), r.get("model"), r.get("request_model"))):
            r["prompt_seen"] = None  # unmarked, as nearly every row is: nothing to take off
            continue
        resp, seen = unmark(r.get("response_model"))
        model, seen_m = unmark(r.get("model"))
        req, _ = unmark(r.get("request_model"))
        seen = seen or seen_m
        r["prompt_seen"] = seen
        if seen is not None:
            r["response_model"], r["model"], r["request_model"] = resp, model, req
            r["policy_version"] = C.policy_version(resp, req)
    return rows
