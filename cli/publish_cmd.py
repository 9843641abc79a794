"""`nightshift publish`, `nightshift rollback` and `nightshift nightly`: a version
in front of the agents, and the scheduled job that does it every night."""

from __future__ import annotations

import argparse
import os
import sys

from nightshift.settings import add_flags, flags_of, load, read_file

from .console import say, setup_logging
from .helptext import epilog
from .train_cmd import train_settings, version_folder

PUBLISH_DESC = """Put a checkpoint version in front of the agents on a running vLLM server (or
`nightshift serve --engine transformers`).

LoRA (default): checks the adapter against vLLM's rules and the server's base
model, places it in a folder of its own per version, POST /v1/load_lora_adapter
as <name>@<version> (and --stable-name, moved to it by unload + load: never
vLLM's load_inplace, which re-reads the adapter every step), verifies with GET
/v1/models and one chat completion, records it in <checkpoints>/published.json
(atomically, only after verification), and unloads versions beyond --keep.
Publishing the same version again changes nothing. The server needs
--enable-lora, a --max-lora-rank at least the adapter's rank, and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (`nightshift serve --engine vllm` sets them).

--mode full merges the adapter and reloads the weights in place with
POST /collective_rpc {"method": "reload_weights"} and /reset_prefix_cache, which
exist only on a server started with VLLM_SERVER_DEV_MODE=1 (keep those routes
private: --api-key does not guard them). The production-safe alternative:
start a second server on the merged folder, switch traffic, stop the old one
(blue-green).

Every input is read and checked before the server is touched, and the change
is recorded as pending in published.json before it starts: a run killed at any
step is finished or undone by the next publish, rollback or watch, which says
what it repaired."""

#: Where publish and rollback read their settings: the `publish:` section, which
#: watch and the nightly job read too, so the file that publishes every night
#: publishes by hand the same way.
PUBLISH_SETTINGS = ("the `publish:` section (vllm_url, name, stable_name, adapter_root, keep, mode, ...; the same "
                    "keys under `nightly:`, their old place, still work and are deprecated), `train.output` (the "
                    "checkpoints folder) and `train.base_model` (--mode full's base when publish.base_model is not "
                    "set)",
                    "NIGHTSHIFT_PUBLISH_* (NIGHTSHIFT_PUBLISH_VLLM_URL, ...), NIGHTSHIFT_TRAIN_OUTPUT")
PUBLISH_EXITS = ("0 {done} and verified, 1 refused or failed (the server's message is printed verbatim; what the "
                 "server took is undone, the registry unchanged), 2 bad settings, or published.json cannot be used "
                 "(the message names the file and the problem; nothing was changed)")
VLLM_URL_NEEDED = ("say which server: --vllm-url URL, publish.vllm_url in --config, or NIGHTSHIFT_PUBLISH_VLLM_URL "
                   "(a publication never goes to a default address)")


def _publish_args(p: argparse.ArgumentParser, common) -> None:
    from nightshift.publish.publish import PublishSettings

    add_flags(p, PublishSettings, section="publish")
    for action in p._actions:
        if action.dest == "vllm_url":
            action.help = f"the server the agents use; {VLLM_URL_NEEDED.removeprefix('say which server: ')}"
    common(p, data=False)


def _settings(args: argparse.Namespace):
    """The publishing settings as the nightly job reads them (defaults < the YAML's
    `publish:` < NIGHTSHIFT_PUBLISH_* < flags; the old `nightly:` place still read),
    checked like every stage's, with the base model for --mode full from `train:`
    when `publish:` names none. The nightly job itself is not imported: it pulls in
    Polars, which a publication by hand does not need."""
    from nightshift.publish.publish import MOVED, PublishSettings
    from nightshift.settings import SettingsError

    said: list[str] = []
    s = load(PublishSettings, "publish", args.config, flags_of(PublishSettings, args), moved=MOVED, notes=said)
    for note in said:
        say(f"nightshift {args.command}: {note}", args.log_format)
    doc = read_file(args.config) if args.config else {}
    named = args.vllm_url or any(os.environ.get(f"NIGHTSHIFT_{sec.upper()}_VLLM_URL") for sec in ("publish", "nightly")) \
        or any("vllm_url" in (doc.get(sec) or {}) for sec in ("publish", "nightly"))
    if not named:
        raise SettingsError(VLLM_URL_NEEDED)
    s.base_model = s.base_model or train_settings(args).base_model
    return s


def add_publish(sub, common) -> None:
    p = sub.add_parser("publish", help="publish a checkpoint version to a running vLLM server",
                       description=PUBLISH_DESC, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog("", *PUBLISH_SETTINGS, PUBLISH_EXITS.format(done="published")))
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a version folder, e.g. "
                   "nightshift-checkpoints/v0003, or a version (v0003) under --checkpoints")
    p.add_argument("--checkpoints", metavar="DIR", help="the checkpoints folder a version name is looked up in "
                   "(default: train.output of --config, NIGHTSHIFT_TRAIN_OUTPUT, else ./nightshift-checkpoints)")
    _publish_args(p, common)
    p.set_defaults(func=cmd_publish)

    r = sub.add_parser("rollback", help="publish the version before the one serving",
                       description="Publish again the newest version older than the one serving this name on this "
                       "server (from <checkpoints>/published.json), verified like any publication.",
                       epilog=epilog("", *PUBLISH_SETTINGS, PUBLISH_EXITS.format(done="rolled back")),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--checkpoints", metavar="DIR", help="the checkpoints folder (default: train.output of --config, "
                   "NIGHTSHIFT_TRAIN_OUTPUT, else ./nightshift-checkpoints)")
    _publish_args(r, common)
    r.set_defaults(func=cmd_rollback)

    v = sub.add_parser("versions", help="production reward of each published version, per agent",
                       description="For each version that served calls (and the base model), the calls it made, its "
                       "trajectories, how many carry a reward, and their mean reward with a 95 % interval (a success "
                       "rate with Wilson's interval when rewards are 0/1), every agent together and each agent. "
                       "Late feedback counts once `nightshift build` has read it. A version with fewer rated "
                       "trajectories than --min-trajectories gets a count, not an interval.",
                       epilog=epilog("", "top-level `data:`, and `train.output` (the checkpoints folder) when "
                                     "--checkpoints is not given", "NIGHTSHIFT_DATA, NIGHTSHIFT_TRAIN_OUTPUT",
                                     "0 shown, 1 no transitions yet (run `nightshift build`), 2 bad settings or "
                                     "transitions this version cannot read"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(v)
    v.add_argument("--checkpoints", metavar="DIR", help="the checkpoints folder: publish order and times from its "
                   "published.json, versions no publication names and versions deleted from disk said as such "
                   "(default: train.output when --config or NIGHTSHIFT_TRAIN_OUTPUT gives it; else none)")
    v.add_argument("--since", metavar="YYYY-MM-DD", help="only calls from this date on")
    v.add_argument("--min-trajectories", type=int, default=30, metavar="N", help="rated trajectories for an interval (default 30)")
    v.set_defaults(func=cmd_versions)

    w = sub.add_parser("watch", help="judge the serving version (or a canary) by production's rewards, and act",
                       description=WATCH_DESC, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog("", "the `publish:` section, `nightly.watch` and `nightly.canary`, "
                                     "top-level `data:` and `train.output` (the checkpoints folder)",
                                     "NIGHTSHIFT_PUBLISH_* (NIGHTSHIFT_PUBLISH_VLLM_URL, ...), NIGHTSHIFT_NIGHTLY_WATCH_* "
                                     "and NIGHTSHIFT_NIGHTLY_CANARY_* (NIGHTSHIFT_NIGHTLY_WATCH_ALPHA, ...), "
                                     "NIGHTSHIFT_DATA, NIGHTSHIFT_TRAIN_OUTPUT",
                                     "0 kept, promoted or not yet decided, 3 rolled back or canary stopped, 1 failed, "
                                     "2 bad settings, published.json cannot be used or transitions this version "
                                     "cannot read"))
    common(w)
    w.add_argument("--checkpoints", metavar="DIR", help="the checkpoints folder, its published.json (default: "
                   "train.output of --config, NIGHTSHIFT_TRAIN_OUTPUT, else ./nightshift-checkpoints)")
    from nightshift.publish.publish import PublishSettings
    from nightshift.settings import flag_names

    add_flags(w, PublishSettings, section="publish")
    from nightshift.judge.watch_settings import Watching

    add_flags(w, Watching, section="nightly", only=tuple(
        p for p in flag_names(Watching) if p.startswith("watch.") and p != "watch.enabled"
        or p in ("canary.route_url", "canary.route_token", "canary.max_hours")))
    w.add_argument("--dry-run", action="store_true", help="say what it would do; change nothing")
    w.set_defaults(func=cmd_watch)

    n = sub.add_parser("nightly", help="build, train, gate and publish: the scheduled job",
                       description=NIGHTLY_DESC, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog(NIGHTLY_EPILOG, "top-level `data:`, the `retention:`, `compaction:`, `transform:`, "
                                     "`train:`, `publish:` and `nightly:` sections", "NIGHTSHIFT_DATA, "
                                     "NIGHTSHIFT_RETENTION_DAYS, NIGHTSHIFT_COMPACTION_*, "
                                     "NIGHTSHIFT_TRANSFORM_*, NIGHTSHIFT_TRAIN_*, "
                                     "NIGHTSHIFT_PUBLISH_*, NIGHTSHIFT_NIGHTLY_* (NIGHTSHIFT_NIGHTLY_GATE_COMMAND, ...)",
                                     NIGHTLY_EXITS))
    common(n)
    n.add_argument("--quiet", action="store_true", help="no progress bars")
    n.set_defaults(func=cmd_nightly)


def _refused(command: str, e: Exception, fmt: str) -> int:
    """A registry that cannot be used: exit 2, nothing changed on the server."""
    say(f"nightshift {command}: {e}; nothing was changed on the server or in the registry", fmt)
    return 2


def cmd_publish(args: argparse.Namespace) -> int:
    from nightshift.publish.publish import PublishError, publish
    from nightshift.publish.registry import RegistryError
    from nightshift.publish.vllm_client import VLLMError

    setup_logging(args.log_level or "warning", args.log_format)
    s = _settings(args)
    checkpoint = version_folder(args.checkpoint, train_settings(args).output)
    try:
        result = publish(checkpoint, s.vllm_url, **s.kwargs())
    except RegistryError as e:
        return _refused("publish", e, args.log_format)
    except (PublishError, VLLMError) as e:
        say(f"nightshift publish: {e}", args.log_format)
        return 1
    print("\n".join(result.lines()))
    return 0


def _data(args: argparse.Namespace) -> str:
    """--data, else NIGHTSHIFT_DATA, else the YAML's top-level `data:`, else the default."""
    if args.data or os.environ.get("NIGHTSHIFT_DATA"):
        return args.data or os.environ["NIGHTSHIFT_DATA"]
    return str((read_file(args.config).get("data") if args.config else None) or "./nightshift-data")


def cmd_versions(args: argparse.Namespace) -> int:
    from nightshift.judge.versions import by_version, lines

    from nightshift.schemas.layout import LayoutError

    setup_logging(args.log_level or "warning", args.log_format)
    checkpoints = args.checkpoints
    if not checkpoints and (args.config or os.environ.get("NIGHTSHIFT_TRAIN_OUTPUT")):
        checkpoints = train_settings(args).output
    try:
        stats = by_version(_data(args), args.since or "", args.min_trajectories, checkpoints=checkpoints)
    except LayoutError as e:  # a newer schema version or a missing column: the data is wrong, not absent
        say(f"nightshift versions: {e}", args.log_format)
        return 2
    except (FileNotFoundError, OSError) as e:  # versions.NoTransitions says what to run
        say(f"nightshift versions: {e}", args.log_format)
        return 1
    print("\n".join(lines(stats, args.min_trajectories)))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import PublishError
    from nightshift.publish.vllm_client import VLLMError
    from nightshift.publish.registry import RegistryError
    from nightshift.judge.watch import watch
    from nightshift.route.client import RouteError
    from nightshift.schemas.layout import LayoutError

    from nightshift.publish.publish import MOVED

    setup_logging(args.log_level or "warning", args.log_format)
    said: list[str] = []
    n = load(NightlyConfig, "nightly", args.config, flags_of(NightlyConfig, args), moved=MOVED, notes=said)
    for note in said:
        say(f"nightshift watch: {note}", args.log_format)
    checkpoints = train_settings(args).output
    from nightshift.judge.prompt_watch import watch_prompts
    from nightshift.prompts.config import ApoConfig
    from nightshift.publish import prompt_canary as trials
    from nightshift.publish.prompt_canary import TrialError

    apo = load(ApoConfig, "apo", args.config, {"data": _data(args)})  # the prompt candidates' store, its trials
    try:
        verdict, out = watch(_data(args), checkpoints, n, n.watch, n.canary, act=not args.dry_run)
        if not args.dry_run:  # a prompt change a killed process left half-done, settled before the look
            out += trials.reconcile(apo.store(), n.canary.route_token, apo.storage_options)
        prompts, more = watch_prompts(_data(args), apo.store(), n.watch, n.canary, checkpoints=checkpoints,
                                      act=not args.dry_run, storage_options=apo.storage_options)
    except (RegistryError, TrialError) as e:
        return _refused("watch", e, args.log_format)
    except LayoutError as e:  # a newer schema version or a missing column: nothing judged, nothing rolled back
        say(f"nightshift watch: {e}", args.log_format)
        return 2
    except (PublishError, VLLMError, RouteError, FileNotFoundError) as e:
        say(f"nightshift watch: {e}", args.log_format)
        return 1
    print("\n".join(out + more))
    stopped = [v for v in [verdict, *prompts] if v is not None and v.action in ("rolled back", "canary stopped")]
    return 3 if stopped else 0


WATCH_DESC = """Judge what production says of the versions it served, by an always-valid
sequential test (mSPRT: safe to run after every build, its false-alarm bound holds
over every look), and act:

- a canary running (nightly.canary.share > 0): the candidate against the serving
  version over the same hours; worse stops it (every conversation back on the
  serving version, the candidate unloaded); better, or shown no more than
  --margin worse, promotes it; undecided after --canary-max-hours, it expires;
- otherwise the serving version against the one it replaced; worse rolls it back
  through the verified publish path;
- each prompt canary (<apo.candidates_dir>/trials.json): the agent's conversations
  that saw the candidate prompt against its own prompt, the same test, margin and
  expiry; a promoted prompt is retired once the agent changes its own prompt.

Each decision goes to <checkpoints>/gate-log.jsonl. Settings as the nightly job's
(the `publish:` section of --config and `nightly:`'s watch and canary,
NIGHTSHIFT_PUBLISH_* and NIGHTSHIFT_NIGHTLY_*, then these flags).
The registry is read whole first: one that cannot be used is refused (exit 2)
rather than guessed at, since every decision may move the server; a change an
earlier run left pending is finished or undone before the look."""


def cmd_rollback(args: argparse.Namespace) -> int:
    from nightshift.publish.publish import PublishError, rollback
    from nightshift.publish.registry import RegistryError
    from nightshift.publish.vllm_client import VLLMError

    setup_logging(args.log_level or "warning", args.log_format)
    s = _settings(args)
    kw = s.kwargs()
    kw.pop("mode")  # the version's own publication says how it was served
    try:
        result = rollback(train_settings(args).output, s.vllm_url, **kw)
    except RegistryError as e:
        return _refused("rollback", e, args.log_format)
    except (PublishError, VLLMError) as e:
        say(f"nightshift rollback: {e}", args.log_format)
        return 1
    print("\n".join(result.lines()))
    return 0


NIGHTLY_DESC = """The scheduled job: prune the lake to its retention (retention.days, when set),
merge the small files of past dates (compaction), build the new transitions (from the last run's date), watch
what production says of the versions it served (roll back a worse one; stop or
promote a canary), train a new version (continuing the serving adapter), compare
it with the serving one on held-out transitions (and your evaluation command),
publish it if it is not worse (to all traffic, or as a canary through
`nightshift route`), and write a report (Markdown + a PNG plot across runs)
under <checkpoints>/reports/.

A lock keeps two runs apart; a state file (<checkpoints>/.nightly/state.json)
lets a run that died at any stage be resumed by the next invocation, and
nothing is ever published twice.

Your evaluation (nightly.gate.command) runs through the shell with
NIGHTSHIFT_CANDIDATE, NIGHTSHIFT_PUBLISHED (empty for the base model) and
NIGHTSHIFT_BASE_MODEL set, after the gate's own checks. Its exit code is its
verdict:
  0            the candidate may go out;
  1            it may not: a verdict, and its last output lines (stdout, else
               stderr) are the reason the report gives ("said no: ...");
  other codes, killed by a signal, or past gate.timeout
               the check itself failed (the report says "failed", with its
               exit code and last lines), and the candidate is held back too.
A JSON object on its last stdout line is kept with the decision in
<checkpoints>/gate-log.jsonl."""

NIGHTLY_EXITS = ("0 done (published, held back by the gate, a canary the routing proxy could not take, or nothing "
                 "new: see the report), 1 a stage failed (the next run resumes it), 2 bad settings, a state file it "
                 "cannot resume from or a dataset this version cannot read (the message says which; the next run "
                 "resumes), 75 another run holds the lock (try later)")

NIGHTLY_EPILOG = """One YAML file for every stage (sections data, transform, train, publish, nightly):

  data: /var/lib/nightshift/data
  retention: {days: 7}             # today and 7 days before it kept (`nightshift prune --help`)
  compaction: {target_bytes: 64MiB}   # small files of past dates merged (`nightshift compact --help`)
  transform: {settle: 10m, credit: {strategy: identical}}
  train:
    base_model: /models/Qwen2.5-1.5B-Instruct
    served_model_name: Qwen/Qwen2.5-1.5B-Instruct
    output: /var/lib/nightshift/checkpoints   # the checkpoints folder (--checkpoints)
    algorithm: sft                 # the default: see `nightshift train --help` for the others
  publish:                         # read by publish, rollback, watch and nightly
    vllm_url: http://vllm:8000
    name: support-agent
    stable_name: support-agent
    keep: 3
  nightly:
    gate: {ranking_confidence: 0.95, validity_margin: 0.05, command: "python eval.py"}   # exit 1: says no
    watch: {alpha: 0.01, min_trajectories: 30, margin: 0.05}
    canary: {share: 0.1, route_url: http://127.0.0.1:8100}   # off (share 0) by default

cron:      15 2 * * *  nightshift nightly --config /etc/nightshift/nightshift.yaml
systemd, Kubernetes: see recipes/ in the repository."""


def cmd_nightly(args: argparse.Namespace) -> int:
    from nightshift.trainer.config import TrainConfig
    from nightshift.nightly.run import EXIT_CONFIG, NightlyConfig, run
    from nightshift.transform.config import TransformConfig

    setup_logging(args.log_level or "info", args.log_format)
    flags = {"data": args.data}
    tcfg = load(TransformConfig, "transform", args.config, flags)
    trcfg = load(TrainConfig, "train", args.config, flags)
    from nightshift.publish.publish import MOVED

    said: list[str] = []
    ncfg = load(NightlyConfig, "nightly", args.config, {}, moved=MOVED, notes=said)
    for note in said:
        say(f"nightshift nightly: {note}", args.log_format)
    from nightshift.prompts.config import ApoConfig

    apo = load(ApoConfig, "apo", args.config, flags)  # the proposer, for the agents on prompt optimization
    from nightshift.transform.config import RetentionConfig

    keep = load(RetentionConfig, "retention", args.config)  # the lake pruned to it before the build
    from nightshift.transform.config import CompactionConfig

    merge = load(CompactionConfig, "compaction", args.config)  # and its small files merged
    from .console import adopt_libraries

    adopt_libraries(args.log_format)  # the trainer and the gate load transformers
    try:
        code, state = run(tcfg, trcfg, ncfg, progress=not args.quiet and sys.stderr.isatty(), apo_cfg=apo,
                          retention_cfg=keep, compaction_cfg=merge)
    except ValueError as e:
        say(f"nightshift nightly: {e}", args.log_format)
        return EXIT_CONFIG
    print(f"nightly {state.get('run_id', '')}: {state.get('outcome') or state.get('error') or ''}")
    if state.get("report"):
        print(f"report: {state['report']}")
    return code
