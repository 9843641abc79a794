"""The receiver started afresh, importing only what receiving needs
(`python -m nightshift.collector`, whose `__main__` reads what is passed here).

`nightshift collect` builds the whole command line first, and its parser imports
every stage's settings: Polars, pyarrow and numpy come with them (75 MiB of RSS
in the receiver, half a sidecar's budget, for modules it never calls). Once the
settings are read and checked, `server.run` execs `python -m nightshift.collector`
in the same process (same pid, same stdin, stdout and stderr, same environment), which
imports the collector alone and runs it.

The settings travel pickled in a memory file whose descriptor the new image
inherits, not on the command line, where `ps` would show the bearer token.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys

MODULE = "nightshift.collector"
#: Set in the fresh image: `run` there serves instead of exec'ing again.
ENV = "_NIGHTSHIFT_RECEIVER_LEAN"  # outside the settings' NIGHTSHIFT_COLLECTOR_* names
#: What a receiver never imports; any of them loaded means a fresh start is worth it.
HEAVY = ("polars", "pyarrow", "numpy", "pandas", "torch", "transformers")


def worth_it() -> bool:
    return os.environ.get(ENV) != "1" and any(m in sys.modules for m in HEAVY)


def exec_lean(cfg, log_level: int, log_format: str) -> None:
    """Replaces this process by a fresh interpreter running the receiver with
    `cfg`; returns only if that cannot be done (then the caller runs it here)."""
    fd = os.memfd_create("nightshift-collector-settings", 0) if hasattr(os, "memfd_create") else None
    if fd is None:  # pragma: no cover - not Linux: run in this process
        return
    try:
        os.write(fd, pickle.dumps((cfg, log_level, log_format)))
        os.lseek(fd, 0, os.SEEK_SET)
        os.set_inheritable(fd, True)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", MODULE, str(fd)], {**os.environ, ENV: "1"})
    except OSError as e:  # a missing interpreter, a full memory: still a collector, only a larger one
        logging.getLogger("nightshift.collector").warning("receiver not restarted lean (%s); running as is", e)
        os.close(fd)


def settings(argv: list[str]) -> tuple:
    """(config, log level, log format) as `exec_lean` passed them."""
    with os.fdopen(int(argv[1]), "rb") as f:
        return pickle.load(f)
