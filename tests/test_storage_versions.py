"""Versioned folders (`storage.versions`), which the trainer's checkpoints and the
prompt candidates share: a version is listed only once its manifest is in place,
a number is never given twice, and what a killed run leaves is cleaned up."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import fsspec
import pytest

from nightshift.storage import versions as V


def _staged(root: str, tmp_path: Path, files: dict[str, str]) -> Path:
    d = V.staging_dir(root, tmp_path / "work")
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def test_versions_count_up_and_the_manifest_names_each_file_by_its_hash(tmp_path):
    root = str(tmp_path / "out")
    v1, p1 = V.commit(_staged(root, tmp_path, {"a.txt": "one", "sub/b.txt": "two"}), {"kind": "x"}, root)
    v2, p2 = V.commit(_staged(root, tmp_path, {"a.txt": "three"}), {"kind": "y"}, root)
    assert (v1, v2) == ("v0001", "v0002") and V.versions(root) == ["v0001", "v0002"]
    man = json.loads((Path(p1) / V.MANIFEST).read_text())
    assert man["version"] == "v0001" and man["kind"] == "x" and man["created"]
    assert man["files"] == {"a.txt": hashlib.sha256(b"one").hexdigest(), "sub/b.txt": hashlib.sha256(b"two").hexdigest()}
    assert not list(Path(root).glob(".tmp-*"))  # the staged folders became the versions


def test_a_version_without_its_manifest_is_not_listed_and_keeps_its_number(tmp_path):
    root = tmp_path / "out"
    V.commit(_staged(str(root), tmp_path, {"a": "1"}), {}, str(root))
    (root / "v0002").mkdir()  # a crash between the uploads and the manifest, on an object store
    (root / "v0002" / "a").write_text("half")
    assert V.versions(str(root)) == ["v0001"]
    assert V.commit(_staged(str(root), tmp_path, {"a": "3"}), {}, str(root))[0] == "v0003"


def test_runs_committing_at_once_never_share_a_number(tmp_path):
    root = str(tmp_path / "out")
    staged = [_staged(root, tmp_path, {"n.txt": str(i)}) for i in range(8)]
    got: list[tuple[str, str]] = []
    start = threading.Barrier(len(staged))

    def one(d: Path) -> None:
        start.wait()
        got.append(V.commit(d, {}, root))

    threads = [threading.Thread(target=one, args=(d,)) for d in staged]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for v, _ in got) == [f"v{i:04d}" for i in range(1, 9)] == V.versions(root)
    assert sorted(Path(p, "n.txt").read_text() for _, p in got) == [str(i) for i in range(8)]


def test_on_an_object_store_the_manifest_goes_last_and_a_failed_upload_leaves_no_version(tmp_path, monkeypatch):
    root = f"memory://versions-{uuid.uuid4().hex}/out"
    fs = fsspec.filesystem("memory")
    order: list[str] = []
    real = type(fs).put_file

    def put_file(self, lpath, rpath, *a, **kw):
        order.append(rpath.rsplit("/", 1)[-1])
        if Path(lpath).name == "b.txt" and fail:
            raise OSError("connection reset")
        return real(self, lpath, rpath, *a, **kw)

    monkeypatch.setattr(type(fs), "put_file", put_file)
    fail = True
    staged = _staged(root, tmp_path, {"a.txt": "1", "b.txt": "2"})
    assert staged.parent == tmp_path / "work"  # built on local disk, uploaded at the commit
    with pytest.raises(OSError):
        V.commit(staged, {}, root)
    assert V.versions(root) == [] and staged.exists()  # nothing half-listed; the caller still has its files
    fail = False
    order.clear()
    version, url = V.commit(staged, {}, root)
    assert version == "v0002" and url == f"{root}/v0002" and V.versions(root) == ["v0002"]
    assert order[-1] == V.MANIFEST and sorted(order[:-1]) == ["a.txt", "b.txt"]
    assert not staged.exists()


def test_clean_stale_removes_what_a_dead_run_left_and_keeps_a_live_runs_folder(tmp_path):
    root = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = root / f".tmp-{dead.stdout.strip()}-abcd1234"
    live = V.staging_dir(str(root), tmp_path / "work")  # this process's: a run still going
    gone.mkdir(parents=True)
    (gone / "weights").write_text("x")
    assert V.clean_stale(str(root)) == 1
    assert not gone.exists() and live.exists()
    assert V.clean_stale("memory://elsewhere/out") == 0  # an object store keeps no staged folders
