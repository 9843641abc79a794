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


def has(job: int, module: str) -> bool:
    """Whether the process running the job had imported `module` before it."""
    import sys

    return module in sys.modules
