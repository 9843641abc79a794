"""`nightshift train`, `nightshift merge` and `nightshift checkpoints`: the trainer
stage's commands."""

from __future__ import annotations

import argparse
import json
import sys

from nightshift.settings import flags_of, load

from .helptext import epilog

DESCRIPTION = """Train the policy on the transitions dataset (one credit-assigned row per LLM
call, from `nightshift build`) and write a new versioned checkpoint under
--checkpoints: <checkpoints>/vNNNN/ with the LoRA adapter (or full weights), the
tokenizer and chat template, and manifest.json (parent version, base model,
algorithm and full config, dataset window, row counts and content hash,
metrics before and after on a held-out split, code version).

Algorithms (--algorithm; trainer/algorithms/<name>.py and docs/trainer.md say why each exists):
  sft  (default) the log-likelihood of the best rows (rejection sampling): the
       only objective that made the agent world's tiny policy better from its own logs
  awr  advantage-weighted regression: never pushes a call down
  pg   policy gradient as TOPR does it: positives without a ratio, negatives
       with clip(pi/mu, 0, 1) against the policy that made each call
  kto  TRL KTOTrainer, desirable = reward above kto.threshold
  dpo  TRL DPOTrainer on same-prompt pairs within a task group

Every setting below is also a YAML key of the `train:` section and a
NIGHTSHIFT_TRAIN_* variable (nested ones: NIGHTSHIFT_TRAIN_PG_KL_COEF). One flag
is named apart from its key: --checkpoints is `train.output` (the checkpoints
folder is --checkpoints on every command; --output still works, deprecated).

Runs on a GPU in bf16, on a CPU in fp32. sft, awr and pg pack rows (no padding)
into optimizer steps of about --tokens-per-step tokens; before step 1 a memory
plan picks the micro-batch and the activation checkpointing that fit
--memory-fraction of the GPU's free memory and prints them in one line; an
out-of-memory error shrinks the plan and redoes the step. max_length defaults to
the model's own limit. Several GPUs: the same command under `accelerate launch
-m nightshift.cli train ...` or `torchrun --nproc_per_node N -m nightshift.cli
train ...` (a step's rows are shared out, so the loss curve is the one process's).
A run killed part-way resumes from its last trainer checkpoint when started
again with the same settings on the same rows."""

EPILOG = """YAML section `train:` (and top-level `data:`), e.g.:

  train:
    base_model: /models/Qwen2.5-1.5B-Instruct
    served_model_name: Qwen/Qwen2.5-1.5B-Instruct   # the vLLM --model the adapter is for
    output: s3://bucket/nightshift/checkpoints   # the checkpoints folder (--checkpoints)
    algorithm: sft                  # sft | awr | pg | kto | dpo
    select: {since: 2025-11-01, agents: "writer|rewriter", models: [], require_reward: true}
    lora: {r: 16, alpha: 32, target_modules: all-linear}
    pg: {clip: ppo, epsilon: 0.2, kl_coef: 0.0, reference: base}
    tokens_per_step: 65536          # batch_size: 0 (the default) batches by tokens
    memory_fraction: 0.9            # of the GPU's free memory
    learning_rate: 1e-4
    epochs: 1

TensorBoard: `tensorboard --logdir <checkpoints>` (each version keeps its logs)."""

#: Where the trainer's commands read their settings (`helptext.tail`'s first two).
TRAIN_SETTINGS = ("the `train:` section and top-level `data:`",
                  "NIGHTSHIFT_TRAIN_* (NIGHTSHIFT_TRAIN_PG_KL_COEF for nested keys), NIGHTSHIFT_DATA")


def add_train(sub, common) -> None:
    from nightshift.trainer.config import TrainConfig

    t = sub.add_parser("train", help="train on the transitions and write a versioned checkpoint",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=epilog(EPILOG, *TRAIN_SETTINGS, "0 trained, 1 nothing sound to train on (the reason "
                                     "is printed), 2 bad settings or transitions this version cannot read"))
    common(t, TrainConfig, "train")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_train)

    m = sub.add_parser("merge", help="merge a LoRA checkpoint into full weights",
                       description="Merge the adapter of a checkpoint into its base model and save full weights "
                       "(for vLLM's reload_weights or a blue-green restart). Written atomically.",
                       epilog=epilog("", "`train.base_model` (when --base-model is not given and the manifest's "
                                     "base_model is not a folder here) and `train.output` (where a CHECKPOINT "
                                     "given as a version name is)", "NIGHTSHIFT_TRAIN_BASE_MODEL, "
                                     "NIGHTSHIFT_TRAIN_OUTPUT", "0 merged, 1 cannot merge (the reason is printed), "
                                     "2 bad settings"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("checkpoint", metavar="CHECKPOINT", help="a version folder, e.g. nightshift-checkpoints/v0003, or "
                   "a version (v0003) under --checkpoints")
    m.add_argument("out", metavar="OUT", help="folder for the merged model")
    m.add_argument("--base-model", dest="base_model", default="", metavar="PATH",
                   help="the base model's local folder (default: the manifest's base_model, else train.base_model)")
    m.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"])
    _checkpoints_flag(m)
    common(m, data=False)
    m.set_defaults(func=cmd_merge)

    c = sub.add_parser("checkpoints", help="list the versions under a checkpoints folder",
                       description="List committed versions with their algorithm, rows and held-out metrics.",
                       epilog=epilog("", "`train.output` (the checkpoints folder) and `train.storage_options`",
                                     "NIGHTSHIFT_TRAIN_OUTPUT, NIGHTSHIFT_TRAIN_STORAGE_OPTIONS",
                                     "0 listed, 1 no versions there, 2 bad settings"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _checkpoints_flag(c)
    c.add_argument("--json", action="store_true", help="one JSON object per version")
    common(c, data=False)
    c.set_defaults(func=cmd_checkpoints)


def _checkpoints_flag(p: argparse.ArgumentParser) -> None:
    from nightshift.settings import Renamed

    p.add_argument("--checkpoints", "--output", dest="checkpoints", action=Renamed, old=("--output",),
                   metavar="DIR|URL", help="the checkpoints folder (default: train.output of --config, "
                   "NIGHTSHIFT_TRAIN_OUTPUT, else ./nightshift-checkpoints); --output: its old name, deprecated")


def train_settings(args: argparse.Namespace):
    """The `train:` section as every command other than `train` reads it: for the
    checkpoints folder (--checkpoints wins), the base model and fsspec's options;
    not checked as a training run (no base_model needed to list versions)."""
    from nightshift.trainer.config import TrainConfig

    flags = {"output": getattr(args, "checkpoints", None), "data": getattr(args, "data", None)}
    return load(TrainConfig, "train", getattr(args, "config", None), flags, check=False)


def version_folder(value: str, checkpoints: str) -> str:
    """A version given by name (v0003) is the folder of that name under the
    checkpoints folder; anything else is a path, as given."""
    import os
    import re

    if re.fullmatch(r"v\d+", value) and not os.path.exists(value):
        return f"{checkpoints.rstrip('/')}/{value}"
    return value


def cmd_train(args: argparse.Namespace) -> int:
    from .console import say, setup_logging
    from nightshift.trainer.config import TrainConfig

    cfg = load(TrainConfig, "train", args.config, flags_of(TrainConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    from nightshift.schemas.layout import LayoutError
    from nightshift.trainer.run import train
    from nightshift.trainer.select import TrainDataError

    from .console import adopt_libraries

    adopt_libraries(args.log_format)
    try:
        result = train(cfg, progress=not args.quiet and sys.stderr.isatty())
    except LayoutError as e:  # a newer schema version or a missing column: the data is wrong, not absent
        say(f"nightshift train: {e}", args.log_format)
        return 2
    except TrainDataError as e:
        say(f"nightshift train: {e}", args.log_format)
        return 1
    if result.rank != 0:  # under torchrun every rank gets here; only rank 0 wrote the version
        return 0
    for line in result.lines():
        print(line)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    import os

    from nightshift.trainer.checkpoint import MANIFEST, read_manifest
    from nightshift.trainer.merge import MergeError, merge

    from .console import adopt_libraries, say, setup_logging

    setup_logging(args.log_level or "warning", args.log_format)
    adopt_libraries(args.log_format)
    cfg = train_settings(args)
    checkpoint = version_folder(args.checkpoint, cfg.output)
    base = args.base_model
    if not base and cfg.base_model:  # the manifest's path first: the weights the adapter was trained on
        recorded = read_manifest(checkpoint).get("base_model") if os.path.exists(f"{checkpoint}/{MANIFEST}") else ""
        base = "" if recorded and os.path.isdir(recorded) else cfg.base_model
    try:
        out = merge(checkpoint, args.out, base, args.dtype)
    except MergeError as e:
        say(f"nightshift merge: {e}", args.log_format)
        return 1
    print(f"merged {checkpoint} into full weights at {out}")
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from nightshift.trainer.checkpoint import read_manifest, versions

    from .console import say, setup_logging

    setup_logging(args.log_level or "warning", args.log_format)
    cfg = train_settings(args)
    folder, options = cfg.output, cfg.storage_options
    found = versions(folder, options)
    if not found:
        say(f"no checkpoints under {folder}", args.log_format)
        return 1
    for v in found:
        m = read_manifest(f"{folder.rstrip('/')}/{v}", options)
        if args.json:
            print(json.dumps({k: m.get(k) for k in ("version", "parent", "kind", "algorithm", "created", "dataset", "metrics")},
                             default=str))
            continue
        after = (m.get("metrics", {}).get("eval", {}) or {}).get("after") or {}
        ds = m.get("dataset", {})
        held = (f"held-out nll={after['nll']:.4f} adv-logp={after.get('adv_weighted_logp', float('nan')):.4f}"
                if "nll" in after else "held-out: none")
        print(f"{v}  {m.get('created', '')}  {m.get('algorithm', '?'):4} {m.get('kind', '?'):4} "
              f"parent={m.get('parent') or '-':6} rows={ds.get('rows_trained', '?')} {held}")
    return 0
