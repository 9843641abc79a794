"""Versioned folders, `<root>/vNNNN/`, each complete once its `manifest.json` is:
the trainer's checkpoints and the prompt candidates are both stored this way, and
a reader of either lists versions with `versions`.

The manifest is written last. Locally a version is built under a temporary name
beside its place (`.tmp-<pid>-<hex>`), synced, and renamed into place, then the
folder holding it is synced: two runs never share a number (the rename fails for
the second, which takes the next free one). On an object store every other file is
uploaded first and the manifest last. A reader never sees half a version; a killed
run leaves a temporary folder that `clean_stale` removes once its process is gone.
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

from . import fsync, fsync_tree

VERSION_RE = re.compile(r"^v(\d{4,})$")
MANIFEST = "manifest.json"
#: Tries for a free number before giving up: each lost race takes the next one.
ATTEMPTS = 100


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _numbers(fs, path: str) -> list[tuple[int, str]]:
    if not fs.exists(path):
        return []
    out = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if m := VERSION_RE.match(name):
            out.append((int(m.group(1)), name))
    return out


def versions(root: str, storage_options: dict | None = None) -> list[str]:
    """The committed versions under `root` (those with a manifest), oldest first."""
    fs, path = _fs(root, storage_options)
    base = path.rstrip("/")
    return [name for _, name in sorted(_numbers(fs, path)) if fs.exists(f"{base}/{name}/{MANIFEST}")]


def next_version(root: str, storage_options: dict | None = None) -> str:
    """One past the highest number taken, committed or not: a folder a crash left
    without its manifest keeps its number, so a version name is never reused."""
    fs, path = _fs(root, storage_options)
    taken = [n for n, _ in _numbers(fs, path)]
    return f"v{(max(taken) + 1 if taken else 1):04d}"


def staging_dir(root: str, elsewhere: Path) -> Path:
    """An empty folder to build a version in: beside its final place for a local
    root (the commit is then a rename on one filesystem), under `elsewhere` for an
    object store."""
    base = Path(root.removeprefix("file://")) if is_local(root) else Path(elsewhere)
    base.mkdir(parents=True, exist_ok=True)
    d = base / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but the manifest, by relative path."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[p.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def commit(staged: Path, manifest: dict, root: str, storage_options: dict | None = None) -> tuple[str, str]:
    """Give the staged folder the next free version under `root`, its manifest
    written last with `version`, `created` (unless set) and `files` (their hashes)
    filled in. Returns (version, the version's path or URL). On failure the staged
    folder is left to the caller."""
    fs, path = _fs(root, storage_options)
    manifest["files"] = file_hashes(staged)
    manifest["created"] = manifest.get("created") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    for _ in range(ATTEMPTS):
        version = next_version(root, storage_options)
        manifest["version"] = version
        text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False, default=str)
        (staged / MANIFEST).write_text(text, encoding="utf-8")
        if is_local(root):
            fsync_tree(staged)
            final = Path(path) / version
            try:
                os.rename(staged, final)  # fails when another run took this number meanwhile
            except OSError:
                continue
            fsync(final.parent)
            return version, str(final)
        target = f"{path.rstrip('/')}/{version}"
        if fs.exists(target):
            continue
        for p in sorted(staged.rglob("*")):
            if p.is_file() and p.name != MANIFEST:
                fs.put_file(str(p), f"{target}/{p.relative_to(staged).as_posix()}")
        fs.put_file(str(staged / MANIFEST), f"{target}/{MANIFEST}")
        shutil.rmtree(staged, ignore_errors=True)
        return version, f"{root.rstrip('/')}/{version}"
    raise RuntimeError(f"could not find a free version under {root}")


def clean_stale(root: str) -> int:
    """Remove the temporary folders killed runs left under a local root; a folder
    whose process is alive belongs to a run still going, and stays."""
    if not is_local(root):
        return 0
    base = Path(root.removeprefix("file://"))
    removed = 0
    for d in base.glob(".tmp-*") if base.is_dir() else ():
        try:
            os.kill(int(d.name.split("-")[1]), 0)
            continue  # alive
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed
