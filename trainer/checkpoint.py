"""Versioned checkpoints: `<output>/<version>/` holding the adapter (or full
weights), the tokenizer with its chat template, and `manifest.json`.

A version exists once its manifest does, and it is written last
(`storage.versions`, which prompt candidates share): a reader listing versions
never sees half of one, and a crash leaves only a temporary folder that the next
run removes. Here: what a checkpoint holds and whether vLLM will load it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import fsspec

from nightshift.storage import versions as versions_store
from nightshift.storage.versions import (  # noqa: F401  (the trainer's names for them, used across stages)
    MANIFEST,
    clean_stale,
    file_hashes,
    is_local,
    staging_dir,
    versions,
)

#: vLLM refuses adapters with these (vllm/lora/peft_helper.py, lora_model.py).
VLLM_REFUSED_INIT = ("pissa", "olora", "corda", "loftq")
VLLM_SAVE_OK = ("classifier", "score")


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def read_manifest(path: str, storage_options: dict | None = None) -> dict:
    fs, root = _fs(path, storage_options)
    with fs.open(f"{root.rstrip('/')}/{MANIFEST}", "r") as f:
        return json.load(f)


def set_served_base(adapter_dir: Path, served_name: str) -> None:
    """PEFT records the path the base was loaded from; vLLM's resolver needs the
    name the server knows the base by (its `--model`)."""
    p = adapter_dir / "adapter_config.json"
    conf = json.loads(p.read_text())
    conf["base_model_name_or_path"] = served_name
    p.write_text(json.dumps(conf, indent=2, sort_keys=True))


def vllm_problems(adapter_dir: str | Path, max_lora_rank: int | None = None) -> list[str]:
    """Why vLLM would refuse to load this adapter (empty: it would load it), from
    the checks vLLM makes (vllm/lora/peft_helper.py::validate_legal, lora_model.py)."""
    d = Path(adapter_dir)
    problems = []
    try:
        conf = json.loads((d / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"adapter_config.json unreadable: {e}"]
    if conf.get("peft_type") != "LORA":
        problems.append(f"peft_type is {conf.get('peft_type')!r}, vLLM loads LORA only")
    if conf.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported by vLLM")
    if conf.get("bias", "none") != "none":
        problems.append(f"bias={conf.get('bias')!r}: vLLM needs bias='none'")
    if conf.get("lora_bias"):
        problems.append("lora_bias is not supported by vLLM")
    init = str(conf.get("init_lora_weights", True)).lower()
    if any(init.startswith(k) for k in VLLM_REFUSED_INIT):
        problems.append(f"init_lora_weights={conf.get('init_lora_weights')!r} is not supported by vLLM")
    extra = [m for m in (conf.get("modules_to_save") or []) if m not in VLLM_SAVE_OK]
    if extra:
        problems.append(f"modules_to_save {extra}: vLLM cannot serve them as LoRA (merge instead)")
    if conf.get("layer_replication"):
        problems.append("layer_replication is not supported by vLLM")
    ranks = [conf.get("r", 0), *(conf.get("rank_pattern") or {}).values()]
    if max_lora_rank is not None and max(ranks) > max_lora_rank:
        problems.append(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}")
    if not (d / "adapter_model.safetensors").exists() and not (d / "adapter_model.bin").exists():
        problems.append("no adapter_model.safetensors")
    else:
        problems += _key_problems(d)
    return problems


def _key_problems(d: Path) -> list[str]:
    f = d / "adapter_model.safetensors"
    if not f.exists():
        return []
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        keys = list(st.keys())
    bad = [k for k in keys if not re.match(r"^base_model\.model\..+\.lora_[AB]\.weight$", k)]
    return [f"unexpected tensor names for vLLM: {bad[:3]}{' ...' if len(bad) > 3 else ''}"] if bad else []


def commit(staged: Path, manifest: dict, output: str, storage_options: dict | None = None) -> str:
    """Give the staged folder the next free version, manifest last, atomically.
    Returns the version's path (or URL); `manifest` gains `version`, `created`, `files`."""
    return versions_store.commit(staged, manifest, output, storage_options)[1]


def fetch(url: str, dest: Path, storage_options: dict | None = None) -> Path:
    """A version's folder on local disk (a download for an object store)."""
    if is_local(url):
        return Path(url.removeprefix("file://"))
    fs, root = _fs(url, storage_options)
    dest.mkdir(parents=True, exist_ok=True)
    fs.get(root.rstrip("/") + "/", str(dest), recursive=True)
    return dest
