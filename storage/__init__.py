"""Durable writes, shared by every stage that writes: the collector's log and
datasets, the build's partitions, the trainer's checkpoints, and the small state
files (`published.json`, the route table, the build's and the nightly job's state).

A rename is atomic but not durable until the folder holding it is synced, and a
file's bytes are not durable until the file is: each writer calls these at its
commit point, so a power cut leaves the old state or the new one, never half.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def fsync(path: str | Path) -> None:
    """Flush a file's bytes, or a folder's entries (creations, renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | Path) -> None:
    """Every file under `folder`, then the folder itself."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fsync(p)
    fsync(folder)


def write_atomic(target: str | Path, data: bytes | str, storage_options: dict | None = None) -> None:
    """Replace a small file whole: a reader (or a crash) sees the old bytes or the new
    ones, never a mix, and once this returns the new ones survive a power cut.

    Locally: a uniquely named temporary file beside the target (two writers never share
    one), fsync'd, renamed over the target, then the folder fsync'd (the rename is not
    durable before). An fsspec URL (`s3://...`) is one PUT, which object stores make
    atomic. The temporary file is removed when anything fails before the rename.
    """
    body = data.encode() if isinstance(data, str) else bytes(data)
    text = str(target)
    if "://" in text and not text.startswith("file://"):
        import fsspec

        fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
        fs.pipe(path, body)
        return
    path = Path(text.removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync(path.parent)
