"""Candidates stored like checkpoints: `<store>/<agent>/vNNNN/` holding the prompt
(`system.txt`, `prompt.json`), its parent in the same two files (`parent/`), and
`manifest.json`: the parent's version and figures, the critique, the trajectories
the proposer read, the proposer's model and settings, the meta-prompt files' hashes.

A version exists once its manifest does, and the manifest is written last
(trainer/checkpoint.py's pattern): locally the folder is built under a temporary
name beside its place, synced, and renamed into place (two runs never share a
number: the rename fails for the second, which takes the next); on an object
store every other file is uploaded first. A reader never sees half a candidate;
a killed run leaves a `.tmp-*` folder that the next one removes.

After the commit only `screen.json` (the screening result) is added to a version,
written whole; the manifest never changes.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

from nightshift.storage import fsync, fsync_tree, write_atomic

VERSION_RE = re.compile(r"^v(\d{4,})$")
MANIFEST = "manifest.json"
SCREEN = "screen.json"


class StoreError(OSError):
    """A candidate store that cannot be used: one sentence naming the path."""


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def agent_folder(agent: str) -> str:
    """The agent's folder name: the name itself when it is a safe file name, else a
    readable slug and a hash of the name (agent names are the users' text)."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", agent):
        return agent
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", agent).strip("._-")[:40] or "agent"
    return f"{slug}-{hashlib.sha256(agent.encode()).hexdigest()[:8]}"


def agent_root(store: str, agent: str) -> str:
    return f"{store.rstrip('/')}/{agent_folder(agent)}"


@dataclass
class Candidate:
    version: str
    path: str
    manifest: dict
    screen: dict | None = None

    @property
    def system(self) -> str:
        return self.manifest["candidate"]["system"]

    @property
    def version_id(self) -> str:
        return self.manifest["candidate"]["version_id"]


def versions(root: str, storage_options: dict | None = None) -> list[str]:
    """Committed versions in an agent's folder, oldest first."""
    fs, path = _fs(root, storage_options)
    if not fs.exists(path):
        return []
    found = []
    for entry in fs.ls(path, detail=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if VERSION_RE.match(name) and fs.exists(f"{path.rstrip('/')}/{name}/{MANIFEST}"):
            found.append(name)
    return sorted(found, key=lambda v: int(v[1:]))


def _next(root: str, storage_options: dict | None) -> str:
    fs, path = _fs(root, storage_options)
    taken = [int(m.group(1)) for e in (fs.ls(path, detail=False) if fs.exists(path) else [])
             if (m := VERSION_RE.match(e.rstrip("/").rsplit("/", 1)[-1]))]
    return f"v{(max(taken) + 1 if taken else 1):04d}"


def _read_json(fs, path: str) -> dict | None:
    try:
        with fs.open(path, "r") as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def read(root: str, version: str, storage_options: dict | None = None) -> Candidate | None:
    """One committed candidate, or None when its manifest is missing or unreadable."""
    fs, path = _fs(root, storage_options)
    base = f"{path.rstrip('/')}/{version}"
    man = _read_json(fs, f"{base}/{MANIFEST}")
    if man is None or not isinstance(man.get("candidate"), dict):
        return None
    return Candidate(version, f"{root.rstrip('/')}/{version}", man, _read_json(fs, f"{base}/{SCREEN}"))


def candidates(store: str, agent: str, storage_options: dict | None = None) -> list[Candidate]:
    """An agent's committed candidates, oldest first (unreadable ones skipped)."""
    root = agent_root(store, agent)
    return [c for v in versions(root, storage_options) if (c := read(root, v, storage_options)) is not None]


def _stage(files: dict[str, str], root: str) -> Path:
    base = Path(root.removeprefix("file://")) if is_local(root) else Path(tempfile.gettempdir())
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create the candidate folder {base}: {e.strerror}") from None
    d = base / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    for rel, text in files.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return d


def commit(store: str, agent: str, files: dict[str, str], manifest: dict,
           storage_options: dict | None = None) -> Candidate:
    """Store one candidate under the agent's next free version, manifest last."""
    root = agent_root(store, agent)
    staged = _stage(files, root)
    try:
        for _ in range(100):
            version = _next(root, storage_options)
            manifest = {**manifest, "version": version, "agent": agent,
                        "created": manifest.get("created") or dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
            manifest["files"] = {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in files.items()}
            (staged / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False),
                                           encoding="utf-8")
            if is_local(root):
                fsync_tree(staged)
                final = Path(root.removeprefix("file://")) / version
                try:
                    os.rename(staged, final)  # an existing version folder: another run took it
                except OSError:
                    continue
                fsync(final.parent)
                return Candidate(version, str(final), manifest)
            fs, path = _fs(root, storage_options)
            target = f"{path.rstrip('/')}/{version}"
            if fs.exists(target):
                continue
            for p in sorted(staged.rglob("*")):
                if p.is_file() and p.name != MANIFEST:
                    fs.put_file(str(p), f"{target}/{p.relative_to(staged).as_posix()}")
            fs.put_file(str(staged / MANIFEST), f"{target}/{MANIFEST}")
            return Candidate(version, f"{root.rstrip('/')}/{version}", manifest)
        raise StoreError(f"could not find a free version under {root}")
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)


def write_screen(candidate: Candidate, result: dict, storage_options: dict | None = None) -> None:
    write_atomic(f"{candidate.path}/{SCREEN}", json.dumps(result, indent=2, sort_keys=True, ensure_ascii=False),
                 storage_options)
    candidate.screen = result


def clean_stale(store: str, agent: str) -> int:
    """Remove temporary folders that killed runs left (local stores; a folder whose
    process is alive belongs to a run still going)."""
    root = agent_root(store, agent)
    if not is_local(root):
        return 0
    removed = 0
    for d in Path(root.removeprefix("file://")).glob(".tmp-*"):
        try:
            os.kill(int(d.name.split("-")[1]), 0)
            continue
        except (ValueError, IndexError, ProcessLookupError):
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed
