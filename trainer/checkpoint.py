"""Versioned checkpoints: `<output>/<version>/` holding the adapter (or full
weights), the tokenizer with its chat template, and `manifest.json`.

A version exists once its manifest does, and it is written last: locally the
whole folder is built under a temporary name and renamed into place (atomic),
on an object store (fsspec URL) every other file is uploaded first. A reader
listing versions never sees half of one, and a crash leaves only a temporary
folder that the next run removes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import fsspec

from nightshift.storage import fsync_tree

VERSION_RE = re.compile(r"^v(\d{4,})$")
MANIFEST = "manifest.json"
#: vLLM refuses adapters with these (vllm/lora/peft_helper.py, lora_model.py).
VLLM_REFUSED_INIT = ("pissa", "olora", "corda", "loftq")
VLLM_SAVE_OK = ("classifier", "score")


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def versions(output: str, storage_options: dict | None = None) -> list[str]:
    """Committed versions under `output`, oldest first."""
    fs, root = _fs(output, storage_options)
    if not fs.exists(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if VERSION_RE.match(name) and fs.exists(f"{root.rstrip('/')}/{name}/{MANIFEST}"):
            found.append(name)
    return sorted(found, key=lambda v: int(v[1:]))


def next_version(output: str, storage_options: dict | None = None) -> str:
    fs, root = _fs(output, storage_options)
    taken = [int(m.group(1)) for e in (fs.ls(root, detail=False) if fs.exists(root) else [])
             if (m := VERSION_RE.match(e.rstrip("/").rsplit("/", 1)[-1]))]
    return f"v{(max(taken) + 1 if taken else 1):04d}"


def read_manifest(path: str, storage_options: dict | None = None) -> dict:
    fs, root = _fs(path, storage_options)
    with fs.open(f"{root.rstrip('/')}/{MANIFEST}", "r") as f:
        return json.load(f)


def file_hashes(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[str(p.relative_to(folder))] = h.hexdigest()
    return out


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


def staging_dir(output: str, work_dir: Path) -> Path:
    """Where a version is assembled: beside its final place for a local output (so
    the commit is a rename on one filesystem), in the work folder otherwise."""
    base = Path(output.removeprefix("file://")) if is_local(output) else work_dir
    base.mkdir(parents=True, exist_ok=True)
    d = base / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d


def commit(staged: Path, manifest: dict, output: str, storage_options: dict | None = None) -> str:
    """Give the staged folder the next free version, manifest last, atomically.
    Returns the version's URL (or path)."""
    fs, root = _fs(output, storage_options)
    for _ in range(100):
        version = next_version(output, storage_options)
        manifest["version"] = version
        manifest["created"] = manifest.get("created") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        manifest["files"] = file_hashes(staged)
        (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        if is_local(output):
            fsync_tree(staged)
            final = Path(root) / version
            try:
                os.rename(staged, final)  # fails if another run took this version meanwhile
            except OSError:
                continue
            fd = os.open(final.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            return str(final)
        target = f"{root.rstrip('/')}/{version}"
        if fs.exists(target):
            continue
        for p in sorted(staged.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                fs.put_file(str(p), f"{target}/{p.relative_to(staged).as_posix()}")
        fs.put_file(str(staged / MANIFEST), f"{target}/{MANIFEST}")
        shutil.rmtree(staged, ignore_errors=True)
        return f"{output.rstrip('/')}/{version}"
    raise RuntimeError(f"could not find a free version under {output}")


def clean_stale(output: str) -> int:
    """Remove temporary folders that killed runs left behind (local outputs; a
    folder whose process is still alive is another run's, and stays)."""
    if not is_local(output):
        return 0
    root = Path(output.removeprefix("file://"))
    removed = 0
    for d in root.glob(".tmp-*") if root.is_dir() else ():
        try:
            pid = int(d.name.split("-")[1])
            os.kill(pid, 0)
            continue  # alive
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed


def fetch(url: str, dest: Path, storage_options: dict | None = None) -> Path:
    """A version's folder on local disk (a download for an object store)."""
    if is_local(url):
        return Path(url.removeprefix("file://"))
    fs, root = _fs(url, storage_options)
    dest.mkdir(parents=True, exist_ok=True)
    fs.get(root.rstrip("/") + "/", str(dest), recursive=True)
    return dest
