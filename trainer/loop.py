"""The training loop sft, awr and pg share: transformers' `Trainer` (its
optimizer, schedule, logging, checkpoints and resumption, DDP under `accelerate
launch` or `torchrun`) fed one optimizer step at a time.

A step is a set of rows of about `tokens_per_step` tokens (or `batch_size`
rows), cut into micro-batches of at most the memory plan's tokens, binned by
length and packed (trainer/batching.py); under several processes each rank
gets its share of the step's micro-batches. The dataloader yields steps, so the
Trainer's own accumulation is 1 and `training_step` runs the micro-batches
itself: forward and backward each (gradients synchronized across ranks on the
last only), the algorithm's loss summed over its rows or completion tokens
and divided by the whole step's count over every rank. Accumulation and
several GPUs then change nothing but the memory: the gradient is the one of
the step taken at once. An out-of-memory error splits the micro-batch that
hit it in two, shrinks the memory plan for the rest of the run and redoes the
step, instead of failing the night. (Under several processes that holds for
every micro-batch but a rank's last: its backward is the one that all-reduces
with the other ranks, which an error in it leaves waiting.)
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from .logprobs import completion_logprobs

if TYPE_CHECKING:
    from .config import TrainConfig
    from .memory import MemoryPlan
    from .plan import RunPlan

log = logging.getLogger("nightshift.trainer")


@dataclass(frozen=True)
class Objective:
    """An algorithm's loss on the shared loop. `loss(logp, batch)`: log π of the
    batch's completion tokens [K] and the batch -> (the loss summed over the
    batch's rows or tokens, figures for the step line). `per`: "row" or
    "token", what the step's loss is a mean over (the sum is divided by the
    whole step's count of them, over every micro-batch and rank)."""

    loss: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
    per: str


def collate(features: list[dict[str, Any]], pad_id: int, packed: bool = True,
            boundaries: bool = False) -> dict[str, torch.Tensor]:
    """A batch of rendered transitions.

    packed: one row, sequences concatenated, `position_ids` restarting at 0 for each
    (the attention keeps inside each sequence: a varlen kernel, or a block-diagonal
    mask transformers derives from the positions); no padding at all. With
    `boundaries`, also the sequences' cu_seqlens for a varlen kernel, worked out
    here on the host (trainer/attention.py: `packed_kwargs`).
    Otherwise: right-padded rows with an attention mask.
    Tokens are flattened to K completion tokens: `targets`, their sequence
    `tok_seq`, where their logits are (`logit_index` into the sequence dimension,
    then `tok_row`/`tok_col` into the kept positions), and per-token `old_logprobs`
    (NaN where not logged) and `ref_logprobs` (when the features carry them).
    """
    seqs = [f["input_ids"] for f in features]
    starts = [f["completion_start"] for f in features]
    if any(s < 1 for s in starts):
        raise ValueError("a rendered prompt is empty: the first completion token has nothing to be predicted from")
    tok_seq, targets, old, ref = [], [], [], []
    has_ref = all(f.get("ref_logprobs") is not None for f in features)
    for i, f in enumerate(features):
        n = len(f["input_ids"]) - f["completion_start"]
        tok_seq += [i] * n
        targets += f["input_ids"][f["completion_start"]:]
        old += f["old_logprobs"] if f.get("old_logprobs") is not None else [math.nan] * n
        if has_ref:
            ref += f["ref_logprobs"]
    batch: dict[str, torch.Tensor] = {}
    if packed:
        ids = [t for s in seqs for t in s]
        pos = [p for s in seqs for p in range(len(s))]
        offsets, o = [], 0
        for s in seqs:
            offsets.append(o)
            o += len(s)
        logit_index = [offsets[i] + p - 1 for i, s in enumerate(seqs) for p in range(starts[i], len(s))]
        batch["input_ids"] = torch.tensor([ids], dtype=torch.long)
        batch["position_ids"] = torch.tensor([pos], dtype=torch.long)
        batch["logit_index"] = torch.tensor(logit_index, dtype=torch.long)
        batch["tok_row"] = torch.zeros(len(logit_index), dtype=torch.long)
        batch["tok_col"] = torch.arange(len(logit_index), dtype=torch.long)
        if boundaries:
            from .attention import packed_kwargs

            batch.update(packed_kwargs(batch["position_ids"]))
    else:
        width = max(len(s) for s in seqs)
        first = min(starts) - 1
        batch["input_ids"] = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
        batch["attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
        batch["logit_index"] = torch.arange(first, width - 1, dtype=torch.long)
        rows, cols = [], []
        for i, s in enumerate(seqs):
            for p in range(starts[i], len(s)):
                rows.append(i)
                cols.append(p - 1 - first)
        batch["tok_row"] = torch.tensor(rows, dtype=torch.long)
        batch["tok_col"] = torch.tensor(cols, dtype=torch.long)
    batch["targets"] = torch.tensor(targets, dtype=torch.long)
    batch["tok_seq"] = torch.tensor(tok_seq, dtype=torch.long)
    batch["old_logprobs"] = torch.tensor(old, dtype=torch.float32)
    batch["advantage"] = torch.tensor([float(f.get("advantage") or 0.0) for f in features], dtype=torch.float32)
    batch["weight"] = torch.tensor([float(f.get("weight", 1.0)) for f in features], dtype=torch.float32)
    if has_ref:
        batch["ref_logprobs"] = torch.tensor(ref, dtype=torch.float32)
    return batch


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors to `device`; the varlen kernel's max lengths stay host ints."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def uses_boundaries(plan: RunPlan) -> bool:
    """Whether the attention the model was loaded with reads cu_seqlens from the batch."""
    return plan.packed and plan.attention.startswith(("nightshift_varlen", "flash_attention"))


def length(f: dict) -> int:
    return len(f["input_ids"])


def completion_tokens(f: dict) -> int:
    return len(f["input_ids"]) - f["completion_start"]


def token_batches(features: list[dict], micro_batch_tokens: int, packed: bool) -> list[list[dict]]:
    """Features in batches of at most `micro_batch_tokens` (a longer row alone), in
    their order of length: for passes without gradients (evaluation, μ, the
    reference), which need no shuffling, only full batches."""
    from .batching import micro_batches

    if not features:
        return []
    groups = micro_batches([length(f) for f in features], max(1, micro_batch_tokens), packed=packed, seed=0)
    return [[features[i] for i in g] for g in groups]


# --- steps -------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One optimizer step as this rank sees it: its micro-batches (features) and the
    whole step's counts over every rank (what the loss is normalized by)."""

    micro: list[list[dict]]
    rows: int
    completion_tokens: int
    tokens: int

    def count(self, per: str) -> int:
        return self.rows if per == "row" else self.completion_tokens


#: Groups of like-length rows a step is made of: binning by length keeps
#: micro-batches full (packed) or barely padded, and drawing a step from several
#: groups keeps it from being all short (or all failed) calls.
GROUPS_PER_STEP = 8


class Steps(torch.utils.data.Dataset):
    """This rank's share of every optimizer step, computed once for the run: every
    rank computes the same steps (same lengths, same seed) and takes its own."""

    def __init__(self, rows: list[dict], plan: RunPlan, seed: int):
        from .batching import micro_batches, optimizer_steps, shard

        lengths = [length(f) for f in rows]
        # Which rows make a step must not depend on the number of processes (or on one
        # process's memory), and a step should mix lengths (and so rewards): rows are
        # binned by length into groups of about 1/GROUPS_PER_STEP of a step, a step
        # takes GROUPS_PER_STEP of them in their shuffled order, and only then are its
        # rows dealt to the ranks and packed into micro-batches of the plan's size.
        if plan.rows_per_step:
            whole = plan.rows_per_step * sum(lengths) / len(lengths)
            per = {"rows_per_step": plan.rows_per_step}
        else:
            whole, per = plan.tokens_per_step, {"tokens_per_step": plan.tokens_per_step}
        group = max(max(lengths), math.ceil(whole / GROUPS_PER_STEP))
        groups = micro_batches(lengths, group, packed=plan.packed, seed=seed)
        steps = optimizer_steps(groups, lengths, world_size=plan.world_size, micro_batch_tokens=plan.micro_batch_tokens,
                                packed=plan.packed, **per)
        self.steps: list[Step] = []
        for step in steps:
            everyone = [i for mb in step for i in mb]
            if plan.world_size == 1:  # one process: the step's rows packed at the plan's size here
                mine = micro_batches([lengths[i] for i in everyone], plan.micro_batch_tokens, packed=plan.packed,
                                     seed=seed)
                mine = [[everyone[j] for j in mb] for mb in mine]
            else:  # several: dealt and packed by optimizer_steps
                mine = shard(step, plan.rank, plan.world_size)
            self.steps.append(Step(
                micro=[[rows[i] for i in mb] for mb in mine],
                rows=len(everyone), completion_tokens=sum(completion_tokens(rows[i]) for i in everyone),
                tokens=sum(lengths[i] for i in everyone)))

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> Step:
        return self.steps[k]


class StepOrder:
    """The order steps are taken in, one step per batch: as made in the first epoch
    (the costliest micro-batch first, so an out-of-memory error comes on step 1),
    shuffled by the seed and the epoch after. Every rank draws the same order."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        if self.epoch > 0:
            random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        for k in order:
            yield [k]


class StepLoader(DataLoader):
    """A DataLoader of steps that passes the Trainer's epoch to its order."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _one(items: list[Step]) -> Step:
    return items[0]


# --- the trainer -------------------------------------------------------------------------------------


def apply_checkpointing(model, flags: list[bool]) -> None:
    """Checkpoint the decoder layers whose flag is set (bottom first), the rest
    keep their activations; none set: checkpointing off."""
    from transformers.modeling_utils import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    lm = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    if not any(flags):
        if lm.is_activation_checkpointing:
            lm.activation_checkpointing_disable()
        return
    lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    if len(layers) != len(flags):
        raise ValueError(f"checkpointing: the model has {len(layers)} decoder layers, the memory plan {len(flags)}")
    for layer, flag in zip(layers, flags):
        layer.gradient_checkpointing = flag


class LoopTrainer(Trainer):
    """transformers' Trainer taking one optimizer step per batch (a `Step`), each
    micro-batch's loss an algorithm's `Objective` on the completion tokens'
    log-probs; loop, optimizer, schedule, logging and checkpoints are the Trainer's."""

    def __init__(self, *args, objective: Objective, plan: RunPlan, pad_id: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.objective, self.plan, self.pad_id = objective, plan, pad_id
        self.memory: MemoryPlan | None = plan.memory
        self.budget = plan.micro_batch_tokens
        self.retries: list[str] = []
        self._at = 0  # the micro-batch under way, for the out-of-memory retry
        self._stats: dict[str, list[float]] = defaultdict(list)

    def get_train_dataloader(self) -> DataLoader:
        # Not prepared by accelerate: each rank's share of a step is already its own.
        return StepLoader(self.train_dataset, batch_sampler=StepOrder(len(self.train_dataset), self.args.seed),
                          collate_fn=_one, num_workers=0)

    def _get_num_items_in_batch(self, batch_samples, device):
        return None  # the step's counts ride in each `Step`, over every rank

    def floating_point_ops(self, inputs: Step) -> int:
        """transformers' 6 x tokens x parameters, on this rank's tokens of the step."""
        if not hasattr(self, "_n_params"):
            self._n_params = sum(p.numel() for p in self.model.parameters())
        return 6 * sum(length(f) for mb in inputs.micro for f in mb) * self._n_params

    def training_step(self, model, inputs: Step, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        micro = [list(mb) for mb in inputs.micro]
        while True:
            micro = self._fit(micro)
            try:
                loss, stats = self._step(model, inputs, micro)
                break
            except torch.cuda.OutOfMemoryError as e:
                micro = self._recover(model, micro, e)
        for k, v in stats.items():
            self._stats[k] += v
        self.state.num_input_tokens_seen += inputs.tokens  # every rank's: the step's counts are global
        return loss

    def _fit(self, micro: list[list[dict]]) -> list[list[dict]]:
        """Micro-batches above the current budget (the plan shrank) split to fit it."""
        out = []
        for mb in micro:
            cost = sum(map(length, mb)) if self.plan.packed else len(mb) * max(map(length, mb))
            out += token_batches(mb, self.budget, self.plan.packed) if cost > self.budget and len(mb) > 1 else [mb]
        return out

    def _step(self, model, step: Step, micro: list[list[dict]]) -> tuple[torch.Tensor, dict[str, list[float]]]:
        # summed over this rank's rows or tokens, over the step's count over every rank,
        # times the ranks: DDP averages the ranks' gradients, which makes it the step's sum
        scale = self.accelerator.num_processes / max(step.count(self.objective.per), 1)
        total = torch.zeros((), device=self.args.device)
        stats: dict[str, list[float]] = defaultdict(list)
        boundaries = uses_boundaries(self.plan)
        for j, feats in enumerate(micro):
            self._at = j
            last = j == len(micro) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                batch = to_device(collate(feats, self.pad_id, self.plan.packed, boundaries), self.args.device)
                with self.compute_loss_context_manager():
                    logp = completion_logprobs(model, batch)
                    part, figures = self.objective.loss(logp, batch)
                    loss = part * scale
                self.accelerator.backward(loss)
            total += loss.detach()
            for k, v in figures.items():
                stats[k].append(v)
            stats["completion_tokens"].append(float(logp.numel()))
        return total, stats

    def _recover(self, model, micro: list[list[dict]], error: Exception) -> list[list[dict]]:
        """After an out-of-memory error: this step's partial gradients dropped, memory
        freed, the micro-batch that hit it split in two, the plan shrunk for the rest
        of the run (smaller micro-batches or more layers checkpointed), and the step
        redone from its first micro-batch: the gradient is the unsplit step's."""
        from .memory import MemoryPlanError, shrink

        failed = micro[self._at]
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        what = f"out of memory in step {self.state.global_step + 1} (a micro-batch of {sum(map(length, failed)):,} " \
               f"tokens in {len(failed)} row(s))"
        if self.memory is not None and self.memory.inputs is not None:
            try:
                smaller = shrink(self.memory)
            except MemoryPlanError as e:
                if len(failed) < 2:
                    raise MemoryPlanError(f"{what}: {e}") from error
                smaller = None
            if smaller is not None:
                if smaller.checkpointed_layers != self.memory.checkpointed_layers:
                    apply_checkpointing(model, smaller.layer_flags())
                self.memory, self.budget = smaller, min(self.budget, smaller.micro_batch_tokens)
        elif len(failed) < 2:
            raise MemoryPlanError(f"{what}: one row, nothing left to split") from error
        out = []
        for j, mb in enumerate(micro):
            if j == self._at and len(mb) > 1:
                halves = token_batches(mb, -(-sum(map(length, mb)) // 2), True)
                out += halves if len(halves) > 1 else [mb[: len(mb) // 2], mb[len(mb) // 2:]]
            else:
                out.append(mb)
        line = f"{what}: split in two and the step redone" + \
               (f"; the rest of the run: {self.memory.line()}" if self.memory is not None else "")
        log.warning(line)
        self.retries.append(line)
        return out

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._stats:
            for k, v in self._stats.items():
                logs[k] = sum(v) if k == "completion_tokens" else sum(v) / len(v)
            self._stats.clear()
        super().log(logs, *args, **kwargs)


# --- the pieces every trainer shares ------------------------------------------------------------------


def training_args(cfg: TrainConfig, plan: RunPlan, out_dir: Path, progress: bool) -> dict:
    """The TrainingArguments every trainer shares: what makes a run fast on a GPU
    and deterministic on a CPU, checkpoints to resume from, no reporting of its
    own (`callbacks` adds it after the step line), and the user's
    `train.trainer_args` over them (those Nightshift owns are refused by the
    settings' rules). Batch sizes are each trainer's: steps for the shared loop
    (`make_trainer`), rows for TRL's."""
    return dict(
        output_dir=str(out_dir),
        learning_rate=cfg.learning_rate,
        num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps if cfg.max_steps > 0 else -1,
        warmup_steps=cfg.warmup,
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        lr_scheduler_type="linear",
        logging_steps=cfg.logging_steps,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        report_to="none",  # TensorBoard is added as a callback writing where we say
        bf16=plan.dtype == torch.bfloat16,
        fp16=plan.dtype == torch.float16,
        use_cpu=plan.device.type != "cuda",
        seed=cfg.seed,
        data_seed=cfg.seed,
        torch_compile=cfg.compile,
        dataloader_num_workers=0,
        disable_tqdm=not progress,
        eval_strategy="no",
        ddp_find_unused_parameters=False,  # every trainable weight takes part in every forward
    ) | dict(cfg.trainer_args)


def check_trainer_args(cfg: TrainConfig) -> None:
    """Refuse a `train.trainer_args` key TrainingArguments does not have, before any
    work is done (the settings' rules refuse the keys Nightshift owns without
    importing transformers; this needs it)."""
    import dataclasses

    from transformers import TrainingArguments

    from nightshift.settings import SettingsError

    known = {f.name for f in dataclasses.fields(TrainingArguments)}
    unknown = [k for k in cfg.trainer_args if k not in known]
    if unknown:
        raise SettingsError(f"train.trainer_args: {', '.join(map(repr, unknown))} "
                            f"{'is not a' if len(unknown) == 1 else 'are not'} transformers TrainingArguments "
                            f"field{'s' if len(unknown) > 1 else ''}")


def row_batches(cfg: TrainConfig, plan: RunPlan, *, sequences: int = 1, at_least: int = 1) -> dict:
    """Batch arguments for TRL's row-batched trainers (kto, dpo), from the same
    budgets: rows per step `train.batch_size` (x grad_accum), or as many rows of
    the longest length as `tokens_per_step` holds; rows per forward as many as the
    memory plan's micro-batch holds (`sequences` forwards per row: dpo's chosen and
    rejected), at least `at_least`; the rest accumulated."""
    longest = max(1, plan.longest_row or plan.max_length) * sequences
    per_step = plan.rows_per_step or max(at_least, plan.tokens_per_step // longest)
    per_rank = max(at_least, -(-per_step // plan.world_size))
    micro = max(at_least, min(per_rank, plan.micro_batch_tokens // longest))
    return {"per_device_train_batch_size": micro, "gradient_accumulation_steps": max(1, -(-per_rank // micro)),
            "gradient_checkpointing": plan.memory is not None and plan.memory.checkpointing != "off",
            "include_num_input_tokens_seen": "non_padding"}


#: `train.report_to` beyond TensorBoard: transformers' integration for each.
INTEGRATIONS = {"wandb": "WandbCallback", "mlflow": "MLflowCallback"}


def callbacks(cfg: TrainConfig, plan: RunPlan, tb_dir: Path) -> list:
    """The step line, then where `train.report_to` sends the figures: after it, so
    they get the tokens/s and MFU it adds to each record (transformers would put
    its own report_to callbacks before ours). On the main process only:
    TensorBoard's logs go into the version it alone writes, and one run is one
    run in wandb or MLflow."""
    import transformers.integrations as integrations

    from .steplog import StepLog

    out: list = [StepLog(device_name=plan.device_name)]
    if plan.rank != 0:
        return out
    for name in cfg.reporters():
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            tb_dir.mkdir(parents=True, exist_ok=True)
            out.append(integrations.TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(tb_dir))))
        else:
            out.append(getattr(integrations, INTEGRATIONS[name])())
    return out


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list,
                 objective: Objective) -> LoopTrainer:
    """A `LoopTrainer` on token features (`examples.pg_features`' shape)."""
    from transformers import TrainingArguments

    if plan.memory is not None:
        apply_checkpointing(model, plan.memory.layer_flags())
    args = {**args, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1,
            "include_num_input_tokens_seen": "no", "remove_unused_columns": False}
    return LoopTrainer(model=model, args=TrainingArguments(**args), train_dataset=Steps(rows, plan, cfg.seed),
                       processing_class=tok, callbacks=callbacks, objective=objective, plan=plan,
                       pad_id=tok.pad_token_id)
