"""The run record: what a run trains on and how (device, precision, attention,
packing, the memory plan), worked out once at the start of `train()` and
handed down, so no helper re-derives it from the settings and no two helpers
can disagree.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclass
class RunPlan:
    device: torch.device
    device_name: str  # "cpu", or the GPU's name (the step line's MFU needs it)
    dtype: torch.dtype
    attention: str  # the attn_implementation the model is loaded with
    packed: bool  # sequences concatenated (positions restart) rather than padded
    why: str = ""  # why that attention and packing, for the plan line
    world_size: int = 1
    rank: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def precision(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _dtype(cfg: TrainConfig, gpu: bool) -> torch.dtype:
    if cfg.precision == "bf16":
        return torch.bfloat16
    if cfg.precision == "fp16":
        return torch.float16
    if cfg.precision == "fp32":
        return torch.float32
    return torch.bfloat16 if gpu and torch.cuda.is_bf16_supported() else torch.float32


def _attention(cfg: TrainConfig, gpu: bool) -> tuple[str, bool, str]:
    name = cfg.attention
    if name == "auto":
        name = "flash_attention_2" if gpu and importlib.util.find_spec("flash_attn") is not None else "sdpa"
    if cfg.packing != "auto":
        return name, cfg.packing == "on", f"{name}, packing {cfg.packing} as configured"
    packed = name.startswith("flash_attention")
    return name, packed, f"{name}, " + ("packed" if packed else "padded batches grouped by length")


def work_out(cfg: TrainConfig) -> RunPlan:
    """The plan for this process: under torchrun / accelerate launch each rank has its own GPU."""
    gpu = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpu else torch.device("cpu")
    attention, packed, why = _attention(cfg, gpu)
    return RunPlan(device=device, device_name=torch.cuda.get_device_name(device) if gpu else "cpu",
                   dtype=_dtype(cfg, gpu), attention=attention, packed=packed, why=why, world_size=world, rank=rank)
