"""Is a proposed prompt one that may be stored at all? The checks no candidate skips,
before any evaluation spends anything on it.

Agent Lightning's APO accepts any reply as the new template (its docs warn it can
emit invalid prompts); a prompt served to production must not be. Refused, each
with the reason recorded: an answer without a `<prompt>` block; an empty, unchanged
or garbled prompt (control characters, a JSON document, mostly not words); one
over `apo.max_prompt_chars` or grown more than `apo.max_growth` times its parent
(prompts that only grow are how reflective optimizers drift); one that drops a
placeholder the parent has, or adds one no request fills; one that stops naming a
tool its parent named, or names a tool the agent does not have; one that copies a
dozen words in a row from the logged conversations it was shown (per-request data,
or text a user planted there for the critic to repeat).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from nightshift.schemas.prompt_template import placeholders

BLOCK = re.compile(r"<prompt>\s*(.*?)\s*</prompt>", re.DOTALL | re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufffd]")
_WORD = re.compile(r"\w+")
#: a name the candidate uses as a tool's: `name` tool, `snake_case`, snake_case tool/function
_TOOL_REF = re.compile(r"`([A-Za-z_][\w.-]*)`\s+(?:tool|function)\b|`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`"
                       r"|\b([a-z][a-z0-9]*(?:_[a-z0-9]+)+)\s+(?:tool|function)\b")
LEAK_WORDS = 12
GROWTH_SLACK = 1500


@dataclass
class Limits:
    max_chars: int = 16000
    max_growth: float = 2.0


def extract(answer: str) -> str | None:
    """The prompt in a proposer's answer: the last `<prompt>...</prompt>` block."""
    blocks = BLOCK.findall(answer or "")
    return blocks[-1].strip() if blocks else None


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def problem(candidate: str | None, parent: str, tools: list[str], shown: list[str], limits: Limits) -> str:
    """Why `candidate` may not be stored ("" when it may). `tools`: the names the agent
    is offered; `shown`: the conversation texts the proposer read."""
    if candidate is None:
        return "the answer holds no <prompt>...</prompt> block"
    if not candidate.strip():
        return "the proposed prompt is empty"
    if _CONTROL.search(candidate):
        return "the proposed prompt holds control characters or undecodable bytes"
    if "<prompt>" in candidate.lower() or "</prompt>" in candidate.lower():
        return "the proposed prompt holds the answer's own <prompt> markers"
    if candidate.lstrip()[:1] in "{[":
        try:
            json.loads(candidate)
            return "the proposed prompt is a JSON document, not instructions"
        except json.JSONDecodeError:
            pass
    visible = [c for c in candidate if not c.isspace()]
    if sum(c.isalpha() for c in visible) < 0.3 * len(visible):
        return "the proposed prompt is mostly not words"
    if len(candidate) > limits.max_chars:
        return f"the proposed prompt has {len(candidate):,} characters, more than apo.max_prompt_chars={limits.max_chars:,}"
    ceiling = limits.max_growth * len(parent) + GROWTH_SLACK
    if len(candidate) > ceiling:
        return (f"the proposed prompt grew from {len(parent):,} to {len(candidate):,} characters, more than "
                f"apo.max_growth={limits.max_growth:g} times its parent (plus {GROWTH_SLACK:,})")
    if " ".join(candidate.split()) == " ".join(parent.split()):
        return "the proposed prompt is its parent unchanged"
    before, after = placeholders(parent), placeholders(candidate)
    dropped = [p for p in before if p not in after]
    if dropped:
        return f"the proposed prompt drops the placeholder(s) {', '.join('{{' + p + '}}' for p in dropped)}"
    added = [p for p in after if p not in before]
    if added:
        return (f"the proposed prompt adds the placeholder(s) {', '.join('{{' + p + '}}' for p in added)}, "
                "which no request fills")
    lost = [t for t in tools if re.search(rf"\b{re.escape(t)}\b", parent) and not re.search(rf"\b{re.escape(t)}\b", candidate)]
    if lost:
        return f"the proposed prompt no longer names the tool(s) {', '.join(lost)}, which its parent named"
    refs = {x for groups in _TOOL_REF.findall(candidate) for x in groups if x}
    unknown = sorted(r for r in refs if r not in tools and not re.search(rf"\b{re.escape(r)}\b", parent))
    if unknown:
        return f"the proposed prompt names tool(s) the agent does not have: {', '.join(unknown)}"
    grams = _ngrams(candidate, LEAK_WORDS) - _ngrams(parent, LEAK_WORDS)
    if grams:
        for text in shown:
            common = grams & _ngrams(text, LEAK_WORDS)
            if common:
                return (f"the proposed prompt copies {LEAK_WORDS}+ words in a row from a logged conversation "
                        f"(\"{' '.join(sorted(common)[0])}\"): per-request data, not an instruction")
    return ""
