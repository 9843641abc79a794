"""Transitions to token ids: the state (input messages and tools) rendered with the
base model's own chat template as the prompt, the action (the output message and
its tool calls) as the completion, the way TRL's trainers and the serving engine
render them. Where a row carries the token ids the model really saw and sampled,
they are compared with ours: a row whose ids differ has drifted (BPE ambiguity,
re-serialized tool calls, a different template) and its logged logprobs cannot be
paired with our tokens.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .select import TrainDataError

#: Tokens the template may add after the sampled completion: the end-of-turn
#: token and the newline after it (vLLM's ids stop at, or include, the stop token).
MAX_TEMPLATE_TAIL = 2


def tool_arguments(text: Any) -> Any:
    """Chat templates expect tool-call arguments as a mapping (they `tojson` it);
    the dataset keeps the model's JSON text. Unparseable text stays text."""
    if not isinstance(text, str):
        return text if text is not None else {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def chat_message(m: dict) -> dict:
    """A transitions message struct as a Hugging Face / OpenAI chat message."""
    out: dict[str, Any] = {"role": m.get("role") or "user", "content": m.get("content") or ""}
    if m.get("name"):
        out["name"] = m["name"]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": tc.get("id") or f"call_{i}", "type": "function",
             "function": {"name": tc.get("name") or "", "arguments": tool_arguments(tc.get("arguments"))}}
            for i, tc in enumerate(m["tool_calls"])
        ]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def tools_of(row: dict) -> list[dict] | None:
    text = row.get("tools")
    if not text:
        return None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError:
        return None
    return tools if isinstance(tools, list) and tools else None


def conversation(row: dict, fallback_tools: list[dict] | None = None) -> tuple[list[dict], dict, list[dict] | None]:
    """(prompt messages, completion message, tools) of a row, in chat format; the
    fallback tools stand in where the row recorded none."""
    prompt = [chat_message(m) for m in (row.get("input_messages") or [])]
    completion = chat_message(row["output_message"])
    completion["role"] = "assistant"
    return prompt, completion, tools_of(row) or fallback_tools


def uses_tools(row: dict) -> bool:
    """Whether the call involved tools (calls in its output or its history)."""
    msgs = [*(row.get("input_messages") or []), row.get("output_message") or {}]
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in msgs)


def require_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise TrainDataError(
            f"the tokenizer of {where} has no chat template, so prompts cannot be rendered the way the model "
            "sees them; give one with train.chat_template: FILE.jinja (--chat-template)")


def _ids(encoded: Any) -> list[int]:
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return list(encoded)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Rendered:
    prompt_ids: list[int]
    completion_ids: list[int]
    logged: str = "none"  # none | match | drift: how the row's logged token ids compare with ours
    old_logprobs: list[float] | None = None  # per completion token, NaN where not logged
    prefix_mismatch: bool = False  # the template renders the prompt differently alone and in context

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def render(tokenizer, row: dict, fallback_tools: list[dict] | None = None) -> Rendered:
    """Token ids of one transition, TRL's recipe: the prompt with the generation
    prompt, prompt + completion in full, the completion where they diverge.
    Raises whatever the template raises (the caller counts it)."""
    prompt, completion, tools = conversation(row, fallback_tools)
    p = _ids(tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True))
    pc = _ids(tokenizer.apply_chat_template(prompt + [completion], tools=tools, tokenize=True, return_dict=True))
    n = common_prefix(p, pc)
    out = Rendered(prompt_ids=pc[:n], completion_ids=pc[n:], prefix_mismatch=n < len(p))
    _compare_logged(out, row, len(tokenizer))
    return out


def _compare_logged(r: Rendered, row: dict, vocab: int) -> None:
    """Set `logged` and, where the logged completion is our completion (up to the
    template's closing tokens) and its logprobs are whole, `old_logprobs`."""
    lp, lc, lps = row.get("prompt_token_ids"), row.get("completion_token_ids"), row.get("completion_logprobs")
    if lp is None and lc is None:
        return
    r.logged = "drift"
    if any(t < 0 or t >= vocab for t in (*(lp or ()), *(lc or ()))):
        return  # ids from another vocabulary
    if lp is not None and list(lp) != r.prompt_ids:
        return
    if lc is not None:
        lc = list(lc)
        extra = len(r.completion_ids) - len(lc)
        if not 0 <= extra <= MAX_TEMPLATE_TAIL or r.completion_ids[: len(lc)] != lc:
            return
    r.logged = "match"
    if lc is not None and lps is not None and len(lps) == len(lc) and all(x is not None and math.isfinite(x) and x <= 0 for x in lps):
        r.old_logprobs = [float(x) for x in lps] + [math.nan] * (len(r.completion_ids) - len(lc))


#: A Hermes/Qwen tool call in generated text, what vLLM's `hermes` parser reads.
TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) from generated text: Hermes-style blocks become OpenAI
    tool calls (arguments as JSON text); a block that is not valid JSON stays text."""
    calls, kept = [], text
    for m in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or "name" not in obj:
            continue
        args = obj.get("arguments", {})
        calls.append({"id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": str(obj["name"]),
                                   "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}})
        kept = kept.replace(m.group(0), "")
    content = kept.strip() if calls else text
    return (content or None) if calls else content, calls
