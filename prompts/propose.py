"""One round of prompt optimization for one agent, top to bottom: the beam's parents,
for each the evidence (its failed and successful trajectories), a critique, then
`apo.candidates` edits (the edit meta-prompts in turn), each validated and stored
as a versioned candidate; then screening, if configured, and the next beam.

Agent Lightning's loop (critique -> edit -> several candidates, a beam), with what
production traces change: the evidence is logged trajectories, failures first,
rather than fresh rollouts of each parent; nothing invalid is stored; a candidate
becomes a parent only with evidence (`beam`). A proposer that fails (times out,
answers garbage) costs that parent or that candidate, said in the result, never
the round: the other candidates are still made and stored.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from dataclasses import dataclass, field
from typing import Callable

from nightshift.schemas.prompt_identity import PromptVersion, tool_names
from nightshift.schemas.prompt_template import placeholders

from . import beam as beams
from . import meta as metas
from . import store
from .client import Endpoint, ProposerError, chat
from .config import ApoConfig
from .evidence import Evidence, gather
from .validate import Limits, extract, problem
from .versions import AgentPrompts, PromptStats, PromptTable, by_agent

log = logging.getLogger("nightshift.apo")

MAX_CRITIQUE_CHARS = 8000
CRITIQUE_WORDS = 350


class ApoError(ValueError):
    """A round that cannot start: one sentence saying why and what to set."""


@dataclass
class Parent:
    ref: str  # "lake" or a candidate's vNNNN
    version: PromptVersion
    stats: PromptStats | None  # its production figures, when it served


@dataclass
class Attempt:
    parent: str
    edit_prompt: str
    candidate: store.Candidate | None = None
    rejected: str = ""  # why nothing was stored


@dataclass
class Round:
    agent: str
    current: PromptStats
    critiques: dict[str, str] = field(default_factory=dict)  # parent ref -> critique
    evidence: dict[str, Evidence] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    beam: beams.Beam | None = None

    @property
    def stored(self) -> list[store.Candidate]:
        return [a.candidate for a in self.attempts if a.candidate is not None]


def endpoint(cfg: ApoConfig) -> Endpoint:
    if not cfg.base_url or not cfg.model:
        raise ApoError("no proposer: set apo.base_url (an OpenAI-compatible API) and apo.model "
                       "(--base-url/--model, or NIGHTSHIFT_APO_BASE_URL/NIGHTSHIFT_APO_MODEL)")
    return Endpoint(cfg.base_url, cfg.model, cfg.api_key_env, cfg.timeout, cfg.retries, cfg.temperature,
                    cfg.max_tokens)


def tools_text(tools: list[dict]) -> str:
    if not tools:
        return "(no tools)"
    out = []
    for t in tools:
        params = json.dumps(t.get("parameters"), sort_keys=True, ensure_ascii=False) if t.get("parameters") else "{}"
        out.append(f"- {t['name']}: {t.get('description') or '(no description)'}\n  parameters: {params[:1500]}")
    return "\n".join(out)


def _slots(text: str) -> str:
    return ", ".join("{{" + p + "}}" for p in placeholders(text)) or "none"


def _parents(b: beams.Beam, agent: AgentPrompts, cfg: ApoConfig, notes: list[str]) -> list[Parent]:
    out = []
    for e in b.entries:
        if e.ref == beams.LAKE:
            cur = agent.current
            out.append(Parent(e.ref, cur.version, cur))
            continue
        c = store.read(store.agent_root(cfg.store(), agent.agent), e.ref, cfg.storage_options)
        if c is None:
            notes.append(f"beam entry {e.ref} is no longer in the store: left out")
            continue
        v = PromptVersion.of([c.system], c.manifest.get("tools") or [])
        out.append(Parent(e.ref, v, agent.get(v.id)))
    return out


def _critique(ep: Endpoint, meta: metas.MetaPrompts, parent: Parent, ev: Evidence, cfg: ApoConfig) -> str:
    tools = parent.version.tool_list
    text = meta.critique.fill({
        "prompt": parent.version.text or "(the agent sends no system prompt)", "tools": tools_text(tools),
        "trajectories": ev.render(), "failed": len(ev.failed), "succeeded": len(ev.succeeded),
        "placeholders": _slots(parent.version.text), "tool_names": ", ".join(tool_names(tools)) or "none",
        "max_words": CRITIQUE_WORDS})
    reply = chat(ep, [{"role": "user", "content": text}])
    return reply.content.strip()[:MAX_CRITIQUE_CHARS]


def _edit(ep: Endpoint, edit: metas.MetaPrompt, parent: Parent, critique: str, cfg: ApoConfig) -> tuple[str | None, str]:
    tools = parent.version.tool_list
    text = edit.fill({
        "prompt": parent.version.text or "(the agent sends no system prompt)", "tools": tools_text(tools),
        "critique": critique, "placeholders": _slots(parent.version.text),
        "tool_names": ", ".join(tool_names(tools)) or "none", "max_chars": cfg.max_prompt_chars})
    reply = chat(ep, [{"role": "user", "content": text}])
    return extract(reply.content), reply.model or ""


def _files(parent: Parent, system: str, vid: str) -> dict[str, str]:
    tools = parent.version.tool_list

    def prompt_json(texts: list[str], version_id: str) -> str:
        return json.dumps({"version_id": version_id, "system": texts, "tools": tools}, indent=2, ensure_ascii=False)

    return {"system.txt": system, "prompt.json": prompt_json([system], vid),
            "parent/system.txt": parent.version.text, "parent/prompt.json": prompt_json(list(parent.version.system),
                                                                                      parent.version.id)}


def _stats(s: PromptStats | None) -> dict:
    if s is None:
        return {}
    return {k: getattr(s, k) for k in ("calls", "trajectories", "rated", "mean", "low", "high", "binary")}


def propose(cfg: ApoConfig, agent_name: str, *, salt: str | None = None, table: PromptTable | None = None,
            screen: Callable[[store.Candidate, str, str | None], dict] | None = None) -> Round:
    """Run one round for one agent and store what it proposes. `screen`: the judge's
    screening of each stored candidate (`judge.screen.screener(cfg)`), handed in
    because prompts/ never imports the judge; with `apo.gate.command` set and none
    handed in, the round refuses to start rather than let unscreened candidates
    pass as if no screening were configured."""
    if cfg.gate.command and screen is None:
        raise ApoError("apo.gate.command is set but this caller screens nothing: pass "
                       "screen=nightshift.judge.screen.screener(cfg)")
    ep = endpoint(cfg)
    ep.key()  # a key variable that is not set: said before anything is read
    meta = metas.load(cfg.meta_prompts)
    table = table if table is not None else by_agent(cfg.data, cfg.since, cfg.storage_options,
                                                     min_trajectories=cfg.min_trajectories)
    agent = table.agent(agent_name)
    if agent is None:
        known = ", ".join(repr(a.agent) for a in table) or "none"
        raise ApoError(f"no agent named {agent_name!r} in the transitions (agents: {known})")
    if agent.current is None:
        raise ApoError(f"agent {agent_name!r}'s calls were recorded without their messages: no prompt to improve "
                       "(turn content capture on: `nightshift doctor` says how)")
    salt = salt or dt.date.today().isoformat()
    root = cfg.store()
    store.clean_stale(root, agent_name)
    rnd = Round(agent_name, agent.current)
    old, note = beams.read(root, agent_name, cfg.storage_options)
    rnd.notes += [note] if note else []
    b, note = beams.start(old, agent_name, agent.current.id)
    rnd.notes += [note] if note else []
    if agent.current.shared_with:
        rnd.notes.append(f"agent(s) {', '.join(agent.current.shared_with)} send the same prompt: these candidates "
                         f"read only {agent_name!r}'s trajectories, and a change matched on the prompt's id alone "
                         "would reach theirs too")
    known_ids = {c.version_id: c.version for c in store.candidates(root, agent_name, cfg.storage_options)}
    limits = Limits(cfg.max_prompt_chars, cfg.max_growth)
    for parent in _parents(b, agent, cfg, rnd.notes):
        own = parent.stats if parent.stats is not None and parent.stats.rated else agent.current
        ev = gather(cfg.data, table.frame, agent_name, own.id, cfg.failures, cfg.successes, salt,
                    cfg.max_request_chars, cfg.storage_options)
        rnd.evidence[parent.ref] = ev
        if not ev.failed:
            why = ("no rated trajectories (rewards or feedback: `nightshift build` joins them)" if not own.rated
                   else "no failed trajectories")
            rnd.notes.append(f"parent {parent.ref} ({parent.version.id}): {why}: nothing to critique")
            continue
        try:
            critique = _critique(ep, meta, parent, ev, cfg)
        except ProposerError as e:
            rnd.notes.append(f"parent {parent.ref}: the critique failed: {e}")
            continue
        rnd.critiques[parent.ref] = critique
        log.info("critique of %s for %s: %d characters from %d trajectories", parent.ref, agent_name, len(critique),
                 len(ev.trajectories))
        for i in range(cfg.candidates):
            edit = meta.edits[i % len(meta.edits)]
            attempt = Attempt(parent.ref, edit.name)
            rnd.attempts.append(attempt)
            try:
                text, answered_as = _edit(ep, edit, parent, critique, cfg)
            except ProposerError as e:
                attempt.rejected = str(e)
                continue
            why = problem(text, parent.version.text, tool_names(parent.version.tool_list),
                          [t.text for t in ev.trajectories], limits)
            if not why:
                vid = PromptVersion.of([text], parent.version.tool_list).id
                same = (parent.ref if vid == parent.version.id else known_ids.get(vid))
                why = f"the same prompt as {same}" if same else ""
            if why:
                attempt.rejected = why
                continue
            v = PromptVersion.of([text], parent.version.tool_list)
            manifest = {
                "kind": "prompt",
                "parent": {"ref": parent.ref, "version_id": parent.version.id,
                           "system_hash": parent.version.system_hash, "system": parent.version.text,
                           **_stats(parent.stats)},
                "candidate": {"version_id": v.id, "system_hash": v.system_hash, "system": text, "chars": len(text),
                              "placeholders": placeholders(text), "replaces": len(parent.version.system)},
                "tools": parent.version.tool_list,
                "model": agent.current.model,
                "critique": critique,
                "evidence_version": own.id,
                "trajectories": [{"id": t.id, "reward": t.reward, "failed": t.failed} for t in ev.trajectories],
                "trajectories_available": {"failed": ev.failed_total, "succeeded": ev.succeeded_total},
                "salt": salt,
                "proposer": {**ep.record(), "answered_as": answered_as},
                "meta_prompts": meta.record(), "critique_prompt": meta.critique.name, "edit_prompt": edit.name,
            }
            attempt.candidate = store.commit(root, agent_name, _files(parent, text, v.id), manifest,
                                             cfg.storage_options)
            known_ids[v.id] = attempt.candidate.version
            log.info("stored candidate %s for %s (%s, from %s)", attempt.candidate.version, agent_name, v.id, parent.ref)
    if screen is not None:
        for c in rnd.stored:
            store.write_screen(c, screen(c, agent_name, agent.current.model), cfg.storage_options)
    rnd.beam = beams.update(b, rnd.stored, cfg.beam_width)
    beams.write(root, rnd.beam, cfg.storage_options)
    return rnd


def lines(rnd: Round) -> list[str]:
    """What `nightshift prompts propose` prints."""
    cur = rnd.current
    out = [f"agent {rnd.agent}: current prompt {cur.id} ({cur.calls:,} calls, {cur.trajectories:,} trajectories; "
           f"{cur.figure()})"]
    for ref, critique in rnd.critiques.items():
        ev = rnd.evidence[ref]
        out.append(f"critique of {ref} (from {len(ev.failed)} failed and {len(ev.succeeded)} successful trajectories"
                   f" of {ev.failed_total + ev.succeeded_total} rated):")
        out += ["    " + line for line in critique.splitlines()]
        for a in (a for a in rnd.attempts if a.parent == ref):
            if a.candidate is None:
                out.append(f"  refused ({a.edit_prompt}): {a.rejected}")
                continue
            c = a.candidate
            out.append(f"  candidate {c.version} ({c.version_id}, {a.edit_prompt}, {len(c.system):,} characters): "
                       f"{c.path}")
            out += ["    | " + line for line in c.system.splitlines()]
            if c.screen is not None:
                s = c.screen
                out.append(f"    screening: {'passed' if s.get('passed') else 'FAILED'} (exit {s.get('exit')})"
                           + (f", score {s['score']:g}" if "score" in s else "") + f": {s.get('summary', '')}")
    out += [f"note: {n}" for n in rnd.notes]
    if rnd.beam is not None:
        out.append("beam for the next round: " + ", ".join(
            f"{e.ref} ({e.version_id}{', score %g' % e.score if e.score is not None else ''})" for e in rnd.beam.entries))
    stored = len(rnd.stored)
    out.append(f"{stored} candidate(s) stored, {len(rnd.attempts) - stored} refused")
    return out
