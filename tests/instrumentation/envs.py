"""Side virtualenvs for the live instrumentation tests, one per instrumentation
package, built from the pin lists in `requirements/<name>.txt` under
`~/.cache/nightshift-instr/<name>/` (or `$NIGHTSHIFT_INSTR_CACHE`).

Several of these packages register the same `openai` instrumentor entry point, and
their working versions conflict (wrapt 1 vs 2, util-genai 1.1b0 vs newer), so each
gets its own environment.

An environment is reused only when its stamp file holds the hash of its pin list
(and of the interpreter's version); anything else is rebuilt from nothing. Installs
go through uv (bootstrapped with pip into `<cache>/_uv` when not on PATH): about ten
times faster than pip here (3.5 s vs 46 s for one set, cold caches). Environments
are built in parallel. `NIGHTSHIFT_INSTR_INSTALLER=pip` forces plain pip.

A pin list may name modules that must import afterwards (`# import: a.b c`):
some broken combinations install fine and then silently instrument nothing.

    python tests/instrumentation/envs.py [NAME ...]   # build (or check) and time them
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

REQUIREMENTS = Path(__file__).parent / "requirements"
UV_PIN = "uv==0.13.9"
STAMP = ".nightshift-stamp"
LAYOUT_VERSION = "2"  # bump to rebuild every environment


class EnvError(RuntimeError):
    """An environment could not be built; the message carries the installer's output."""


def cache_root() -> Path:
    return Path(os.environ.get("NIGHTSHIFT_INSTR_CACHE") or "~/.cache/nightshift-instr").expanduser()


def names() -> list[str]:
    return sorted(p.stem for p in REQUIREMENTS.glob("*.txt"))


def requirements_file(name: str) -> Path:
    path = REQUIREMENTS / f"{name}.txt"
    if not path.is_file():
        raise EnvError(f"no pin list {path}")
    return path


def imports_of(name: str) -> list[str]:
    out = []
    for line in requirements_file(name).read_text().splitlines():
        line = line.strip()
        if line.startswith("# import:"):
            out += line.split(":", 1)[1].split()
    return out


def stamp_of(name: str, installer: str) -> str:
    h = hashlib.sha256()
    h.update(requirements_file(name).read_bytes())
    h.update(f"\0{sys.version_info[:3]}\0{installer}\0{LAYOUT_VERSION}".encode())
    return h.hexdigest()


def env_dir(name: str) -> Path:
    return cache_root() / name


def python_of(name: str) -> Path:
    return env_dir(name) / "bin" / "python"


def bin_of(name: str, program: str) -> Path:
    return env_dir(name) / "bin" / program


def _base_python() -> str:
    """The interpreter the test venv was made from (a venv's python would chain venvs)."""
    return getattr(sys, "_base_executable", None) or sys.executable


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _installer_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX")}
    env.setdefault("UV_PYTHON_DOWNLOADS", "never")
    env.setdefault("UV_NO_PROGRESS", "1")
    # uv does not read pip's configuration: carry an index set for pip through the environment.
    if "PIP_INDEX_URL" in env and "UV_DEFAULT_INDEX" not in env and "UV_INDEX_URL" not in env:
        env["UV_DEFAULT_INDEX"] = env["PIP_INDEX_URL"]
    if "PIP_EXTRA_INDEX_URL" in env and "UV_INDEX" not in env and "UV_EXTRA_INDEX_URL" not in env:
        env["UV_INDEX"] = env["PIP_EXTRA_INDEX_URL"]
    return env


def _run(cmd: list[str], what: str, timeout: float = 900) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=_installer_env(), cwd=str(cache_root()),
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise EnvError(f"{what}: timed out after {timeout:.0f} s: {' '.join(cmd)}\n{e.stdout or ''}\n{e.stderr or ''}") from None
    except OSError as e:
        raise EnvError(f"{what}: cannot run {cmd[0]}: {e}") from None
    if p.returncode != 0:
        raise EnvError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}")
    return p.stdout + p.stderr


def installer() -> str:
    """`uv` (a path) or `pip`. uv comes from PATH or is bootstrapped once into the cache."""
    if os.environ.get("NIGHTSHIFT_INSTR_INSTALLER", "").lower() == "pip":
        return "pip"
    found = shutil.which("uv")
    if found:
        return found
    tools = cache_root() / "_uv"
    uv = tools / "bin" / "uv"
    with _locked(cache_root() / ".uv.lock"):
        stamp = tools / STAMP
        if uv.exists() and stamp.exists() and stamp.read_text() == UV_PIN:
            return str(uv)
        shutil.rmtree(tools, ignore_errors=True)
        _run([_base_python(), "-m", "venv", str(tools)], "creating the uv bootstrap venv")
        _run([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", UV_PIN], f"pip install {UV_PIN}")
        stamp.write_text(UV_PIN)
    return str(uv)


def ensure(name: str, tool: str | None = None) -> Path:
    """The python of environment `name`, built if missing or stale. Raises EnvError
    with the installer's output when it cannot be built."""
    tool = tool or installer()
    kind = "pip" if tool == "pip" else "uv"
    want = stamp_of(name, kind)
    root = env_dir(name)
    with _locked(cache_root() / f".{name}.lock"):
        stamp = root / STAMP
        if stamp.exists() and stamp.read_text() == want and python_of(name).exists():
            return python_of(name)
        shutil.rmtree(root, ignore_errors=True)
        req = str(requirements_file(name))
        if kind == "uv":
            _run([tool, "venv", "--quiet", "--python", _base_python(), str(root)], f"{name}: uv venv")
            _run([tool, "pip", "install", "--compile-bytecode", "--python", str(python_of(name)), "-r", req], f"{name}: uv pip install -r {req}")
        else:
            _run([_base_python(), "-m", "venv", str(root)], f"{name}: python -m venv")
            _run([str(python_of(name)), "-m", "pip", "install", "--quiet", "-r", req], f"{name}: pip install -r {req}")
        mods = imports_of(name)
        if mods:
            # -P: the cache folder is the working directory, and an environment's folder
            # named like a package (`logfire/`) would shadow it
            _run([str(python_of(name)), "-P", "-c", "import " + ", ".join(mods)], f"{name}: import check ({', '.join(mods)})")
        stamp.write_text(want)
    return python_of(name)


def ensure_packages(name: str, packages: list[str], constraints: str) -> Path:
    """The python of environment `name` holding exactly `packages` (as a user's
    `pip install A B C` names them, unpinned), their versions fixed by the pin list
    `constraints` (`requirements/<constraints>.txt`, as `pip -c`): what a README tells
    a user to install, reproducibly. Cached like `ensure`, keyed on both."""
    tool = installer()
    kind = "pip" if tool == "pip" else "uv"
    pins = requirements_file(constraints)
    h = hashlib.sha256()
    h.update("\0".join(packages).encode() + b"\0" + pins.read_bytes())
    h.update(f"\0{sys.version_info[:3]}\0{kind}\0{LAYOUT_VERSION}".encode())
    want = h.hexdigest()
    root = env_dir(name)
    with _locked(cache_root() / f".{name}.lock"):
        stamp = root / STAMP
        if stamp.exists() and stamp.read_text() == want and python_of(name).exists():
            return python_of(name)
        shutil.rmtree(root, ignore_errors=True)
        if kind == "uv":
            _run([tool, "venv", "--quiet", "--python", _base_python(), str(root)], f"{name}: uv venv")
            _run([tool, "pip", "install", "--compile-bytecode", "--python", str(python_of(name)), "-c", str(pins),
                  *packages], f"{name}: uv pip install {' '.join(packages)}")
        else:
            _run([_base_python(), "-m", "venv", str(root)], f"{name}: python -m venv")
            _run([str(python_of(name)), "-m", "pip", "install", "--quiet", "-c", str(pins), *packages],
                 f"{name}: pip install {' '.join(packages)}")
        stamp.write_text(want)
    return python_of(name)


def ensure_all(which: list[str] | None = None) -> dict[str, Path | EnvError]:
    """Every environment in `which` (default: all), built in parallel. Failures come
    back as EnvError values so each test can fail with its own environment's error."""
    which = list(which or names())
    try:
        tool = installer()
    except EnvError as e:
        return {n: e for n in which}

    def one(n: str) -> Path | EnvError:
        try:
            return ensure(n, tool)
        except EnvError as e:
            return e

    with ThreadPoolExecutor(max_workers=max(1, len(which))) as pool:
        return dict(zip(which, pool.map(one, which)))


if __name__ == "__main__":
    t0 = time.monotonic()
    results = ensure_all(sys.argv[1:] or None)
    for n, r in results.items():
        print(f"{n}: {'ERROR ' + str(r) if isinstance(r, EnvError) else r}")
    print(f"{len(results)} environment(s) in {time.monotonic() - t0:.1f} s (installer: {installer()})")
    sys.exit(1 if any(isinstance(r, EnvError) for r in results.values()) else 0)
