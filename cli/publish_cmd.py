"""`nightshift publish`, `nightshift rollback` and `nightshift nightly`: a version
in front of the agents, and the scheduled job that does it every night."""

from __future__ import annotations

import argparse
import os
import sys

from nightshift.settings import add_flags, flags_of, load

PUBLISH_DESC = """Put a checkpoint version in front of the agents on a running vLLM server (or
`nightshift serve --engine transformers`).

LoRA (default): checks the adapter against vLLM's rules and the server's base
model, places it in a folder of its own per version, POST /v1/load_lora_adapter
as <name>@<version> (plus --stable-name, reloaded in place), verifies with GET
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
what it repaired.

Exit codes: 0 published and verified, 1 refused or failed (the server's message
is printed verbatim; what the server took is undone, the registry unchanged),
2 published.json cannot be used (the message names the file and the problem;
nothing was changed)."""


def _publish_args(p: argparse.ArgumentParser) -> None:
    from nightshift.publish.publish import PublishSettings

    add_flags(p, PublishSettings, required=("vllm_url",))


def _settings(args: argparse.Namespace):
    """Defaults < NIGHTSHIFT_PUBLISH_* < flags, checked like every stage's settings."""
    from nightshift.publish.publish import PublishSettings

    return load(PublishSettings, "publish", None, flags_of(PublishSettings, args))


def add_publish(sub, common) -> None:
    p = sub.add_parser("publish", help="publish a checkpoint version to a running vLLM server",
                       description=PUBLISH_DESC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a version folder, e.g. nightshift-checkpoints/v0003")
    _publish_args(p)
    p.set_defaults(func=cmd_publish)

    r = sub.add_parser("rollback", help="publish the version before the one serving",
                       description="Publish again the newest version older than the one serving this name on this "
                       "server (from <checkpoints>/published.json), verified like any publication. Exit codes: 0 "
                       "rolled back, 1 refused or failed, 2 published.json cannot be used (nothing was changed).")
    r.add_argument("--checkpoints", required=True, metavar="DIR", help="the checkpoints folder")
    _publish_args(r)
    r.set_defaults(func=cmd_rollback)

    v = sub.add_parser("versions", help="production reward of each published version, per agent",
                       description="For each version that served calls (and the base model), the calls it made, its "
                       "trajectories, how many carry a reward, and their mean reward with a 95 % interval (a success "
                       "rate with Wilson's interval when rewards are 0/1), every agent together and each agent. "
                       "Late feedback counts once `nightshift build` has read it. A version with fewer rated "
                       "trajectories than --min-trajectories gets a count, not an interval.")
    common(v)
    v.add_argument("--checkpoints", metavar="DIR", help="the checkpoints folder: publish order and times from its "
                   "published.json, versions no publication names and versions deleted from disk said as such")
    v.add_argument("--since", metavar="YYYY-MM-DD", help="only calls from this date on")
    v.add_argument("--min-trajectories", type=int, default=30, metavar="N", help="rated trajectories for an interval (default 30)")
    v.set_defaults(func=cmd_versions)

    w = sub.add_parser("watch", help="judge the serving version (or a canary) by production's rewards, and act",
                       description=WATCH_DESC, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(w)
    w.add_argument("--checkpoints", required=True, metavar="DIR", help="the checkpoints folder (its published.json)")
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import PublishSettings
    from nightshift.settings import flag_names

    watch_flags = tuple(flag_names(PublishSettings)) + tuple(
        p for p in flag_names(NightlyConfig) if p.startswith("watch.") and p != "watch.enabled"
        or p in ("canary.route_url", "canary.route_token", "canary.max_hours"))
    add_flags(w, NightlyConfig, section="nightly", only=watch_flags)
    w.add_argument("--dry-run", action="store_true", help="say what it would do; change nothing")
    w.set_defaults(func=cmd_watch)

    n = sub.add_parser("nightly", help="build, train, gate and publish: the scheduled job",
                       description=NIGHTLY_DESC, epilog=NIGHTLY_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(n)
    n.add_argument("--quiet", action="store_true", help="no progress bars")
    n.set_defaults(func=cmd_nightly)


def _refused(command: str, e: Exception) -> int:
    """A registry that cannot be used: exit 2, nothing changed on the server."""
    print(f"nightshift {command}: {e}; nothing was changed on the server or in the registry", file=sys.stderr)
    return 2


def cmd_publish(args: argparse.Namespace) -> int:
    from .console import setup_logging
    from nightshift.publish.publish import PublishError, publish
    from nightshift.publish.registry import RegistryError
    from nightshift.publish.vllm_client import VLLMError

    setup_logging("warning")
    try:
        s = _settings(args)
        result = publish(args.checkpoint, s.vllm_url, **s.kwargs())
    except RegistryError as e:
        return _refused("publish", e)
    except (PublishError, VLLMError) as e:
        print(f"nightshift publish: {e}", file=sys.stderr)
        return 1
    print("\n".join(result.lines()))
    return 0


def _data(args: argparse.Namespace) -> str:
    return args.data or os.environ.get("NIGHTSHIFT_DATA") or "./nightshift-data"


def cmd_versions(args: argparse.Namespace) -> int:
    from nightshift.publish.versions import by_version, lines

    try:
        stats = by_version(_data(args), args.since or "", args.min_trajectories, checkpoints=args.checkpoints)
    except (FileNotFoundError, OSError) as e:  # versions.NoTransitions says what to run
        print(f"nightshift versions: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines(stats, args.min_trajectories)))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from .console import setup_logging
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import PublishError
    from nightshift.publish.vllm_client import VLLMError
    from nightshift.publish.registry import RegistryError
    from nightshift.publish.watch import watch
    from nightshift.route.client import RouteError

    setup_logging(args.log_level or "warning")
    n = load(NightlyConfig, "nightly", args.config, flags_of(NightlyConfig, args))
    try:
        verdict, out = watch(_data(args), args.checkpoints, n, n.watch, n.canary, act=not args.dry_run)
    except RegistryError as e:
        return _refused("watch", e)
    except (PublishError, VLLMError, RouteError, FileNotFoundError) as e:
        print(f"nightshift watch: {e}", file=sys.stderr)
        return 1
    print("\n".join(out))
    return 3 if verdict is not None and verdict.action in ("rolled back", "canary stopped") else 0


WATCH_DESC = """Judge what production says of the versions it served, by an always-valid
sequential test (mSPRT: safe to run after every build, its false-alarm bound holds
over every look), and act:

- a canary running (nightly.canary.share > 0): the candidate against the serving
  version over the same hours; worse stops it (every conversation back on the
  serving version, the candidate unloaded); better, or shown no more than
  --margin worse, promotes it; undecided after --canary-max-hours, it expires;
- otherwise the serving version against the one it replaced; worse rolls it back
  through the verified publish path.

Each decision goes to <checkpoints>/gate-log.jsonl. Settings as the nightly job's
(the `nightly:` section of --config, NIGHTSHIFT_NIGHTLY_*, then these flags).
The registry is read whole first: one that cannot be used is refused (exit 2)
rather than guessed at, since every decision may move the server; a change an
earlier run left pending is finished or undone before the look.
Exit codes: 0 kept, promoted or not yet decided, 3 rolled back or canary stopped,
1 failed, 2 published.json cannot be used."""


def cmd_rollback(args: argparse.Namespace) -> int:
    from .console import setup_logging
    from nightshift.publish.publish import PublishError, rollback
    from nightshift.publish.registry import RegistryError
    from nightshift.publish.vllm_client import VLLMError

    setup_logging("warning")
    try:
        s = _settings(args)
        kw = s.kwargs()
        kw.pop("mode")  # the version's own publication says how it was served
        result = rollback(args.checkpoints, s.vllm_url, **kw)
    except RegistryError as e:
        return _refused("rollback", e)
    except (PublishError, VLLMError) as e:
        print(f"nightshift rollback: {e}", file=sys.stderr)
        return 1
    print("\n".join(result.lines()))
    return 0


NIGHTLY_DESC = """The scheduled job: build the new transitions (from the last run's date), watch
what production says of the versions it served (roll back a worse one; stop or
promote a canary), train a new version (continuing the serving adapter), compare
it with the serving one on held-out transitions (and your evaluation command),
publish it if it is not worse (to all traffic, or as a canary through
`nightshift route`), and write a report (Markdown + a PNG plot across runs)
under <checkpoints>/reports/.

A lock keeps two runs apart; a state file (<checkpoints>/.nightly/state.json)
lets a run that died at any stage be resumed by the next invocation, and
nothing is ever published twice.

Exit codes: 0 done (published, held back by the gate, a canary the routing
proxy could not take, or nothing new: see the report), 1 a stage failed (the next run resumes it), 2 bad settings or a state
file it cannot resume from (the message says which), 75 another run holds the
lock (try later)."""

NIGHTLY_EPILOG = """One YAML file for every stage (sections data, transform, train, nightly):

  data: /var/lib/nightshift/data
  transform: {settle: 10m, credit: {strategy: identical}}
  train:
    base_model: /models/Qwen2.5-1.5B-Instruct
    served_model_name: Qwen/Qwen2.5-1.5B-Instruct
    output: /var/lib/nightshift/checkpoints
    algorithm: pg
  nightly:
    vllm_url: http://vllm:8000
    name: support-agent
    stable_name: support-agent
    keep: 3
    gate: {ranking_confidence: 0.95, validity_margin: 0.05, command: "python eval.py"}
    watch: {alpha: 0.01, min_trajectories: 30, margin: 0.05}
    canary: {share: 0.1, route_url: http://127.0.0.1:8100}   # off (share 0) by default

cron:      15 2 * * *  nightshift nightly --config /etc/nightshift/nightshift.yaml
systemd, Kubernetes: see recipes/ in the repository."""


def cmd_nightly(args: argparse.Namespace) -> int:
    from .console import setup_logging
    from nightshift.trainer.config import TrainConfig
    from nightshift.nightly.run import EXIT_CONFIG, NightlyConfig, run
    from nightshift.transform.config import TransformConfig

    setup_logging(args.log_level or "info")
    flags = {"data": args.data}
    tcfg = load(TransformConfig, "transform", args.config, flags)
    trcfg = load(TrainConfig, "train", args.config, flags)
    ncfg = load(NightlyConfig, "nightly", args.config, {})
    try:
        code, state = run(tcfg, trcfg, ncfg, progress=not args.quiet and sys.stderr.isatty())
    except ValueError as e:
        print(f"nightshift nightly: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(f"nightly {state.get('run_id', '')}: {state.get('outcome') or state.get('error') or ''}")
    if state.get("report"):
        print(f"report: {state['report']}")
    return code
