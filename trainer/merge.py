"""Full weights from a LoRA checkpoint: the base with the adapter merged in, saved
with the tokenizer, for engines or publishing paths that take whole models
(vLLM's `reload_weights`, a blue-green restart, an adapter that trained
embeddings). Written atomically like a checkpoint: a temporary folder, renamed.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from .checkpoint import MANIFEST, read_manifest


class MergeError(ValueError):
    pass


def merge(checkpoint: str | Path, out: str | Path, base_model: str = "", dtype: str = "auto") -> Path:
    """Merge the adapter of `checkpoint` into its base and save under `out`.

    `base_model`: where the base's weights are (default: the manifest's
    `base_model`, the path training loaded; the adapter itself names the
    serving engine's model, which need not be a local folder)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = Path(checkpoint)
    if not (ckpt / "adapter_config.json").exists():
        if (ckpt / "config.json").exists():
            raise MergeError(f"{ckpt} holds full weights already (a full fine-tune): nothing to merge")
        raise MergeError(f"{ckpt} is not a checkpoint: no adapter_config.json")
    manifest = read_manifest(str(ckpt)) if (ckpt / MANIFEST).exists() else {}
    base = base_model or manifest.get("base_model") or ""
    if not base or not Path(base).is_dir():
        raise MergeError(f"the base model's weights are needed to merge: {base or '(unknown)'} is not a local folder; "
                         "give it with --base-model")
    torch_dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(model, str(ckpt)).merge_and_unload()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    out = Path(out)
    tmp = out.parent / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        merged.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if manifest:
            (tmp / "merged_from.json").write_text(json.dumps(
                {"checkpoint": str(ckpt), "version": manifest.get("version"), "base_model": base}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
