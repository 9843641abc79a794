"""One trainer per algorithm, each a TRL/transformers trainer with its config:
`pg` and `awr` are `PGTrainer` (transformers' Trainer with the policy-gradient
or advantage-weighted loss),
`sft`/`kto`/`dpo` are TRL's. They share the settings that make a run fast on a
GPU and deterministic on a CPU, checkpoints to resume from, and TensorBoard.
"""

from __future__ import annotations

from pathlib import Path

from .config import TrainConfig
from .model import dtype_of, on_gpu, packed


def common_args(cfg: TrainConfig, out_dir: Path, progress: bool) -> dict:
    import torch

    dtype = dtype_of(cfg)
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
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu=not on_gpu(),
        seed=cfg.seed,
        data_seed=cfg.seed,
        gradient_checkpointing=cfg.gradient_checkpointing,
        torch_compile=cfg.compile,
        dataloader_num_workers=0,
        disable_tqdm=not progress,
        include_num_input_tokens_seen="non_padding",
        eval_strategy="no",
    )


class _Rows:
    """A list as a map-style dataset (pg's features are ragged lists)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _callbacks(cfg: TrainConfig, tb_dir: Path) -> list:
    import torch

    from .steplog import StepLog

    # the step line first: it adds tokens/s and MFU to the record TensorBoard then writes
    out: list = [StepLog(device_name=torch.cuda.get_device_name(0) if on_gpu() else "")]
    if not cfg.tensorboard:
        return out
    from torch.utils.tensorboard import SummaryWriter
    from transformers.integrations import TensorBoardCallback

    tb_dir.mkdir(parents=True, exist_ok=True)
    return out + [TensorBoardCallback(tb_writer=SummaryWriter(log_dir=str(tb_dir)))]


def make_trainer(cfg: TrainConfig, model, tok, rows: list[dict], out_dir: Path, tb_dir: Path, progress: bool = True):
    args = common_args(cfg, out_dir, progress)
    callbacks = _callbacks(cfg, tb_dir)
    if cfg.algorithm in ("pg", "awr"):
        from transformers import TrainingArguments

        from .pg import PGCollator, PGTrainer

        if not packed(cfg):
            args["train_sampling_strategy"] = "group_by_length"  # little padding without packing
        return PGTrainer(model=model, args=TrainingArguments(**args, remove_unused_columns=False),
                         train_dataset=_Rows(rows), data_collator=PGCollator(tok.pad_token_id, packed(cfg)),
                         processing_class=tok, callbacks=callbacks, pg=cfg.pg,
                         awr=cfg.algorithm == "awr")
    from datasets import Dataset

    if cfg.algorithm == "sft":
        from trl import SFTConfig, SFTTrainer

        if not packed(cfg):
            args["train_sampling_strategy"] = "group_by_length"
        conf = SFTConfig(**args, max_length=cfg.max_length, packing=packed(cfg), padding_free=packed(cfg),
                         completion_only_loss=True)
        return SFTTrainer(model=model, args=conf, train_dataset=Dataset.from_list(rows), processing_class=tok,
                          callbacks=callbacks)
    dataset = Dataset.from_list(rows, on_mixed_types="use_json")
    if cfg.algorithm == "kto":
        from trl import KTOConfig, KTOTrainer

        good = sum(r["label"] for r in rows)
        bad = len(rows) - good
        # Equal weighted counts: inside the [1, 4/3] ratio TRL recommends.
        conf = KTOConfig(**args, max_length=cfg.max_length, beta=cfg.kto.beta,
                         desirable_weight=max(1.0, bad / max(good, 1)), undesirable_weight=max(1.0, good / max(bad, 1)))
        return KTOTrainer(model=model, args=conf, train_dataset=dataset, processing_class=tok, callbacks=callbacks)
    from trl import DPOConfig, DPOTrainer

    conf = DPOConfig(**args, max_length=cfg.max_length, beta=cfg.dpo.beta)
    return DPOTrainer(model=model, args=conf, train_dataset=dataset, processing_class=tok, callbacks=callbacks)
