"""Transitions datasets for trainer tests, written with the real schema the way
`nightshift build` writes them (one Parquet file per date partition)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from nightshift.schemas import SCHEMA_VERSION, transitions

CALC_TOOL = [{"type": "function", "function": {"name": "calculator", "description": "evaluate arithmetic",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}}}}}]


def msg(role: str, content: str | None = None, tool_calls: list | None = None, tool_call_id: str | None = None) -> dict:
    return {"role": role, "content": content, "name": None,
            "tool_calls": [{"id": tc.get("id", f"call_{i}"), "name": tc["name"],
                            "arguments": tc["arguments"] if isinstance(tc["arguments"], str) else json.dumps(tc["arguments"])}
                           for i, tc in enumerate(tool_calls)] if tool_calls else None,
            "tool_call_id": tool_call_id}


def row(prompt: str | list[dict], answer: str | dict, reward: float | None, *, advantage: float | None = None,
        trajectory: str | None = None, group: str | None = None, step: int = 0, num_steps: int = 1,
        weight: float = 1.0, agent: str = "agent", model: str = "tiny", tools: list | None = None,
        prompt_token_ids: list[int] | None = None, completion_token_ids: list[int] | None = None,
        completion_logprobs: list[float] | None = None, when: dt.datetime | None = None) -> dict:
    """One transition. `prompt`: a user message or a list of messages; `answer`: the
    assistant's text, or a message dict (for tool calls)."""
    inputs = [msg("user", prompt)] if isinstance(prompt, str) else prompt
    output = msg("assistant", answer) if isinstance(answer, str) else answer
    traj = trajectory or hashlib.sha1(f"{inputs}{output}{reward}{when}".encode()).hexdigest()[:32]
    span = hashlib.sha1(f"{traj}{step}".encode()).hexdigest()[:16]
    when = when or dt.datetime(2026, 11, 20, 12, tzinfo=dt.timezone.utc)
    return {
        "transition_id": hashlib.sha1(f"{traj}{span}".encode()).hexdigest()[:32], "trace_id": traj, "span_id": span,
        "trajectory_id": traj, "group_id": group, "step": step, "num_steps": num_steps, "agent_name": agent,
        "service_name": "svc", "model": model, "provider": "openai", "input_messages": inputs,
        "output_message": output, "tools": json.dumps(tools) if tools else None, "finish_reason": "stop",
        "prompt_token_ids": prompt_token_ids, "completion_token_ids": completion_token_ids,
        "completion_logprobs": completion_logprobs, "input_tokens": None, "output_tokens": None,
        "reward": reward, "reward_source": "span" if reward is not None else None, "return": reward,
        "advantage": advantage if advantage is not None else reward, "start_time": when,
        "end_time": when + dt.timedelta(seconds=1), "convention": "otel_genai", "truncated": False,
        "weight": weight, "flags": [], "schema_version": SCHEMA_VERSION,
    }


def write(data: Path, rows: list[dict], date: str = "2026-11-20", name: str = "part-0.parquet") -> Path:
    d = Path(data) / "transitions" / f"date={date}"
    d.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=transitions.SCHEMA)
    pq.write_table(table, d / name)
    return d / name
