"""The run record: what a run trains on and how (device, precision, attention,
packing, the memory plan), worked out once at the start of `train()` and
handed down, so no helper re-derives it from the settings and no two helpers
can disagree.

The memory plan is made twice, both before the model is loaded: first from the
model's config alone (it fixes `max_length`: the model's own limit unless set,
lowered if one row of it would not fit), then, once the rows are rendered,
from the longest row and the share of completion tokens the data really has
(`fitted`): a bigger micro-batch where the rows are shorter than the limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import TrainConfig
    from .memory import MemoryPlan


@dataclass
class RunPlan:
    device: torch.device
    device_name: str  # "cpu", or the GPU's name (the step line's MFU needs it)
    dtype: torch.dtype
    attention: str  # the attn_implementation the model is loaded with
    packed: bool  # sequences concatenated (positions restart) rather than padded
    why: str = ""  # why that attention and packing, for the plan line
    memory: MemoryPlan | None = None
    world_size: int = 1
    rank: int = 0
    #: tokens per optimizer step over every rank (0: rows_per_step rules)
    tokens_per_step: int = 0
    #: rows per optimizer step over every rank (`train.batch_size`; 0: tokens_per_step rules)
    rows_per_step: int = 0
    #: tokens of the longest row to train on, once they are rendered (0: not known yet)
    longest_row: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def max_length(self) -> int:
        return self.memory.max_length if self.memory is not None else 0

    @property
    def micro_batch_tokens(self) -> int:
        return self.memory.micro_batch_tokens if self.memory is not None else 0

    def lines(self) -> list[str]:
        """What a person reads before step 1: the memory plan, then the rest."""
        step = (f"{self.rows_per_step:,} rows per step (train.batch_size)" if self.rows_per_step
                else f"{self.tokens_per_step:,} tokens per step")
        ranks = f" over {self.world_size} processes" if self.world_size > 1 else ""
        out = [self.memory.line()] if self.memory is not None else []
        out.append(f"run plan: {self.device_name}, {self.precision}, {self.why}; {step}{ranks}")
        return out

    def summary(self) -> dict:
        """The manifest's record of it."""
        m = self.memory
        return {
            "device": self.device_name, "precision": self.precision, "attention": self.attention,
            "packed": self.packed, "why": self.why, "world_size": self.world_size,
            "tokens_per_step": self.tokens_per_step or None, "rows_per_step": self.rows_per_step or None,
            "memory_plan": None if m is None else {
                "line": m.line(), "micro_batch_tokens": m.micro_batch_tokens, "grad_accum": m.grad_accum,
                "checkpointing": m.checkpointing, "checkpointed_layers": m.checkpointed_layers,
                "max_length": m.max_length, "estimated_gib": round(m.estimated_gib, 3),
                "available_gib": None if m.available_gib is None else round(m.available_gib, 3),
                "notes": list(m.notes)},
        }

    def fitted(self, cfg: TrainConfig, longest_row: int, completion_share: float) -> RunPlan:
        """The plan remade for the rows as rendered (their longest, their share of
        completion tokens), the max_length already chosen kept."""
        if self.memory is None or self.memory.inputs is None:
            return self
        memory = _memory(cfg, self, self.memory.inputs.shape, max_length=self.memory.max_length,
                         longest_row=longest_row, completion_share=completion_share)
        return replace(self, memory=memory, longest_row=longest_row)


def _dtype(cfg: TrainConfig, gpu: bool) -> torch.dtype:
    if cfg.precision == "bf16":
        return torch.bfloat16
    if cfg.precision == "fp16":
        return torch.float16
    if cfg.precision == "fp32":
        return torch.float32
    return torch.bfloat16 if gpu and torch.cuda.is_bf16_supported() else torch.float32


#: Tokens a row is assumed to have when rows per step must become tokens for the
#: plan before the rows are known (agent calls: ~6k prompt + ~400 completion).
ROW_TOKENS_GUESS = 8192


def _memory(cfg: TrainConfig, plan: RunPlan, shape, *, max_length: int, longest_row: int = 0,
            completion_share: float = 1.0) -> MemoryPlan:
    from . import memory
    from .logprobs import head_kind

    available, free = memory.device_budget(cfg.memory_fraction, plan.device)
    if plan.rows_per_step:
        per_row = longest_row or max_length or ROW_TOKENS_GUESS
        tokens = plan.rows_per_step * per_row
    else:
        tokens = plan.tokens_per_step
    return memory.plan(
        shape, tokens_per_step=max(1, -(-tokens // plan.world_size)), max_length_wanted=max_length,
        longest_row=longest_row, lora_r=cfg.lora.r, full_finetune=cfg.full_finetune,
        dtype_bytes=plan.dtype.itemsize, available_bytes=available,
        attention=memory.attention_kind(plan.attention, plan.packed), packed=plan.packed,
        checkpointing=cfg.gradient_checkpointing, completion_share=completion_share, free_bytes=free,
        memory_fraction=cfg.memory_fraction, head=head_kind(plan.device))


def work_out(cfg: TrainConfig, model_config=None) -> RunPlan:
    """The plan for this process (under torchrun / accelerate launch each rank has
    its own GPU). `model_config`: the base model's transformers config (default:
    read from `base_model`), from which the memory plan is made."""
    from .attention import packed_attention

    gpu = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    dtype = _dtype(cfg, gpu)
    choice = packed_attention(device, cfg.attention, dtype=dtype)
    packed, why = choice.packed, choice.why
    if cfg.packing != "auto":
        packed = cfg.packing == "on"
        why = f"{choice.name}, packing {cfg.packing} as configured"
    rows = cfg.batch_size * cfg.grad_accum if cfg.batch_size > 0 else 0
    plan = RunPlan(device=device, device_name=torch.cuda.get_device_name(device) if gpu else "cpu", dtype=dtype,
                   attention=choice.name, packed=packed, why=why, world_size=world, rank=rank,
                   tokens_per_step=0 if rows else cfg.tokens_per_step, rows_per_step=rows)
    from .memory import ModelShape

    if model_config is None:
        model_config = _model_config(cfg)
    plan.memory = _memory(cfg, plan, ModelShape.from_config(model_config), max_length=cfg.max_length)
    return plan


def _model_config(cfg: TrainConfig):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(local_model(cfg.base_model, "base_model"))


def local_model(path: str, what: str) -> str:
    """`path` if it is a local folder or already in the Hugging Face cache; else a
    `TrainDataError` (nothing is downloaded at run time)."""
    if Path(path).is_dir():
        return path
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = any(isinstance(try_to_load_from_cache(path, f), str) for f in ("config.json", "adapter_config.json"))
    except Exception:  # noqa: BLE001 - not even a valid repo id
        cached = False
    if not cached:
        from .select import TrainDataError

        raise TrainDataError(f"{what} {path!r} is not a local folder and not in the local Hugging Face cache "
                             "(nothing is downloaded at run time: save it to a folder first)")
    return path
