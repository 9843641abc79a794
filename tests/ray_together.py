"""A job that waits for the other jobs of its round (test_transform_ray): it leaves a
mark and waits for every job's, so it returns True only when the whole round ran at
once. Workers import it by name (the tests' folder is on their PYTHONPATH)."""

from __future__ import annotations

import os
import time


def meet(job: int, shared: tuple[str, int, float]) -> bool:
    folder, jobs, patience = shared
    open(os.path.join(folder, f"{job}-{os.getpid()}"), "w").close()
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        if len(os.listdir(folder)) >= jobs:
            return True
        time.sleep(0.05)
    return False


def arrive(job: int, shared: tuple[str, float]) -> int:
    """Writes the job's number to the round's log as it starts, then works (sleeps) a
    while: the log is the order the workers took the jobs in."""
    log, seconds = shared
    with open(log, "a") as f:
        f.write(f"{job}\n")
    time.sleep(seconds)
    return job


def has(job: int, shared: tuple[str, float]) -> tuple[bool, int]:
    """Whether the process running the job had imported `module` before it, and the
    process; then works (sleeps) a while, so the process stays busy."""
    import sys

    module, seconds = shared
    there = module in sys.modules
    time.sleep(seconds)
    return there, os.getpid()


def where(seconds: float, shared: object = None) -> int:
    """The process that ran the job, after working (sleeping) the job's seconds."""
    time.sleep(seconds)
    return os.getpid()
