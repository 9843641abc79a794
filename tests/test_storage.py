"""storage.write_atomic, the one writer of every small state file: old or new bytes,
never a mix, nothing left behind when it fails."""

from __future__ import annotations

import errno
import os

import pytest

import nightshift.storage as storage


def test_replaces_whole_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "deep" / "state.json"
    storage.write_atomic(target, '{"a": 1}')
    storage.write_atomic(target, b'{"a": 2}')
    assert target.read_bytes() == b'{"a": 2}'
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_a_failed_write_keeps_the_old_bytes_and_removes_its_temporary(tmp_path, monkeypatch):
    target = tmp_path / "published.json"
    storage.write_atomic(target, "old")
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data)[:3])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        storage.write_atomic(target, "new and longer")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["published.json"]


def test_the_folder_is_synced_after_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = storage.fsync
    monkeypatch.setattr(storage, "fsync", lambda p: (synced.append(str(p)), real_fsync(p)))
    storage.write_atomic(tmp_path / "x.json", "1")
    assert synced == [str(tmp_path)]


def test_file_urls_are_local_paths(tmp_path):
    storage.write_atomic(f"file://{tmp_path}/x.json", "1")
    assert (tmp_path / "x.json").read_text() == "1"


def test_object_store_urls_are_one_put(tmp_path):
    storage.write_atomic("memory://nightshift-test/state.json", "v1")
    storage.write_atomic("memory://nightshift-test/state.json", "v2")
    import fsspec

    assert fsspec.filesystem("memory").cat("/nightshift-test/state.json") == b"v2"
