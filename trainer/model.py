"""Loading the policy, its tokenizer and the reference, the way the hardware
wants: bf16 and the fastest attention on a GPU, fp32 and sdpa on a CPU; LoRA
settings vLLM can serve (no DoRA, no bias, no `modules_to_save`). Nothing is
downloaded: a base model is a local folder or already in the local cache.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import warnings

import torch

from .config import TrainConfig
from .plan import RunPlan, local_model, work_out
from .select import TrainDataError

log = logging.getLogger("nightshift.trainer")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a nightly job never reaches for the Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers 5 renames gradient_checkpointing; TRL's configs still set the old name.
warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)


def load_tokenizer(cfg: TrainConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(local_model(cfg.base_model, "base_model"))
    if cfg.chat_template:
        try:
            tok.chat_template = Path(cfg.chat_template).read_text()
        except OSError as e:
            raise TrainDataError(f"chat_template: cannot read {cfg.chat_template}: {e.strerror}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_base(cfg: TrainConfig, plan: RunPlan | None = None):
    from transformers import AutoModelForCausalLM

    plan = plan or work_out(cfg)
    return AutoModelForCausalLM.from_pretrained(
        local_model(cfg.base_model, "base_model"), dtype=plan.dtype, attn_implementation=plan.attention)


def load_version(cfg: TrainConfig, folder: str | None, plan: RunPlan | None = None):
    """A checkpoint version as a model for scoring (not training): the base with
    its LoRA adapter, its full weights, or (`folder` None) the base itself."""
    plan = plan or work_out(cfg)
    if not folder:
        return load_base(cfg, plan)
    from .checkpoint import read_manifest

    if read_manifest(folder).get("kind") == "full":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder, dtype=plan.dtype, attn_implementation=plan.attention)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(cfg, plan), folder)


def lora_config(cfg: TrainConfig):
    from peft import LoraConfig

    targets = cfg.lora.target_modules
    return LoraConfig(
        r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        bias="none", use_dora=False, task_type="CAUSAL_LM",
    )


def load_policy(cfg: TrainConfig, plan: RunPlan, base=None):
    """The model to train: the base (full fine-tuning), the base with a fresh LoRA
    adapter, or the base with `init_adapter` loaded trainable."""
    base = base if base is not None else load_base(cfg, plan)
    if cfg.full_finetune:
        return base
    from peft import PeftModel, get_peft_model

    if cfg.init_adapter:
        return PeftModel.from_pretrained(base, local_model(cfg.init_adapter, "init_adapter"), is_trainable=True)
    return get_peft_model(base, lora_config(cfg))


@dataclass
class Reference:
    """The policy a run is measured against: its log-probs of the completion tokens
    (pg's KL penalty), and its final hidden states with its head (the held-out
    exact KL, chunked: trainer/logprobs.py)."""

    logprobs: Callable[[dict], torch.Tensor]
    states: Callable[[dict], Any]


@contextlib.contextmanager
def reference(cfg: TrainConfig, plan: RunPlan, policy, which: str):
    """Yields the `Reference`: the base model (the policy's adapter switched off
    for the call: no second copy) or the policy training started from (`init`:
    the init adapter, loaded once beside)."""
    from .logprobs import adapter_off, completion_logprobs, completion_states

    is_peft = hasattr(policy, "disable_adapter")
    if is_peft and (which == "base" or not cfg.init_adapter):  # a fresh adapter starts as the base

        def off(batch):
            with policy.disable_adapter():
                return completion_logprobs(policy, batch)

        yield Reference(off, adapter_off(policy))
        return
    ref = load_base(cfg, plan)
    if which == "init" and cfg.init_adapter:
        from peft import PeftModel

        ref = PeftModel.from_pretrained(ref, cfg.init_adapter)
    ref.to(plan.device).eval()
    try:
        yield Reference(lambda batch: completion_logprobs(ref, batch), lambda batch: completion_states(ref, batch))
    finally:
        del ref
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
