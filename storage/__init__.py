"""Durable writes on a local disk, shared by every stage that writes: the collector's
log and datasets, the build's partitions, the trainer's checkpoints.

A rename is atomic but not durable until the folder holding it is synced, and a
file's bytes are not durable until the file is: each writer calls these at its
commit point, so a power cut leaves the old state or the new one, never half.
"""

from __future__ import annotations

import os
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
