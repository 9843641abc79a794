"""What a prompt version is, and its id: the content hash every stage uses to name it.

A version is the agent's instructions as the model saw them: the leading system
(or developer) messages of a call, per-request data folded into slots
(`prompt_template`), and the tools offered (name, description, parameters: a changed
tool description changes what the model does as much as a changed sentence).
The id is the first 12 hex digits of the SHA-256 of that, as canonical JSON, so
the lake, a stored candidate and a router that sees one request compute the same
id from the same prompt. `system_id` hashes the system part alone: what a router
that rewrites only the system prompt matches on.

Only the standard library, and nothing slow: a request path can call it. It lives
in schemas/ because the id is part of the data contract between the lake
(`nightshift prompts`), the candidate store and `nightshift route`, which may
import nothing but schemas/, settings/ and storage/.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SYSTEM_ROLES = ("system", "developer")
ID_LENGTH = 12


def leading_system(messages: list[dict] | None) -> list[str]:
    """The contents of the system/developer messages before the first other message:
    the instructions. A system message later in a conversation is part of the
    conversation (a framework's reminder, a handoff), not of the prompt."""
    out = []
    for m in messages or []:
        if (m or {}).get("role") not in SYSTEM_ROLES:
            break
        content = m.get("content")
        out.append(content if isinstance(content, str) else json.dumps(content, sort_keys=True, ensure_ascii=False))
    return out


def canonical_tools(tools: list | str | None) -> list[dict]:
    """Tools as {name, description, parameters}, sorted by name: the order a client
    lists them in, and OpenAI's nesting or the flat form, do not make a new version."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return [{"name": "", "description": tools, "parameters": None}]
    out = []
    for t in tools or []:
        if not isinstance(t, dict):
            continue
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        out.append({"name": str(fn.get("name") or ""), "description": fn.get("description") or "",
                    "parameters": fn.get("parameters")})
    return sorted(out, key=lambda t: (t["name"], json.dumps(t, sort_keys=True, default=str)))


def tool_names(tools: list[dict]) -> list[str]:
    return [t["name"] for t in tools if t.get("name")]


def _digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    # surrogatepass: a lone surrogate (JSON's "\ud800") is text a request can carry; the route hashes it
    # rather than fail (valid text hashes as before)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:ID_LENGTH]


def system_id(system: list[str]) -> str:
    return _digest({"system": list(system)})


def tools_id(tools: list[dict]) -> str:
    """The id of the canonical tools alone (`canonical_tools`)."""
    return _digest({"tools": tools})


def version_id(system: list[str], tools: list[dict]) -> str:
    """The id of (templated system messages, canonical tools)."""
    return _digest({"system": list(system), "tools": tools})


@dataclass(frozen=True)
class PromptVersion:
    """One version: its id, the system messages (templates, with `{{slot}}`s) and the
    tools, canonical."""

    id: str
    system: tuple[str, ...]
    tools: tuple[str, ...]  # the canonical tool dicts, each as sorted JSON text (so the version is hashable)
    system_hash: str

    @classmethod
    def of(cls, system: list[str], tools: list[dict]) -> PromptVersion:
        return cls(version_id(system, tools), tuple(system), tuple(json.dumps(t, sort_keys=True) for t in tools),
                   system_id(system))

    @property
    def tool_list(self) -> list[dict]:
        return [json.loads(t) for t in self.tools]

    @property
    def text(self) -> str:
        """The system prompt as one text (several leading messages joined by a blank line)."""
        return "\n\n".join(self.system)
