"""The few file operations a dataset store makes, on a local folder, without
fsspec.

fsspec costs the flusher 6 MiB of RSS (it imports asyncio, zstandard and the
compression modules of every format it knows) for what `os` does on a local
disk, which is where a sidecar's lake is when it is not an object store. Remote
URLs still go through fsspec; `DatasetStore.fs` builds its local filesystem on
first use for callers that want fsspec's API (globbing, `nightshift ingest` of
feedback files).
"""

from __future__ import annotations

import os
from typing import BinaryIO


def local_root(url: str, storage_options: dict | None) -> str | None:
    """The folder of a local data root (a path or `file://` URL without
    options), or None when fsspec must handle it."""
    if storage_options:
        return None
    if url.startswith("file://"):
        url = url[len("file://"):]
    elif "://" in url or "::" in url:
        return None
    return os.path.abspath(os.path.expanduser(url)).rstrip("/") or "/"


class LocalFiles:
    """`makedirs`, `open`, `ls`, `exists` and `rm` with fsspec's meanings, on a
    local disk."""

    protocol = ("file", "local")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def open(self, path: str, mode: str = "rb") -> BinaryIO:
        return open(path, mode)

    def ls(self, path: str, detail: bool = False) -> list[str]:
        if detail:
            raise NotImplementedError("LocalFiles.ls lists names only")
        return [os.path.join(path, name) for name in sorted(os.listdir(path))]

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def rm(self, path: str) -> None:
        os.remove(path)
