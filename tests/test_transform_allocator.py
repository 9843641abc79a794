"""A build keeps Polars' freed pages a few seconds (transform/__init__.py): with the
command line's pages-back-at-once setting it faulted every bucket's buffers in again
(a third of its CPU in the kernel), while the collector keeps that setting."""

from __future__ import annotations

import os
import subprocess
import sys

SHOW = "import os, sys; import nightshift.cli; {}; print(os.environ.get('_RJEM_MALLOC_CONF'))"


def _conf(imports: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if k != "_RJEM_MALLOC_CONF"} | env
    r = subprocess.run([sys.executable, "-c", SHOW.format(imports)], capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_a_build_keeps_freed_pages_and_the_rest_of_the_command_line_does_not():
    assert "dirty_decay_ms:5000" in _conf("import nightshift.transform")  # the build's
    assert "dirty_decay_ms:0" in _conf("import nightshift.collector")  # the sidecar's, as cli/__init__.py sets it


def test_a_users_own_setting_wins_and_a_loaded_polars_is_left_alone():
    assert _conf("import nightshift.transform", _RJEM_MALLOC_CONF="dirty_decay_ms:42") == "dirty_decay_ms:42"
    got = _conf("import polars; import nightshift.transform")  # read once, at load: changing it now would lie
    assert "dirty_decay_ms:5000" not in got
