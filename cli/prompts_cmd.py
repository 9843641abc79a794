"""`nightshift prompts`: each agent's prompt versions and how each did; `prompts
propose`: one round of automatic prompt optimization; `prompts meta`: where the
meta-prompts are."""

from __future__ import annotations

import argparse
import json

from nightshift.settings import flags_of, load

from .console import say

DESCRIPTION = """Each agent's prompt versions, read from the transitions: its leading system
messages and its tools, identified by a content hash (12 hex digits), with the
calls made with it, its trajectories, how many carry a reward, and their mean
reward with a 95 % interval (a success rate with Wilson's interval when rewards
are 0/1), like `nightshift versions` for adapters. `*` marks the version of the
agent's newest call. A version recorded by name (gen_ai.prompt.name/version,
OpenInference's llm.prompt_template.version, Langfuse's) says so.

Per-request data in a prompt is folded into {{slots}} before hashing, so one
template is one version: dates, times, UUIDs, long hex ids, e-mail addresses and
numbers of 6+ digits by pattern; other values (names, cities) once three requests
differ in the same short span of one line. Not detected: a value seen in fewer
than three prompts, per-request text longer than a line or 60 characters (a
pasted document): such an agent shows many versions of one call each.

Candidates proposed by `nightshift prompts propose` are listed under their agent
(with --json, beside the versions)."""

PROPOSE_DESCRIPTION = """One round of automatic prompt optimization for one agent: from the
trajectories of its current prompt (failed ones first, with their tool errors and
feedback comments; successful ones beside them), the proposer LLM writes a critique,
then apo.candidates edited prompts. Each is checked (not empty, not garbled, not
enormous, not unchanged, placeholders and tool names kept, no per-request data
copied from the conversations) and stored as <candidates_dir>/<agent>/vNNNN/ with a
manifest: parent, critique, the trajectories read, the proposer's model and settings.
With apo.gate.command set, each is screened by it (the weight gate's contract).

The proposer is any OpenAI-compatible API: apo.base_url, apo.model, and the key
from the environment variable apo.api_key_env names (never logged or written).
Its calls send no traceparent and make no OpenTelemetry spans: they never enter
the lake as agent traffic. The meta-prompts are files (`nightshift prompts meta`)."""

PROPOSE_EPILOG = """Examples:
  export OPENAI_API_KEY=...
  nightshift prompts propose --agent support --base-url https://api.openai.com/v1 \\
      --model gpt-4.1-mini --api-key-env OPENAI_API_KEY
  nightshift prompts propose --agent support --base-url http://vllm:8000/v1 --model Qwen/Qwen2.5-7B-Instruct

"""
SETTINGS = ("the `apo:` section and top-level `data:`", "NIGHTSHIFT_APO_*, NIGHTSHIFT_DATA")
PROPOSE_EXITS = ("0 candidates stored, 1 none (no failures to learn from, every proposal refused, the proposer "
                 "unreachable, no transitions, a candidates folder that cannot be written), 2 bad settings (no "
                 "proposer, a key variable not set, an unknown agent, a meta-prompt file that cannot be used) or "
                 "a dataset this version cannot read")


def add_prompts(sub, common) -> None:
    from nightshift.prompts.config import ApoConfig

    from .helptext import epilog

    p = sub.add_parser("prompts", help="each agent's prompt versions with their production reward; propose better ones",
                       description=DESCRIPTION,
                       epilog=epilog("", *SETTINGS, "0 listed, 1 no transitions yet or no such agent, 2 bad settings or a "
                                     "dataset this version cannot read"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(p, ApoConfig, "apo", ("data", "storage_options", "since", "min_trajectories", "candidates_dir"))
    p.add_argument("--agent", metavar="NAME", help="only this agent")
    p.add_argument("--json", action="store_true", help="print JSON: agents, their versions and candidates")
    p.set_defaults(func=cmd_prompts)
    actions = p.add_subparsers(dest="prompts_action", metavar="ACTION")
    pr = actions.add_parser("propose", help="critique an agent's prompt from its failures and store edited candidates",
                            description=PROPOSE_DESCRIPTION, epilog=epilog(PROPOSE_EPILOG, *SETTINGS, PROPOSE_EXITS),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    common(pr, ApoConfig, "apo")
    pr.add_argument("--agent", metavar="NAME", required=True, help="the agent whose prompt to improve")
    pr.set_defaults(func=cmd_propose)
    m = actions.add_parser("meta", help="where the built-in meta-prompts are, and which files are used",
                           description="The meta-prompt files the proposer is sent: the built-in folder, and with "
                                       "apo.meta_prompts the folder whose files replace or add to them.",
                           epilog=epilog("", *SETTINGS, "0 shown, 2 a meta-prompt file that cannot be used"),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    common(m, ApoConfig, "apo", ("meta_prompts",))
    m.set_defaults(func=cmd_meta)


def _config(args: argparse.Namespace):
    from nightshift.prompts.config import ApoConfig

    return load(ApoConfig, "apo", args.config, flags_of(ApoConfig, args))


def cmd_prompts(args: argparse.Namespace) -> int:
    from nightshift.prompts import store
    from nightshift.prompts.lake import NoTransitions
    from nightshift.prompts.versions import by_agent, lines
    from nightshift.schemas.layout import LayoutError

    cfg = _config(args)
    try:
        table = by_agent(cfg.data, cfg.since, cfg.storage_options, min_trajectories=cfg.min_trajectories)
    except LayoutError as e:  # a newer schema version or a missing column: the data is wrong, not absent
        say(f"nightshift prompts: {e}", args.log_format)
        return 2
    except (NoTransitions, OSError) as e:
        say(f"nightshift prompts: {e}", args.log_format)
        return 1
    if args.agent:
        mine = table.agent(args.agent)
        if mine is None:
            say(f"nightshift prompts: no agent named {args.agent!r} (agents: "
                f"{', '.join(repr(a.agent) for a in table) or 'none'})", args.log_format)
            return 1
        table[:] = [mine]
    cands = {a.agent: store.candidates(cfg.store(), a.agent, cfg.storage_options) for a in table}
    if args.json:
        doc = {"agents": [{"agent": a.agent, "no_content": a.no_content, "versions": [v.as_dict() for v in a.versions],
                           "candidates": [_candidate(c) for c in cands[a.agent]]} for a in table],
               "notes": table.notes}
        print(json.dumps(doc, indent=2, ensure_ascii=False))
        return 0
    out = lines(table, cfg.min_trajectories)
    for a in table:
        if cands[a.agent]:
            out.append(f"candidates of {a.agent} ({store.agent_root(cfg.store(), a.agent)}):")
            for c in cands[a.agent]:
                d = _candidate(c)
                screen = ("" if d["screen"] is None else
                          f"; screening {'passed' if d['screen'].get('passed') else 'FAILED'}")
                out.append(f"  {c.version} {d['version_id']} from {d['parent']} ({d['created']}){screen}")
    print("\n".join(out))
    return 0


def _candidate(c) -> dict:
    m = c.manifest
    return {"version": c.version, "version_id": c.version_id, "path": c.path, "created": m.get("created"),
            "parent": (m.get("parent") or {}).get("version_id"), "system": c.system,
            "proposer_model": (m.get("proposer") or {}).get("model"), "screen": c.screen}


def cmd_propose(args: argparse.Namespace) -> int:
    from nightshift.judge.screen import screener
    from nightshift.prompts.client import ProposerError
    from nightshift.prompts.lake import NoTransitions
    from nightshift.prompts.meta import MetaError
    from nightshift.prompts.propose import ApoError, lines, propose
    from nightshift.prompts.store import StoreError
    from nightshift.schemas.layout import LayoutError

    from .console import setup_logging

    cfg = _config(args)
    setup_logging(cfg.log_level, args.log_format)
    try:
        rnd = propose(cfg, args.agent, screen=screener(cfg))
    except (ApoError, MetaError, ProposerError, LayoutError) as e:
        say(f"nightshift prompts propose: {e}", args.log_format)
        return 2
    except (NoTransitions, StoreError) as e:
        say(f"nightshift prompts propose: {e}", args.log_format)
        return 1
    except OSError as e:  # the candidates folder or its beam.json could not be written
        say(f"nightshift prompts propose: cannot write under {cfg.store()}: {e.strerror or e}", args.log_format)
        return 1
    print("\n".join(lines(rnd)))
    return 0 if rnd.stored else 1


def cmd_meta(args: argparse.Namespace) -> int:
    from nightshift.prompts.meta import BUILT_IN, MetaError, load as load_meta

    cfg = _config(args)
    try:
        meta = load_meta(cfg.meta_prompts)
    except MetaError as e:
        say(f"nightshift prompts meta: {e}", args.log_format)
        return 2
    print(f"built-in meta-prompts: {BUILT_IN}")
    for name, rec in meta.record().items():
        print(f"  {name}: {rec['path']}")
    print("copy the folder, edit, and set apo.meta_prompts to it; {{field}}s each file may use are checked on load")
    return 0
