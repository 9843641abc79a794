"""Named points where a fault-injection campaign kills this process, exactly as
`kill -9` would at that moment, to show that what the collector promises holds
at the worst instant, not only at a random one.

Off unless `NIGHTSHIFT_FAILPOINTS` names points (comma-separated); then a point
fires once per marker file in `NIGHTSHIFT_FAILPOINT_DIR` (created on firing;
remove it to arm the point again), or every time without that folder. When off,
`hit` is one set lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("nightshift.failpoints")

_ARMED = frozenset(p.strip() for p in os.environ.get("NIGHTSHIFT_FAILPOINTS", "").split(",") if p.strip())
_ONCE_DIR = os.environ.get("NIGHTSHIFT_FAILPOINT_DIR", "")


def hit(name: str) -> None:
    if name not in _ARMED:
        return
    if _ONCE_DIR:
        try:
            os.close(os.open(os.path.join(_ONCE_DIR, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    log.critical("failpoint %s: killing process %d (SIGKILL)", name, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
