"""What the critique reads: some of a prompt version's failed trajectories and, beside
them, some that went well, each as the conversation its agent saw, with the tool
errors and the users' feedback comments recorded for it.

Failures first, and more of them (ProTeGi's lesson: a critique batch without
failures has nothing to say; APO that samples uniformly at a 15 % failure rate
sees one in three batches without one), successes beside them so the critic sees
what must not break. Within equal rewards the choice is a hash of the trajectory
and `salt` (the night), so each night reads different ones, reproducibly, and the
manifest lists exactly which.

Only this agent's own calls are read: a judge or evaluator in the same trace
(whose request may hold the expected answer) never reaches the critic. The
conversation is the agent's last call in the trajectory (its input holds the
history), without the system prompt, which the critique shows once.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import polars as pl

from . import lake

#: A tool result matching this was an error (the build's `credit.tool_error_pattern` default).
TOOL_ERROR = re.compile(r"(?i)\b(error|exception|traceback|failed|not found|invalid|no such tool)\b")
MESSAGE_CHARS = 800


@dataclass
class Trajectory:
    id: str
    reward: float
    failed: bool
    text: str = ""  # rendered for the critique
    tool_errors: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)


@dataclass
class Evidence:
    """The trajectories read, in the order sent; `left_out`: chosen but over the size budget."""

    trajectories: list[Trajectory]
    failed_total: int  # failed trajectories the version has (of which some were read)
    succeeded_total: int
    left_out: int = 0

    @property
    def failed(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.failed]

    @property
    def succeeded(self) -> list[Trajectory]:
        return [t for t in self.trajectories if not t.failed]

    def render(self) -> str:
        return "\n\n".join(t.text for t in self.trajectories)


def _order(salt: str, tid: str) -> bytes:
    return hashlib.blake2b(f"{salt}:{tid}".encode(), digest_size=8).digest()


def choose(outcomes: list[tuple[str, float]], failures: int, successes: int,
           salt: str) -> tuple[list[tuple[str, float, bool]], int, int]:
    """(id, reward, failed) of the trajectories to read, failures first, and how many
    failed and succeeded in all. Failed: 0 where rewards are 0/1, else below the mean."""
    if not outcomes:
        return [], 0, 0
    rewards = [r for _, r in outcomes]
    binary = all(r in (0.0, 1.0) for r in rewards)
    line = 1.0 if binary else sum(rewards) / len(rewards)
    bad = sorted(((t, r) for t, r in outcomes if r < line), key=lambda x: (x[1], _order(salt, x[0])))
    good = sorted(((t, r) for t, r in outcomes if r >= line), key=lambda x: (-x[1], _order(salt, x[0])))
    return ([(t, r, True) for t, r in bad[:failures]] + [(t, r, False) for t, r in good[:successes]],
            len(bad), len(good))


def _content(m: dict) -> str:
    text = m.get("content") or ""
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + f" [... {len(text) - MESSAGE_CHARS} more characters]"


def _calls(m: dict) -> str:
    return ", ".join(f"{c.get('name')}({c.get('arguments') or ''})" for c in m.get("tool_calls") or [])


def render(row: dict) -> tuple[list[str], list[str]]:
    """The conversation of one call (its input after the system prompt, then its
    answer) as lines, and the tool results in it that read as errors."""
    out, errors = [], []
    names = {}
    msgs = list(row.get("input_messages") or [])
    while msgs and msgs[0].get("role") in ("system", "developer"):
        msgs.pop(0)
    for m in msgs + [row.get("output_message") or {}]:
        role = m.get("role") or "assistant"
        for c in m.get("tool_calls") or []:
            names[c.get("id")] = c.get("name")
        if role == "tool":
            tool = names.get(m.get("tool_call_id")) or m.get("name") or "tool"
            text = _content(m)
            out.append(f"tool ({tool}): {text}")
            if TOOL_ERROR.search(text):
                errors.append(f"{tool}: {text}")
            continue
        calls = _calls(m)
        text = _content(m)
        if calls:
            out.append(f"{role}: {text + ' ' if text else ''}[calls {calls}]")
        elif text or role != "assistant":
            out.append(f"{role}: {text}")
        else:
            out.append(f"{role}: (empty answer, finish reason {row.get('finish_reason') or '?'})")
    return out, errors


def gather(data: str, frame: pl.DataFrame, agent: str, version: str, failures: int, successes: int, salt: str,
           max_chars: int, storage_options: dict | None = None) -> Evidence:
    """The evidence for one agent's prompt version, from `versions.by_agent(...).frame`."""
    mine = frame.filter((pl.col("agent") == agent) & (pl.col("version") == version))
    firsts = (mine.sort("trajectory_id", "step").group_by("trajectory_id", maintain_order=True)
              .agg(pl.col("outcome").first(), pl.col("transition_id").last().alias("last_call"),
                   pl.col("trace_id").unique().alias("traces")))
    rated = firsts.filter(pl.col("outcome").is_not_null())
    picked, n_bad, n_good = choose(list(zip(rated["trajectory_id"], rated["outcome"])), failures, successes, salt)
    info = {r["trajectory_id"]: r for r in rated.iter_rows(named=True)}
    rows = {r["transition_id"]: r for r in
            lake.messages(data, [info[t]["last_call"] for t, _, _ in picked], storage_options)}
    traces = sorted({tr for t, _, _ in picked for tr in info[t]["traces"]})
    failed_tools, convs = lake.around(data, traces, storage_options)
    conv_of: dict[str, set[str]] = {}
    for tr, c in convs.iter_rows():
        conv_of.setdefault(tr, set()).add(c)
    notes = lake.comments(data, traces, sorted({c for cs in conv_of.values() for c in cs}), storage_options)
    out, used, left = [], 0, 0
    for k, (tid, reward, failed) in enumerate(picked):
        row = rows.get(info[tid]["last_call"])
        if row is None:
            continue
        lines, errors = render(row)
        mine_traces = set(info[tid]["traces"])
        mine_convs = {c for tr in mine_traces for c in conv_of.get(tr, ())}
        errors += [f"{t}: {m or 'failed'}" for tr, t, m in failed_tools.iter_rows() if tr in mine_traces]
        said = [f"\"{c}\" ({n} = {v:g})" for tr, cv, n, v, c in notes.iter_rows()
                if tr in mine_traces or (cv is not None and cv in mine_convs)]
        head = f"### trajectory {k + 1}: {'FAILED' if failed else 'succeeded'} (reward {reward:g})"
        body = [head, *lines]
        body += [f"tool error: {e}" for e in dict.fromkeys(errors)]
        body += [f"feedback: {s}" for s in dict.fromkeys(said)]
        text = "\n".join(body)
        if used + len(text) > max_chars and out:
            left += 1
            continue
        used += len(text)
        out.append(Trajectory(tid, reward, failed, text, list(dict.fromkeys(errors)), list(dict.fromkeys(said))))
    return Evidence(out, n_bad, n_good, left)
