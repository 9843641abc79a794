"""`nightshift build`: the transform stage's command."""

from __future__ import annotations

import argparse
import sys

from nightshift.settings import flags_of, load

from .helptext import epilog

DESCRIPTION = """Turn the spans under --data into the transitions dataset: one row per LLM call
(state: the input messages and tools; action: the output message and its tool
calls) with a credit-assigned reward and an advantage, written to
<data>/transitions/date=YYYY-MM-DD/, each touched date replaced whole.

Reads every widely used layout: OpenTelemetry GenAI (span attributes and log
events, both generations), OpenInference, OpenLLMetry before and after 0.55,
Agent Lightning. Rewards come from span attributes (agentlightning.reward.*,
OpenInference annotations, keys you name), from feedback (POST /v1/feedback,
`nightshift feedback FILE`), and from your reward functions (module:function).

The summary counts calls per instrumentation; a call recorded twice (a framework
span and a client span, even in two traces) is one row; a call in a layout no
reader knows is left out and reported with an example span id.

--incremental (what `nightshift nightly` runs) rebuilds only the dates whose rows
changed since the last build: new or late spans (into the date their trajectory
started, however late), log events, feedback files added, rewritten or removed,
trajectories that settled since, partitions changed by hand. It leaves the same
rows as a full build at the same clock, advantages included (kept dates whose
advantages the new rows moved are rewritten). What it read is in
<data>/build/state.json; a state it cannot use is named and a full build done.

--build-engine ray runs the buckets of traces as Ray tasks: on a local cluster
(--build-workers processes), or on the cluster at --build-ray-address (or
RAY_ADDRESS). The rows are those of a build in one process (with the same
--build-buckets); the partitions are committed here, each whole."""

EPILOG = """YAML section `transform:` (and top-level `data:`), e.g.:

  transform:
    trajectory: trace          # or conversation (gen_ai.conversation.id / session.id), or linked (span links)
    group_by: first_user_message   # conversation | attribute:<key> | none
    settle: 10m
    agents_include: "writer|rewriter"
    reward: {name: "", keys: [app.reward], functions: [mypkg.rewards:judge], prefer: [feedback, function, span]}
    credit: {strategy: identical, gamma: 0.9}   # identical | discounted | last | per_step
    advantage: {baseline: group, normalize: false, weighting: trajectory}
    build: {engine: ray, buckets: 16}   # buckets as Ray tasks (pip install 'nightshift-rl[distributed]'); same rows"""

#: Where the transform stage's commands read their settings (`helptext.tail`'s first two).
TRANSFORM_SETTINGS = ("the `transform:` section and top-level `data:`",
                      "NIGHTSHIFT_TRANSFORM_* (NIGHTSHIFT_TRANSFORM_CREDIT_STRATEGY for nested keys), NIGHTSHIFT_DATA")


def add_build(sub, common) -> None:
    from nightshift.transform.config import TransformConfig

    b = sub.add_parser("build", help="build the transitions dataset (one credit-assigned row per LLM call)",
                       description=DESCRIPTION, epilog=epilog(EPILOG, *TRANSFORM_SETTINGS,
                                                              "0 built, 1 nothing to build from, 2 bad settings or "
                                                              "a dataset this version cannot read"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(b, TransformConfig, "transform")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.set_defaults(func=cmd_build)


def cmd_build(args: argparse.Namespace) -> int:
    from .console import say, setup_logging
    from nightshift.schemas.layout import LayoutError
    from nightshift.transform.build import BuildError, build
    from nightshift.transform.config import TransformConfig

    cfg = load(TransformConfig, "transform", args.config, flags_of(TransformConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    try:
        summary = build(cfg, progress=not args.quiet and sys.stderr.isatty())
    except LayoutError as e:  # a newer schema version or a missing column: the data is wrong, not absent
        say(f"nightshift build: {e}", args.log_format)
        return 2
    except BuildError as e:
        say(f"nightshift build: {e}", args.log_format)
        return 1
    for line in summary.lines():
        print(line)
    from nightshift.transform.doctor import build_hints

    for hint in build_hints(summary, cfg):  # what to change, after the counts scripts read
        print(f"hint: {hint.what} ({hint.why})")
        print(f"  fix: {hint.fix}")
    return 0


PRUNE_DESCRIPTION = """Keep the lake to its retention: every date partition older than --days before
today (UTC) goes from spans/, logs/, feedback/ and transitions/ at once, with
every span and log record of the traces that started in those dates (the few
files of later dates holding them are rewritten without them), so a trajectory
is kept whole or pruned whole and the next build makes no rootless remnant of it.

The next build, incremental or full, makes the same rows from what is left (the
dates that read a removed or rewritten file are redone; the kept dates'
advantages are pooled without the pruned ones). `nightshift nightly` prunes
before it builds whenever retention.days is set. A local lake is pruned under
the build's lock; a crash anywhere leaves a lake the next prune finishes.
--dry-run says what would go and changes nothing."""

PRUNE_EPILOG = """YAML (the window is `retention:`; where the lake is, `data:` and `transform:`'s storage_options):

  data: s3://team-lake/nightshift
  retention:
    days: 7        # today and the 7 days before it are kept

  NIGHTSHIFT_RETENTION_DAYS=7 nightshift nightly     # the scheduled job prunes, then builds
  nightshift prune --days 7 --dry-run                # what would go, by dataset and date"""


def add_prune(sub, common) -> None:
    from nightshift.settings import add_flags
    from nightshift.transform.config import RetentionConfig, TransformConfig

    p = sub.add_parser("prune", help="delete the lake's dates older than its retention (retention.days), "
                                     "whole trajectories at a time",
                       description=PRUNE_DESCRIPTION,
                       epilog=epilog(PRUNE_EPILOG, "top-level `data:`, `retention:` and `transform:`'s "
                                     "storage_options", "NIGHTSHIFT_DATA, NIGHTSHIFT_RETENTION_DAYS, "
                                     "NIGHTSHIFT_TRANSFORM_STORAGE_OPTIONS",
                                     "0 pruned (or nothing older), 1 a build holds the lake or a file could not be "
                                     "removed, 2 bad settings, retention.days 0 (nothing to prune by) or a partition "
                                     "whose name is no date"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(p, TransformConfig, "transform", ("data", "storage_options"))
    add_flags(p, RetentionConfig, section="retention")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="say what would go; change nothing")
    p.set_defaults(func=cmd_prune)


def cmd_prune(args: argparse.Namespace) -> int:
    from .console import say, setup_logging
    from nightshift.transform.config import RetentionConfig, TransformConfig
    from nightshift.transform.retention import NotADate, RetentionError, prune

    cfg = load(TransformConfig, "transform", args.config, flags_of(TransformConfig, args))
    keep = load(RetentionConfig, "retention", args.config, flags_of(RetentionConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    if keep.days <= 0:
        say("nightshift prune: retention.days is 0, which keeps everything: give --days N (or retention.days, "
            "NIGHTSHIFT_RETENTION_DAYS) to keep today and the N days before it", args.log_format)
        return 2
    try:
        result = prune(cfg.data, keep.days, storage_options=cfg.storage_options, dry_run=args.dry_run)
    except RetentionError as e:
        say(f"nightshift prune: {e}", args.log_format)
        return 2 if isinstance(e, NotADate) else 1
    except OSError as e:
        say(f"nightshift prune: {e}; run it again to finish (what went is gone, the rest is as it was)",
            args.log_format)
        return 1
    print("\n".join(result.lines()))
    return 0


COMPACT_DESCRIPTION = """Merge the small files of past dates (UTC) in spans/, logs/ and feedback/: a
collector seals a file every flush_interval (10 s) whatever its size, so a quiet
sidecar writes thousands a day, and a build then spends its time opening them.
Each run of small files (one schema, in name order) becomes one file of about
--target-bytes, its rows in the same order; a file half that size or more stays.

A journal beside each merge makes it safe to stop anywhere: the next compaction
finishes it, and meanwhile every reader takes a row seen twice once. The next
build makes the same rows (the dates merged are redone by an incremental build).
`nightshift nightly` compacts before it builds unless compaction.enabled is
false. --dry-run says what would be merged and changes nothing."""

COMPACT_EPILOG = """YAML:

  compaction:
    enabled: true        # the nightly job compacts before it builds
    target_bytes: 64MiB

  nightshift compact --dry-run        # what would be merged, by dataset"""


def add_compact(sub, common) -> None:
    from nightshift.settings import add_flags
    from nightshift.transform.config import CompactionConfig, TransformConfig

    p = sub.add_parser("compact", help="merge the small files of past dates in the lake (what the nightly job does "
                                       "before it builds)",
                       description=COMPACT_DESCRIPTION,
                       epilog=epilog(COMPACT_EPILOG, "top-level `data:`, `compaction:` and `transform:`'s "
                                     "storage_options", "NIGHTSHIFT_DATA, NIGHTSHIFT_COMPACTION_TARGET_BYTES, "
                                     "NIGHTSHIFT_TRANSFORM_STORAGE_OPTIONS",
                                     "0 merged (or nothing to merge), 1 a build holds the lake or a file could not be "
                                     "read or written (run it again: what was merged stays merged), 2 bad settings"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(p, TransformConfig, "transform", ("data", "storage_options"))
    add_flags(p, CompactionConfig, section="compaction", only=("target_bytes",))
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="say what would be merged; change nothing")
    p.set_defaults(func=cmd_compact)


def cmd_compact(args: argparse.Namespace) -> int:
    from .console import say, setup_logging
    from nightshift.transform.compaction import compact
    from nightshift.transform.config import CompactionConfig, TransformConfig
    from nightshift.transform.output import Busy

    cfg = load(TransformConfig, "transform", args.config, flags_of(TransformConfig, args))
    how = load(CompactionConfig, "compaction", args.config, flags_of(CompactionConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    try:
        result = compact(cfg.data, target_bytes=how.target_bytes, storage_options=cfg.storage_options,
                         dry_run=args.dry_run)
    except Busy as e:
        say(f"nightshift compact: {e}; compact after it", args.log_format)
        return 1
    except (OSError, ValueError) as e:
        say(f"nightshift compact: {e}; run it again to finish (a merge stopped part way is finished by the next "
            "run; every row is readable meanwhile)", args.log_format)
        return 1
    print("\n".join(result.lines()))
    return 0
