"""Named points between the steps of a publication, a rollback or a canary's
start, stop or promotion where a test or a drill kills this process, exactly as
`kill -9` would there, to show that the server and `published.json` end up
agreeing (publish/recover.py) whichever step was the last one done.

Off unless `NIGHTSHIFT_PUBLISH_FAILPOINTS` names points (comma-separated, e.g.
`publish.loaded,canary_start.routed`, or a prompt canary's
`prompt_start.pending`, `prompt_stop.routed`, ...: publish/prompt_canary.py); a point fires once per marker file in
`NIGHTSHIFT_PUBLISH_FAILPOINT_DIR` when that is set (created on firing), else
every time. Read at each hit rather than at import, so a subprocess started with
the variable is all a test needs; when off, `hit` is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("nightshift.publish.failpoints")

ENV = "NIGHTSHIFT_PUBLISH_FAILPOINTS"
ONCE_DIR_ENV = "NIGHTSHIFT_PUBLISH_FAILPOINT_DIR"


def hit(name: str) -> None:
    armed = os.environ.get(ENV)
    if not armed or name not in {p.strip() for p in armed.split(",")}:
        return
    once = os.environ.get(ONCE_DIR_ENV)
    if once:
        try:
            os.close(os.open(os.path.join(once, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    log.critical("failpoint %s: killing process %d (SIGKILL)", name, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
