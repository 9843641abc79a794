"""Candidates stored like checkpoints: `<store>/<agent>/vNNNN/` holding the prompt
(`system.txt`, `prompt.json`), its parent in the same two files (`parent/`), and
`manifest.json`: the parent's version and figures, the critique, the trajectories
the proposer read, the proposer's model and settings, the meta-prompt files' hashes.

A version exists once its manifest does, and the manifest is written last
(`storage.versions`, as the trainer's checkpoints are): two runs never share a
number, a reader never sees half a candidate, and a killed run leaves a `.tmp-*`
folder that the next one removes.

After the commit only `screen.json` (the screening result) is added to a version,
written whole; the manifest never changes.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import fsspec

from nightshift.storage import versions as stored
from nightshift.storage import write_atomic
from nightshift.storage.versions import MANIFEST, is_local  # noqa: F401  (is_local: this store's name for it)
SCREEN = "screen.json"


class StoreError(OSError):
    """A candidate store that cannot be used: one sentence naming the path."""


def _fs(url: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **(storage_options or {}))


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
    return stored.versions(root, storage_options)


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
    try:
        d = stored.staging_dir(root, Path(tempfile.gettempdir()))
    except OSError as e:
        raise StoreError(f"cannot create the candidate folder under {root}: {e.strerror}") from None
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
    manifest = {**manifest, "agent": agent}
    try:
        version, path = stored.commit(staged, manifest, root, storage_options)
    except RuntimeError as e:
        raise StoreError(str(e)) from None
    finally:
        if staged.exists():
            shutil.rmtree(staged, ignore_errors=True)
    return Candidate(version, path, manifest)


def write_screen(candidate: Candidate, result: dict, storage_options: dict | None = None) -> None:
    write_atomic(f"{candidate.path}/{SCREEN}", json.dumps(result, indent=2, sort_keys=True, ensure_ascii=False),
                 storage_options)
    candidate.screen = result


def clean_stale(store: str, agent: str) -> int:
    """Remove temporary folders that killed runs left (local stores; a folder whose
    process is alive belongs to a run still going)."""
    return stored.clean_stale(agent_root(store, agent))
