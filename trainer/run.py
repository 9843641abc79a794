"""`nightshift train`, top to bottom: select rows → render → split → shape for the
algorithm → load the policy → evaluate it → train (resuming a killed run) →
evaluate again → write the version. Everything a person needs to trust the run
ends up in the summary and in the checkpoint's manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import algorithms
from . import checkpoint as ckpt
from . import examples as ex
from .algorithms import Prepared
from .config import TrainConfig
from .select import TrainDataError, select

if TYPE_CHECKING:
    from .plan import RunPlan

log = logging.getLogger("nightshift.trainer")


@dataclass
class TrainResult:
    version: str
    path: str
    algorithm: str
    rows_scanned: int
    rows_selected: int
    rows_trained: int
    rows_eval: int
    examples: int
    excluded: dict[str, int]
    logged: dict[str, int]
    steps: int
    tokens: int
    seconds: float
    train_loss: float
    eval_before: dict[str, float] = field(default_factory=dict)
    eval_after: dict[str, float] = field(default_factory=dict)
    resumed_from: str = ""
    notes: list[str] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)  # the run plan's lines, as printed before step 1
    too_long: dict[str, int] = field(default_factory=dict)  # rows longer than max_length, by agent
    #: The process that made this result (torchrun's RANK): only rank 0 writes the
    #: version, so only its result has one to report.
    rank: int = 0

    def lines(self) -> list[str]:
        out = [
            f"train: {self.algorithm} on {self.examples:,} example(s) from {self.rows_trained:,} row(s) -> "
            f"{self.version} at {self.path}",
            f"  rows: {self.rows_scanned:,} in the window, {self.rows_selected:,} selected, "
            f"{self.rows_trained:,} trained on, {self.rows_eval:,} held out",
        ]
        for reason, n in sorted(self.excluded.items(), key=lambda kv: -kv[1]):
            agents = ""
            if reason.startswith("longer than max_length") and self.too_long:
                agents = ": " + ", ".join(f"{a} {k:,}" for a, k in sorted(self.too_long.items(), key=lambda kv: -kv[1]))
            out.append(f"  left out: {n:,} {reason}{agents}")
        lg = self.logged
        if lg.get("match") or lg.get("drift"):
            out.append(f"  logged token ids: {lg.get('match', 0):,} match this tokenizer "
                       f"({lg.get('with_logprobs', 0):,} with logprobs), {lg.get('drift', 0):,} drifted (retokenized), "
                       f"{lg.get('none', 0):,} without ids")
        if any(k.startswith("mu_") for k in lg):
            out.append(f"  μ (the policy that made each call): {lg.get('mu_logged', 0):,} logged, "
                       f"{lg.get('mu_recomputed', 0):,} recomputed from the producing version's weights at the "
                       f"request's temperature, {lg.get('mu_unknown', 0):,} unknown (their negatives weighted "
                       "by pg.unknown_mu_negatives)")
        if lg.get("tool calls without tool definitions"):
            out.append(f"  warning: {lg['tool calls without tool definitions']:,} row(s) use tools but their spans did not "
                       "record the tool definitions (opentelemetry-instrumentation-openai-v2 does not): their prompts "
                       "lack the tools block the model sees when serving; give the agent's tools with "
                       "train.tools_fallback: FILE.json")
        if lg.get("tools from tools_fallback"):
            out.append(f"  {lg['tools from tools_fallback']:,} row(s) without recorded tool definitions rendered with "
                       "train.tools_fallback")
        if lg.get("prompt renders differently alone (template)"):
            out.append(f"  note: {lg['prompt renders differently alone (template)']:,} prompt(s) render differently "
                       "alone than in context (the chat template); trained on the in-context form")
        tps = self.tokens / self.seconds if self.seconds else 0.0
        resumed = f", resumed from {self.resumed_from}" if self.resumed_from else ""
        out.append(f"  {self.steps} step(s), {self.tokens:,} tokens in {self.seconds:.1f} s ({tps:,.0f} tokens/s), "
                   f"train loss {self.train_loss:.4f}{resumed}")
        if self.eval_after:
            def fmt(k: str) -> str:
                a, b = self.eval_before.get(k), self.eval_after.get(k)
                return f"{a:.4f} -> {b:.4f}" if a is not None and b is not None else "n/a"
            out.append(f"  held-out ({self.eval_after.get('rows', 0)} rows): nll {fmt('nll')}, "
                       f"advantage-weighted logp {fmt('adv_weighted_logp')}, KL to reference {fmt('kl_to_reference')}")
        out += [f"  {line}" for line in self.plan]
        out += [f"  note: {n}" for n in self.notes]
        return out


def _code_version() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("nightshift", "torch", "transformers", "trl", "peft", "accelerate"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        if sha.returncode == 0:
            out["git"] = sha.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    out["python"] = platform.python_version()
    return out


def _run_key(cfg: TrainConfig, content_hash: str) -> str:
    """Same settings and same rows: the same run, so a rerun resumes it."""
    conf = dataclasses.asdict(cfg)
    for k in ("logging_steps", "tensorboard", "report_to", "work_dir", "save_steps"):
        conf.pop(k, None)
    return hashlib.sha256(json.dumps([conf, content_hash], sort_keys=True, default=str).encode()).hexdigest()[:16]


def _work_dir(cfg: TrainConfig) -> Path:
    if cfg.work_dir:
        return Path(cfg.work_dir)
    if ckpt.is_local(cfg.output):
        return Path(cfg.output.removeprefix("file://")) / ".runs"
    return Path("./nightshift-runs")


def _parent(cfg: TrainConfig) -> str | None:
    if cfg.init_adapter and Path(cfg.init_adapter, ckpt.MANIFEST).exists():
        return ckpt.read_manifest(cfg.init_adapter).get("version")
    return None


def _last_checkpoint(trainer_dir: Path) -> str:
    """The newest complete trainer checkpoint: the Trainer writes
    trainer_state.json last, so a folder without a readable one was cut short by
    the kill and is removed (the one before it is used)."""
    if not trainer_dir.is_dir():
        return ""
    found = sorted((d for d in trainer_dir.glob("checkpoint-*") if d.name.split("-")[-1].isdigit()),
                   key=lambda d: int(d.name.split("-")[-1]), reverse=True)
    for d in found:
        try:
            json.loads((d / "trainer_state.json").read_text())
            return str(d)
        except (OSError, json.JSONDecodeError):
            log.warning("trainer checkpoint %s is incomplete (killed while saving); removing it", d)
            shutil.rmtree(d, ignore_errors=True)
    return ""


def train(cfg: TrainConfig, progress: bool = True, callbacks: Sequence = ()) -> TrainResult:
    """Train one version. Raises `TrainDataError` (a clear message) when there is
    nothing sound to train on. `callbacks`: more transformers `TrainerCallback`s
    (a benchmark's timer, say), after the step line and TensorBoard."""
    cfg.check()
    from .loop import check_trainer_args

    check_trainer_args(cfg)
    t_start = time.time()
    algo = algorithms.get(cfg.algorithm)

    # 1. rows ----------------------------------------------------------------------
    selection = select(cfg)
    if not selection.rows:
        reasons = ", ".join(f"{n} {r}" for r, n in selection.excluded.most_common()) or "the window is empty"
        raise TrainDataError(f"no transitions to train on: {selection.scanned} row(s) in the window; left out: {reasons}")
    from .memory import MemoryPlanError
    from .model import load_policy, load_tokenizer, reference
    from .plan import work_out
    from .render import require_template

    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        import datasets

        datasets.disable_progress_bars()
    tok = load_tokenizer(cfg)
    require_template(tok, cfg.base_model)
    try:  # device, precision, attention, packing, and max_length from the memory plan
        plan = work_out(cfg)
    except MemoryPlanError as e:
        raise TrainDataError(str(e)) from None
    prepared = ex.prepare(cfg, tok, selection, plan.max_length)
    excluded = Counter(selection.excluded) + prepared.excluded
    train_ex = prepared.train
    if not train_ex:
        why = ", ".join(f"{n} {r}" for r, n in excluded.most_common())
        extra = f" (first template error: {prepared.first_error})" if prepared.first_error else ""
        raise TrainDataError(f"no transitions left to train on after rendering: {why}{extra}")

    # 2. the algorithm's examples ---------------------------------------------------------
    eval_features = ex.pg_features(prepared.eval)
    rows, left = algo.examples(cfg, train_ex)
    excluded += left
    if not rows:
        why = ", ".join(f"{n} {r}" for r, n in left.most_common()) or "none"
        raise TrainDataError(f"{cfg.algorithm}: no training examples from {len(train_ex)} row(s): {why}")

    # 3. the memory plan for these rows, printed before anything is loaded -----------------
    lengths = [len(e.r) for e in train_ex + prepared.eval]
    share = max(len(e.r.completion_ids) / len(e.r) for e in train_ex)
    try:
        plan = plan.fitted(cfg, longest_row=max(lengths), completion_share=share)
    except MemoryPlanError as e:
        raise TrainDataError(str(e)) from None
    if plan.rank == 0:
        for line in plan.lines():
            print(line, file=sys.stderr, flush=True)

    # 4. model, reference, evaluation before ----------------------------------------------
    import torch

    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg, plan)
    if plan.device.type == "cuda" and not hasattr(policy, "hf_device_map"):
        policy.to(plan.device)
    ref_which = algo.reference(cfg)
    extra = Prepared()
    with reference(cfg, plan, policy, ref_which) as ref:
        eval_before = _evaluate(plan, policy, eval_features, tok, ref)
        if algo.before_training is not None:
            extra = algo.before_training(cfg, plan, policy, tok, rows, ref)
    prepared.logged.update(extra.logged)

    # 5. train --------------------------------------------------------------------------
    run_key = _run_key(cfg, selection.content_hash())
    run_dir = _work_dir(cfg) / run_key
    trainer_dir = run_dir / "trainer"
    resume = _last_checkpoint(trainer_dir)
    if resume:
        log.warning("resuming the interrupted run %s from %s", run_key, resume)
    from .loop import callbacks as standard_callbacks
    from .loop import training_args

    try:
        trainer = algo.trainer(cfg, plan, policy, tok, rows, training_args(cfg, plan, trainer_dir, progress),
                               standard_callbacks(cfg, plan, run_dir / "tensorboard") + list(callbacks))
    except (TypeError, ValueError) as e:
        if not cfg.trainer_args:
            raise
        from nightshift.settings import SettingsError

        raise SettingsError(f"train.trainer_args {cfg.trainer_args}: transformers refused them: {e}") from None
    from transformers import PrinterCallback, ProgressCallback

    # the step line (steplog.StepLog) replaces transformers' printed log dicts; the
    # bar stays when there is a terminal to draw it on
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    if progress:
        from .steplog import BarOnly

        trainer.add_callback(BarOnly)
    try:
        out = trainer.train(resume_from_checkpoint=resume or None)
    except MemoryPlanError as e:  # out of memory with nothing left to shrink: said, not a traceback
        raise TrainDataError(str(e)) from None
    retries = list(getattr(trainer, "retries", []))
    memory_used = getattr(trainer, "memory", None)
    steps = trainer.state.global_step
    tokens = int(trainer.state.num_input_tokens_seen or 0)
    train_seconds = float(out.metrics.get("train_runtime", 0.0))
    policy = trainer.model

    # 6. evaluation after, on the main process --------------------------------------------
    result_path = version = ""
    eval_after: dict = {}
    if trainer.is_world_process_zero():
        with reference(cfg, plan, policy, ref_which) as ref:
            eval_after = _evaluate(plan, policy, eval_features, tok, ref)
        # 7. the version ------------------------------------------------------------------
        ckpt.clean_stale(cfg.output)
        staged = ckpt.staging_dir(cfg.output, _work_dir(cfg))
        try:
            kind = _save_model(cfg, trainer, tok, staged)
            if (run_dir / "tensorboard").is_dir():
                shutil.copytree(run_dir / "tensorboard", staged / "tensorboard")
            manifest = {
                "parent": _parent(cfg),
                "kind": kind,
                "base_model": cfg.base_model,
                "served_model_name": cfg.served_name(),
                "algorithm": cfg.algorithm,
                "config": dataclasses.asdict(cfg),
                "dataset": {
                    "data": cfg.data, "since": selection.since or None, "until": selection.until or None,
                    "rows_scanned": selection.scanned, "rows_selected": len(selection.rows),
                    "rows_trained": len(train_ex), "examples": len(rows), "rows_eval": len(prepared.eval),
                    "excluded": dict(excluded), "too_long_by_agent": dict(prepared.too_long),
                    "logged_token_ids": dict(prepared.logged), "content_hash": selection.content_hash(),
                },
                "metrics": {
                    "train": {"loss": out.training_loss, "steps": steps, "tokens": tokens, "seconds": train_seconds,
                              "tokens_per_second": tokens / train_seconds if train_seconds else None,
                              **plan.summary(), **extra.manifest, "out_of_memory_retries": retries,
                              "memory_plan_at_end": memory_used.line() if memory_used is not None else None,
                              "resumed_from": Path(resume).name if resume else None},
                    "eval": {"before": eval_before, "after": eval_after},
                },
                "code_version": _code_version(),
            }
            result_path = ckpt.commit(staged, manifest, cfg.output, cfg.storage_options)
            version = manifest["version"]
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        shutil.rmtree(run_dir, ignore_errors=True)  # done: nothing left to resume
    trainer.accelerator.wait_for_everyone()
    notes = ([prepared.split_note] if prepared.split_note else []) + extra.notes + retries
    if prepared.first_error:
        notes.append(f"first chat template error: {prepared.first_error}")
    log.info("train: %s in %.1f s", version, time.time() - t_start)
    return TrainResult(
        version=version, path=result_path, algorithm=cfg.algorithm, rows_scanned=selection.scanned,
        rows_selected=len(selection.rows), rows_trained=len(train_ex), rows_eval=len(prepared.eval),
        examples=len(rows), excluded=dict(excluded), logged=dict(prepared.logged), steps=steps, tokens=tokens,
        seconds=train_seconds, train_loss=float(out.training_loss), eval_before=eval_before,
        eval_after=eval_after, resumed_from=Path(resume).name if resume else "", notes=notes,
        plan=plan.lines(), too_long=dict(prepared.too_long), rank=plan.rank,
    )


def _evaluate(plan: RunPlan, policy, features: list[dict], tok, ref) -> dict:
    """Held-out metrics under the precision training ran in, before training as
    after: after it, accelerate's wrapper runs the forward under autocast anyway
    (the fp32 states it hands back are cast to the head's dtype in
    trainer/logprobs.py), so before it the unwrapped model is put under the same
    autocast, or the two figures would differ by precision as well as by training."""
    import torch

    from .evaluate import evaluate
    from .loop import uses_boundaries

    if not features:
        return {}
    half = plan.device.type == "cuda" and plan.dtype in (torch.bfloat16, torch.float16)
    with torch.autocast(plan.device.type, dtype=plan.dtype, enabled=half):
        return evaluate(policy, features, tok.pad_token_id, plan.micro_batch_tokens, plan.packed, ref.states,
                        uses_boundaries(plan))


def _save_model(cfg: TrainConfig, trainer, tok, staged: Path) -> str:
    """The trained weights into the staging folder: the adapter with the serving
    engine's base name, or the full model; the tokenizer and its template."""
    model = trainer.model
    model = trainer.accelerator.unwrap_model(model)
    if hasattr(model, "peft_config"):
        model.save_pretrained(staged)
        ckpt.set_served_base(staged, cfg.served_name())
        kind = "lora"
    else:
        model.save_pretrained(staged)
        kind = "full"
    tok.save_pretrained(staged)
    return kind

