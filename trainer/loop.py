"""The training loop the algorithms share (all but kto and dpo, which are TRL's):
transformers' `Trainer` (its optimizer, schedule, logging, checkpoints and
resumption, DDP under `accelerate launch` or `torchrun`) with one loss hook,
an algorithm's `objective(logp, batch) -> (loss, stats)` on the log-probs of
the completion tokens only, fed batches of token features (`collate`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers import Trainer

if TYPE_CHECKING:
    from .config import TrainConfig
    from .plan import RunPlan

#: objective(log π of the completion tokens [K], the batch) -> (loss, figures for the step line)
Objective = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]

#: Completion tokens whose log-softmax is computed at once: bounds the float32
#: copy of the logits (tokens x vocabulary) a large vocabulary would need.
LOGPROB_CHUNK = 1024


def completion_logprobs(model, batch: dict[str, torch.Tensor], *, with_logits: bool = False,
                        temperature: float = 1.0):
    """log π of every completion token in the batch, [K], computing the LM head only
    at the positions that predict them (prompts in agent traces are long; their
    logits are never needed). `temperature`: the distribution a server sampled
    from, log softmax(logits / T) (μ of a call made at T). With `with_logits`,
    also the raw logits [K, V]."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        logits_to_keep=batch["logit_index"],
        use_cache=False,
    )
    logits = out.logits[batch["tok_row"], batch["tok_col"]]  # [K, V]
    targets = batch["targets"]
    parts = []
    for i in range(0, logits.shape[0], LOGPROB_CHUNK):
        chunk = logits[i : i + LOGPROB_CHUNK].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        tgt = targets[i : i + LOGPROB_CHUNK]
        parts.append(chunk.gather(-1, tgt[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    logp = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
    return (logp, logits) if with_logits else logp


def collate(features: list[dict[str, Any]], pad_id: int, packed: bool = True) -> dict[str, torch.Tensor]:
    """A batch of rendered transitions.

    packed: one row, sequences concatenated, `position_ids` restarting at 0 for each
    (transformers then keeps attention inside each sequence: flash-attention's
    varlen path on GPU, a block-diagonal mask with sdpa/eager); no padding at all.
    Otherwise: right-padded rows with an attention mask.
    Tokens are flattened to K completion tokens: `targets`, their sequence
    `tok_seq`, where their logits are (`logit_index` into the sequence dimension,
    then `tok_row`/`tok_col` into the kept logits), and per-token `old_logprobs`
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


class Collator:
    """`collate` with the tokenizer's pad id bound (picklable for DataLoader workers)."""

    def __init__(self, pad_id: int, packed: bool = True):
        self.pad_id, self.packed = pad_id, packed

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate(features, self.pad_id, self.packed)


class Rows:
    """A list as a map-style dataset (token features are ragged lists)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


class LoopTrainer(Trainer):
    """transformers' Trainer whose loss is an algorithm's `objective` on the
    completion tokens' log-probs; everything else (loop, optimizer, schedule,
    accumulation, logging, checkpoints) is the Trainer's."""

    def __init__(self, *args, objective: Objective, **kwargs):
        super().__init__(*args, **kwargs)
        self.objective = objective
        self.model_accepts_loss_kwargs = False  # scale by accumulation steps, not token counts
        self._stats: dict[str, list[float]] = defaultdict(list)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp = completion_logprobs(model, inputs)
        loss, stats = self.objective(logp, inputs)
        if model.training:
            for k, v in stats.items():
                self._stats[k].append(v)
            self._stats["completion_tokens"].append(float(logp.numel()))
        return (loss, {"logp": logp}) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._stats:
            for k, v in self._stats.items():
                logs[k] = sum(v) if k == "completion_tokens" else sum(v) / len(v)
            self._stats.clear()
        super().log(logs, *args, **kwargs)


def training_args(cfg: TrainConfig, plan: RunPlan, out_dir: Path, progress: bool) -> dict:
    """The TrainingArguments every trainer shares: what makes a run fast on a GPU
    and deterministic on a CPU, checkpoints to resume from, no reporting of its own."""
    return dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.grad_accum,
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
        gradient_checkpointing=cfg.gradient_checkpointing,
        torch_compile=cfg.compile,
        dataloader_num_workers=0,
        disable_tqdm=not progress,
        include_num_input_tokens_seen="non_padding",
        eval_strategy="no",
    )


def callbacks(cfg: TrainConfig, plan: RunPlan, tb_dir: Path) -> list:
    """The step line, then TensorBoard (it writes the figures the step line adds)."""
    from .steplog import StepLog

    out: list = [StepLog(device_name=plan.device_name)]
    if not cfg.tensorboard:
        return out
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    tb_dir.mkdir(parents=True, exist_ok=True)
    return out + [TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(tb_dir)))]


def make_trainer(plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list,
                 objective: Objective) -> LoopTrainer:
    """A `LoopTrainer` on token features (`examples.pg_features`' shape)."""
    from transformers import TrainingArguments

    if not plan.packed:
        args = {**args, "train_sampling_strategy": "group_by_length"}  # little padding without packing
    return LoopTrainer(model=model, args=TrainingArguments(**args, remove_unused_columns=False),
                       train_dataset=Rows(rows), data_collator=Collator(tok.pad_token_id, plan.packed),
                       processing_class=tok, callbacks=callbacks, objective=objective)
