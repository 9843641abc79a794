"""Readers that recover one LLM call from a span's attributes, one per
instrumentation layout. Each takes the span's attributes as a plain `{key: value}`
dict and returns a `Call`, or None when the layout is not there.

Layouts: OpenTelemetry GenAI JSON attributes (semconv >= 1.37, also OpenLLMetry
>= 0.55), OpenInference's flattened `llm.*_messages.{i}.message.*`, and
OpenLLMetry's older `gen_ai.prompt.{i}.*` / `gen_ai.completion.{i}.*` (what Agent
Lightning 0.x reads). Log-event layouts and span-kind detection come later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from .messages import (
    MessageError,
    arguments_json,
    from_genai_messages,
    from_openai_messages,
    from_system_instructions,
    message,
    normalize_finish_reason,
    python_literal,
)


@dataclass
class Call:
    convention: str
    input_messages: list[dict] = field(default_factory=list)
    output_message: dict | None = None
    tools: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    problems: list[str] = field(default_factory=list)  # why a row is flagged
    #: the input holds only the messages appended since the conversation's previous
    #: call (`gen_ai.input.messages_delta`): the build puts the history back
    input_is_delta: bool = False
    delta_system: dict | None = None  # a delta call's system instructions, apart

    def tools_json(self) -> str | None:
        return json.dumps(self.tools, ensure_ascii=False, separators=(",", ":")) if self.tools else None


_INDEXED = re.compile(r"^(\d+)\.(.+)$")


#: key -> (head, index, rest) for keys with an indexed part, else None. Keys repeat
#: across spans (`gen_ai.prompt.0.content` in every call), so each is split once.
_SPLIT: dict[str, tuple[str, int, str] | None] = {}
_SPLIT_MAX = 200_000


def _split_key(key: str) -> tuple[str, int, str] | None:
    try:
        return _SPLIT[key]
    except KeyError:
        pass
    out = None
    parts = key.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            out = (".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1:]))
            break
    if len(_SPLIT) >= _SPLIT_MAX:  # unbounded key spaces (ids in keys) must not grow memory
        _SPLIT.clear()
    _SPLIT[key] = out
    return out


class Attrs(dict):
    """A span's attributes with their indexed groups (`prefix.{i}.rest`) found in
    one pass over the keys, instead of one pass per prefix a reader asks for."""

    _groups: dict[str, dict[int, dict[str, Any]]] | None = None

    def group(self, prefix: str) -> list[dict[str, Any]]:
        if self._groups is None:
            groups: dict[str, dict[int, dict[str, Any]]] = {}
            for key, value in self.items():
                split = _split_key(key)
                if split is not None:
                    head, i, rest = split
                    groups.setdefault(head, {}).setdefault(i, {})[rest] = value
            self._groups = groups
        g = self._groups.get(prefix)
        return [g[i] for i in sorted(g)] if g else []


def indexed(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`prefix.0.a`, `prefix.0.b.c`, `prefix.1.a` -> `[{"a", "b.c"}, {"a"}]`, in index
    order; gaps (indices the SDK dropped) are skipped."""
    if isinstance(attrs, Attrs):
        return attrs.group(prefix)
    groups: dict[int, dict[str, Any]] = {}
    p = prefix + "."
    for key, value in attrs.items():
        if key.startswith(p):
            m = _INDEXED.match(key[len(p):])
            if m:
                groups.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return [groups[i] for i in sorted(groups)]


def _output_one(msgs: list[dict]) -> dict | None:
    """The first choice's message (several `tool` turns can't be an output)."""
    return msgs[0] if msgs else None


# --- OpenTelemetry GenAI JSON attributes -------------------------------------------------


#: The GenAI convention's pending delta form (semantic-conventions-genai PR #365): only the
#: input messages appended since the previous call of the same `gen_ai.conversation.id`,
#: in the schema of `gen_ai.input.messages`. A span that has both is read by the full one.
DELTA = "gen_ai.input.messages_delta"


def read_genai(attrs: dict[str, Any]) -> Call | None:
    full = "gen_ai.input.messages" in attrs
    if not full and DELTA not in attrs and "gen_ai.output.messages" not in attrs:
        return None
    call = Call("otel_genai")
    call.input_is_delta = not full and DELTA in attrs
    try:
        msgs = from_genai_messages(attrs["gen_ai.input.messages" if full else DELTA]) if (
            full or call.input_is_delta) else []
        system = attrs.get("gen_ai.system_instructions")
        s = from_system_instructions(system) if system is not None else None
        # the convention keeps the system prompt apart; OpenLIT and the openai-agents-v2
        # instrumentation record it in both places: once is what was sent
        if call.input_is_delta:  # it heads the whole history, put back by the build
            call.delta_system = s
        elif s is not None and not any(m["role"] == "system" and m["content"] == s["content"] for m in msgs):
            call.input_messages.append(s)
        call.input_messages += msgs
    except MessageError as e:
        call.problems.append(f"input messages: {e}")
    try:
        out = attrs.get("gen_ai.output.messages")
        if out is not None:
            raw = json.loads(out) if isinstance(out, str) else out
            call.output_message = _output_one(from_genai_messages(raw))
            if isinstance(raw, list) and raw and isinstance(raw[0], dict):
                call.finish_reason = normalize_finish_reason(raw[0].get("finish_reason"))
    except (MessageError, json.JSONDecodeError) as e:
        call.problems.append(f"output messages: {e}")
    # the span's reasons first: the conventions deprecated the output message's own (2026, #363)
    call.finish_reason = normalize_finish_reason(attrs.get("gen_ai.response.finish_reasons")) or call.finish_reason
    tools = attrs.get("gen_ai.tool.definitions")
    if tools is not None:
        try:
            doc = json.loads(tools) if isinstance(tools, str) else tools
            call.tools = doc if isinstance(doc, list) else [doc]
        except json.JSONDecodeError as e:
            call.problems.append(f"tool definitions: {e}")
    return call


# --- OpenInference -------------------------------------------------------------------------


def _oi_message(d: dict[str, Any]) -> dict:
    calls = [
        {"id": c.get("tool_call.id"), "name": c.get("tool_call.function.name"),
         "arguments": arguments_json(c.get("tool_call.function.arguments"))}
        for c in indexed(d, "message.tool_calls")
    ]
    content = d.get("message.content")
    if content is None:  # ordered multi-part contents
        texts = [c.get("message_content.text") for c in indexed(d, "message.contents")
                 if c.get("message_content.type", "text") == "text" and c.get("message_content.text") is not None]
        content = "".join(texts) if texts else None
    return message(str(d.get("message.role", "")), content, name=d.get("message.name"), tool_calls=calls,
                   tool_call_id=d.get("message.tool_call_id"))


def _oi_messages(d: dict[str, Any]) -> list[dict]:
    """One indexed input message, or the tool messages it stands for: OpenInference's
    AutoGen instrumentor records a turn of tool results as role `function` with each
    result a JSON object in `function.<k>` (`content`, `call_id`, `name`), where the
    request sent one `tool` message per result."""
    results = [d[k] for k in sorted((k for k in d if k.startswith("function.") and k[9:].isdigit()),
                                    key=lambda k: int(k[9:]))]
    if d.get("message.role") != "function" or not results:
        return [_oi_message(d)]
    out = []
    for r in results:
        try:
            r = json.loads(r) if isinstance(r, str) else r
        except json.JSONDecodeError:
            r = None
        if not isinstance(r, dict):
            return [_oi_message(d)]
        content = r.get("content")
        out.append(message("tool", content if isinstance(content, str) or content is None else json.dumps(content),
                           tool_call_id=r.get("call_id") or r.get("tool_call_id")))
    return out


def read_openinference(attrs: dict[str, Any]) -> Call | None:
    ins = indexed(attrs, "llm.input_messages")
    outs = indexed(attrs, "llm.output_messages")
    if not ins and not outs and "input.value" not in attrs:
        return None
    if not ins and not outs and attrs.get("openinference.span.kind") != "LLM":
        return None
    call = Call("openinference")
    call.input_messages = [m for d in ins for m in _oi_messages(d)]
    call.output_message = _oi_message(outs[0]) if outs else None
    if not ins and "input.value" in attrs:  # messages hidden or dropped: the raw request
        try:
            req = json.loads(attrs["input.value"])
            call.input_messages = from_openai_messages(req.get("messages", []))
        except (json.JSONDecodeError, AttributeError, MessageError) as e:
            call.problems.append(f"input.value: {e}")
    if call.output_message is None and "output.value" in attrs:
        try:
            resp = json.loads(attrs["output.value"])
            choice = (resp.get("choices") or [{}])[0]
            call.output_message = from_openai_messages([choice["message"]])[0]
            call.finish_reason = normalize_finish_reason(choice.get("finish_reason"))
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError, MessageError) as e:
            call.problems.append(f"output.value: {e}")
    for t in indexed(attrs, "llm.tools"):
        schema = t.get("tool.json_schema")
        try:
            call.tools.append(json.loads(schema) if isinstance(schema, str) else schema)
        except json.JSONDecodeError as e:
            call.problems.append(f"tool schema: {e}")
    call.finish_reason = call.finish_reason or normalize_finish_reason(attrs.get("llm.finish_reason"))
    if call.finish_reason is None and isinstance(out := attrs.get("output.value"), str) and '"finish_reason"' in out:
        try:  # a framework's own result object (AutoGen's CreateResult: `function_calls` | `stop`)
            call.finish_reason = normalize_finish_reason(json.loads(out).get("finish_reason"))
        except (json.JSONDecodeError, AttributeError):
            pass
    return call


# --- OpenLLMetry before 0.55 (and Agent Lightning 0.x's reader) ------------------------------


def _ollm_message(d: dict[str, Any]) -> dict:
    calls = [{"id": c.get("id"), "name": c.get("name"), "arguments": arguments_json(c.get("arguments"))}
             for c in indexed(d, "tool_calls")]
    return message(str(d.get("role", "")), d.get("content"), name=d.get("name"), tool_calls=calls,
                   tool_call_id=d.get("tool_call_id"))


def read_openllmetry_legacy(attrs: dict[str, Any]) -> Call | None:
    prompts = indexed(attrs, "gen_ai.prompt")
    completions = indexed(attrs, "gen_ai.completion")
    if not prompts and not completions:
        return None
    call = Call("openllmetry_legacy")
    call.input_messages = [_ollm_message(d) for d in prompts]
    if completions:
        call.output_message = _ollm_message(completions[0])
        call.finish_reason = normalize_finish_reason(completions[0].get("finish_reason"))
    for f in indexed(attrs, "llm.request.functions"):
        params = f.get("parameters")
        try:
            params = json.loads(params) if isinstance(params, str) else params
        except json.JSONDecodeError:
            call.problems.append(f"function {f.get('name')!r}: parameters are not JSON")
        call.tools.append({"type": "function", "name": f.get("name"), "description": f.get("description"),
                           "parameters": params})
    return call


#: Tried in order; the first layout present wins.
READERS: tuple[Callable[[dict[str, Any]], Call | None], ...] = (read_genai, read_openinference, read_openllmetry_legacy)


def read_call(attrs: dict[str, Any]) -> Call | None:
    if not isinstance(attrs, Attrs):
        attrs = Attrs(attrs)
    for reader in READERS:
        call = reader(attrs)
        if call is not None:
            return call
    return None


# --- GenAI log events, joined to their span by trace and span id -------------------------
#
# Each event is `{"event_name": str, "body": <python value>, "attributes": {key: value}}`,
# in the order the producer emitted them (time, then arrival).

_ROLE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
DETAILS_EVENT = "gen_ai.client.inference.operation.details"


def tools_from_events(events: list[dict[str, Any]]) -> list | None:
    """The tools offered, from the details event of a call whose span did not record
    them (OpenLIT writes them only there, as the Python repr of a list: read with
    `ast.literal_eval`, literals only, when it is not JSON)."""
    for ev in events:
        if ev.get("event_name") != DETAILS_EVENT:
            continue
        value = (ev.get("attributes") or {}).get("gen_ai.tool.definitions")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                if not value.lstrip().startswith("[{'"):
                    return None
                value = python_literal(value)
        if isinstance(value, list) and all(isinstance(t, dict) for t in value):
            return value
    return None


def read_events(events: list[dict[str, Any]]) -> Call | None:
    """The newer single `gen_ai.client.inference.operation.details` event (structured
    messages in its attributes or body), else the older per-message events
    (`gen_ai.user.message`, ..., `gen_ai.choice`)."""
    for ev in events:
        if ev.get("event_name") == DETAILS_EVENT:
            attrs = dict(ev.get("attributes") or {})
            if isinstance(ev.get("body"), dict):  # some producers put the fields in the body
                attrs = {**ev["body"], **attrs}
            call = read_genai(attrs)
            if call is not None:
                call.convention = "otel_genai_event"
                return call
    legacy = [ev for ev in events if ev.get("event_name") in _ROLE_EVENTS or ev.get("event_name") == "gen_ai.choice"]
    if not legacy:
        return None
    call = Call("otel_genai_events_legacy")
    for ev in legacy:
        name, body = ev["event_name"], ev.get("body")
        if not isinstance(body, dict):
            body = {"content": body}
        try:
            if name == "gen_ai.choice":
                if int(body.get("index", 0) or 0) != 0:
                    continue  # the first choice is the action taken
                # The spec nests the message; some producers put its fields at the top.
                msg = dict(body.get("message") or {k: body[k] for k in ("role", "content", "tool_calls") if k in body})
                msg.setdefault("role", "assistant")
                if body.get("tool_calls") and not msg.get("tool_calls"):
                    msg["tool_calls"] = body["tool_calls"]
                call.output_message = from_openai_messages([msg])[0]
                call.finish_reason = normalize_finish_reason(body.get("finish_reason"))
            else:
                msg = dict(body)
                msg["role"] = msg.get("role") or _ROLE_EVENTS[name]
                if msg["role"] == "tool" and "tool_call_id" not in msg:
                    msg["tool_call_id"] = msg.get("id")
                call.input_messages.append(from_openai_messages([msg])[0])
        except MessageError as e:
            call.problems.append(f"{name}: {e}")
    return call
