"""A reward function that kills the process calling it, once: the Ray worker building
a bucket dies half way through it (test_transform_ray). The marker file, named by
NIGHTSHIFT_TEST_KILL_ONCE in the workers' environment, says it happened."""

from __future__ import annotations

import os
import signal


def reward(trajectory) -> None:
    marker = os.environ.get("NIGHTSHIFT_TEST_KILL_ONCE", "")
    if marker and not os.path.exists(marker):
        with open(marker, "w") as fh:
            fh.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return None
