"""Which spans are LLM calls, which are agents, and which agent each call ran in.

Rows come only from inference spans; agent spans (`invoke_agent`) repeat the
messages of the calls inside them and would count them twice.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

INFERENCE_OPERATIONS = frozenset({"chat", "text_completion", "generate_content"})
AGENT_OPERATIONS = frozenset({"invoke_agent", "create_agent"})
_AGL_LLM_SPAN = re.compile(r"openai\.chat\.completion")


def is_inference(name: str, attrs: Mapping[str, Any]) -> bool:
    op = attrs.get("gen_ai.operation.name")
    if op is not None:
        return op in INFERENCE_OPERATIONS
    kind = attrs.get("openinference.span.kind")
    if kind is not None:
        return kind == "LLM"
    if attrs.get("llm.request.type") in ("chat", "completion"):  # OpenLLMetry before 0.55
        return True
    if _AGL_LLM_SPAN.search(name or "") or "response_token_ids" in attrs:  # Agent Lightning 0.x
        return True
    return False


def agent_name(name: str, attrs: Mapping[str, Any]) -> str | None:
    """The agent this span stands for, if it is an agent span."""
    op = attrs.get("gen_ai.operation.name")
    if op in AGENT_OPERATIONS:
        return attrs.get("gen_ai.agent.name") or (name.split(" ", 1)[1] if " " in (name or "") else None)
    if attrs.get("openinference.span.kind") == "AGENT":
        return attrs.get("agent.name") or name or None
    if attrs.get("traceloop.span.kind") == "agent":
        return attrs.get("traceloop.entity.name") or name or None
    # Agent Lightning's list, in its order (OpenAI Agents SDK, AutoGen, LangChain, Agent Framework).
    for key in ("agent.name", "recipient_agent_type", "langchain.chain.type", "executor.id"):
        value = attrs.get(key)
        if value:
            return str(value)
    return None


def enclosing_agent(span_id: str, parent_of: Mapping[str, str | None], agent_of: Mapping[str, str]) -> str | None:
    """The nearest agent at or above `span_id` in its trace (cycles and orphans end the walk)."""
    seen = set()
    current: str | None = span_id
    while current is not None and current not in seen:
        seen.add(current)
        if current in agent_of:
            return agent_of[current]
        current = parent_of.get(current)
    return None
