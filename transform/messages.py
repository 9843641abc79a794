"""One message shape for every convention: the `MESSAGE` struct of the transitions
schema, as a plain dict.

`{"role", "content", "name", "tool_calls": [{"id", "name", "arguments"}], "tool_call_id"}`
with `arguments` as JSON text. Readers for each instrumentation's layout turn what
they find into these; everything downstream (credit, trainer) sees only these.
"""

from __future__ import annotations

import json
from typing import Any, Iterable


class MessageError(ValueError):
    """Content that cannot be read as messages (the row is flagged, not dropped)."""


#: Finish reasons by the many names producers use, onto OTel GenAI's values.
_FINISH = {
    "stop": "stop", "end_turn": "stop", "stop_sequence": "stop", "eos": "stop", "complete": "stop",
    "length": "length", "max_tokens": "length", "max_output_tokens": "length",
    "tool_call": "tool_call", "tool_calls": "tool_call", "function_call": "tool_call", "tool_use": "tool_call",
    "function_calls": "tool_call",  # AutoGen's CreateResult
    "content_filter": "content_filter", "safety": "content_filter", "recitation": "content_filter",
    "error": "error",
    "compaction": "compaction",  # the provider compacted the context instead of answering (the conventions, 2026)
}


def normalize_finish_reason(value: Any) -> str | None:
    """`tool_calls`, `["tool_call"]`, `'["tool_calls"]'` (logfire's JSON text) and
    `TOOL_USE` are all `tool_call`. The first choice's reason when there are several."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
        else:
            value = text
    if isinstance(value, (list, tuple)):
        value = next((v for v in value if v), None)
        if value is None:
            return None
    reason = str(value).strip().lower()
    return _FINISH.get(reason, reason or None)


def message(role: str, content: str | None = None, *, name: str | None = None,
            tool_calls: list[dict] | None = None, tool_call_id: str | None = None) -> dict:
    """`developer` is OpenAI's name for the system prompt of its newer models (and
    what some instrumentations write for a system message that went out as
    `system`); chat templates know `system`, so that is what a row says."""
    if role == "developer":
        role = "system"
    return {"role": role, "content": content, "name": name, "tool_calls": tool_calls or [], "tool_call_id": tool_call_id}


def arguments_json(args: Any) -> str:
    """Tool-call arguments as JSON text: objects are encoded, text is kept as the
    model wrote it (it may be invalid JSON; that is the model's action)."""
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _join(texts: list[str]) -> str | None:
    return "".join(texts) if texts else None


def _loads(value: Any, what: str) -> Any:
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8", "replace")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise MessageError(f"{what} is not valid JSON: {e}") from None
    return value


# --- OpenTelemetry GenAI (semconv >= 1.37): messages made of typed parts ------------


#: Parts whose content is text the model read: `compaction` is the summary a
#: provider put in place of the turns it compacted (OpenAI's Responses API), in the
#: GenAI conventions since their `CompactionPart`; the state is what the model saw.
TEXT_PARTS = ("text", "compaction")


def from_genai_message(m: Any) -> list[dict]:
    """One `{role, parts, name?}` message. A tool message answering several calls
    becomes one `tool` message per call, as chat templates expect."""
    if not isinstance(m, dict):
        raise MessageError(f"a message must be an object, got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str):
        raise MessageError("a message has no role")
    parts = m.get("parts")
    if parts is None and "content" in m:  # some producers write OpenAI-style messages here
        return [from_openai_message(m)]
    if not isinstance(parts, list):
        raise MessageError(f"message parts must be a list, got {type(parts).__name__}")
    texts: list[str] = []
    calls: list[dict] = []
    responses: list[dict] = []
    at: list[int] = []  # each response's place among the parts
    first = len(parts)  # the first text or tool call's: the message's own place
    for j, p in enumerate(parts):
        if not isinstance(p, dict):
            raise MessageError("a message part must be an object")
        kind = p.get("type")
        if kind in TEXT_PARTS:
            texts.append(_text(p.get("content", "")))
            first = min(first, j)
        elif kind == "tool_call":
            calls.append({"id": p.get("id"), "name": p.get("name"), "arguments": arguments_json(p.get("arguments"))})
            first = min(first, j)
        elif kind == "tool_call_response":
            # The schema's field is `response`; one example in the spec says `result`.
            resp = p.get("response", p.get("result"))
            responses.append(message("tool", None if resp is None else _text(resp), tool_call_id=p.get("id")))
            at.append(j)
        # reasoning, blob, uri, file, server tool parts: not text the policy trains on
    if responses and role == "tool":
        # the result written twice, as text and as the response part (openai-agents-v2): once
        answered = {r["content"] for r in responses}
        texts = [t for t in texts if t not in answered]
    if role == "assistant" and not calls and len(texts) == 1 and (found := _repr_message(texts[0])) is not None:
        return [found]
    # In the parts' order: a user message that answers tool calls and then says more
    # (Anthropic's and Gemini's tool results come as the user's) is the tool results,
    # then the text, so each result still follows the assistant's call it answers.
    out = [r for j, r in zip(at, responses) if j < first]
    if texts or calls or not responses:
        out.append(message(role, _join(texts), name=m.get("name"), tool_calls=calls))
    out.extend(r for j, r in zip(at, responses) if j > first)
    return out


def python_literal(text: str) -> Any:
    """A value some instrumentations write as its Python repr instead of JSON, read
    with `ast.literal_eval` (literals only: nothing runs); None when it is not one."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


#: The keys of the openai client's `ChatCompletionMessage` as Python prints it.
_REPR_KEYS = frozenset({"content", "role", "tool_calls", "function_call"})


def _repr_message(text: str) -> dict | None:
    """An assistant message that an instrumentation wrote as the Python repr of the
    client's message object in a text part (opentelemetry-instrumentation-openai-agents-v2
    0.1.0 does for every tool-call answer): the message it prints, exactly. Read with
    `ast.literal_eval` (literals only, nothing runs), and only for that exact shape."""
    if not text.startswith("{'") or "'tool_calls': " not in text:
        return None
    value = python_literal(text)
    if not isinstance(value, dict) or not _REPR_KEYS <= value.keys() or value.get("role") != "assistant":
        return None
    try:
        return from_openai_message(value)
    except MessageError:
        return None


def from_genai_messages(value: Any) -> list[dict]:
    """`gen_ai.input.messages` / `gen_ai.output.messages`: JSON text on spans, a
    structured list on log events."""
    doc = _loads(value, "messages")
    if not isinstance(doc, list):
        raise MessageError(f"messages must be a list, got {type(doc).__name__}")
    out: list[dict] = []
    for m in doc:
        out.extend(from_genai_message(m))
    return out


def from_system_instructions(value: Any) -> dict | None:
    """`gen_ai.system_instructions`: a list of parts (not of messages)."""
    doc = _loads(value, "system instructions")
    if doc is None:
        return None
    if isinstance(doc, str):
        return message("system", doc)
    if not isinstance(doc, list):
        raise MessageError("system instructions must be a list of parts")
    texts = [_text(p.get("content", "")) for p in doc if isinstance(p, dict) and p.get("type", "text") == "text"]
    return message("system", _join(texts))


# --- OpenAI chat format (legacy events, raw input/output values, Agent Lightning) ---------


def _openai_content(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        texts = []
        for p in content:
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, dict) and p.get("type") in ("text", "input_text", "output_text"):
                texts.append(_text(p.get("text", "")))
        return _join(texts)
    return _text(content)


def from_openai_message(m: Any) -> dict:
    if not isinstance(m, dict):
        raise MessageError(f"a message must be an object, got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str):
        raise MessageError("a message has no role")
    calls = []
    for c in m.get("tool_calls") or []:
        if not isinstance(c, dict):
            raise MessageError("a tool call must be an object")
        fn = c.get("function") or {}
        calls.append({
            "id": c.get("id"),
            "name": fn.get("name", c.get("name")),
            "arguments": arguments_json(fn.get("arguments", c.get("arguments"))),
        })
    fc = m.get("function_call")
    if isinstance(fc, dict):  # the pre-tools OpenAI API
        calls.append({"id": None, "name": fc.get("name"), "arguments": arguments_json(fc.get("arguments"))})
    return message(role, _openai_content(m.get("content")), name=m.get("name"), tool_calls=calls,
                   tool_call_id=m.get("tool_call_id") or (m.get("id") if role == "tool" else None))


def from_openai_messages(value: Any) -> list[dict]:
    doc = _loads(value, "messages")
    if not isinstance(doc, list):
        raise MessageError(f"messages must be a list, got {type(doc).__name__}")
    return [from_openai_message(m) for m in doc]


def tool_call_ids(messages: Iterable[dict]) -> set[str]:
    return {c["id"] for m in messages for c in m["tool_calls"] if c.get("id")}
