"""A peer's own virtualenv: made once, reused while the peer imports there.

Peers (benchmarks/peer_agl.py, benchmarks/peer_phoenix.py) run in a virtualenv of
their own so that their dependencies never meet Nightshift's. When one cannot be
installed, the benchmark goes on without it and says why (`PeerSkipped`), rather
than failing the measurement of Nightshift. The standard library only: this module
is imported inside those virtualenvs too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class PeerSkipped(Exception):
    """The peer could not be measured; the message says why."""


def python(venv: Path) -> Path:
    return venv / "bin" / "python"


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """The environment of a process in `venv`: ours without what would point Python
    at our own packages, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def version(venv: Path, code: str, timeout: float, env: dict[str, str] | None = None) -> str | None:
    """The last line `code` prints in `venv` (it imports the peer and prints its
    version), or None when the venv is missing or the import fails."""
    py = python(venv)
    if not py.exists():
        return None
    try:
        r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=timeout,
                           env=env or clean_env(venv))
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = r.stdout.strip().splitlines()
    return out[-1] if r.returncode == 0 and out else None


def install(venv: Path, packages: tuple[str, ...], log_path: Path, env: dict[str, str] | None = None) -> None:
    """`python -m venv` (unless it exists) and `pip install packages`, output to
    `log_path`. Raises PeerSkipped, with the command and the log's last lines."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as lf:
        steps = []
        if not python(venv).exists():
            steps.append([sys.executable, "-m", "venv", str(venv)])
        steps.append([str(python(venv)), "-m", "pip", "install", "--disable-pip-version-check", *packages])
        for cmd in steps:
            lf.write(("$ " + " ".join(cmd) + "\n").encode())
            lf.flush()
            try:
                r = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, timeout=1800, env=env or clean_env(venv))
            except subprocess.TimeoutExpired:
                raise PeerSkipped(f"install timed out after 30 min: {' '.join(cmd)} (log: {log_path})") from None
            except OSError as e:
                raise PeerSkipped(f"install failed: {' '.join(cmd)}: {e}") from None
            if r.returncode != 0:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise PeerSkipped(f"install failed (exit {r.returncode}): {' '.join(cmd)}; log {log_path}; last lines: "
                                  + " | ".join(tail))
