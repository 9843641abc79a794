"""`python -m nightshift.collector FD`: the receiver as `server.run` restarts it,
lean (see `receiver_main`); not a command of its own, `nightshift collect` is."""

from __future__ import annotations

import logging
import sys

from nightshift.settings import logs

from .receiver_main import settings
from .server import CannotStart, run


def main(argv: list[str]) -> int:
    cfg, log_level, log_format = settings(argv)
    logs.configure(log_level, log_format)
    try:
        return run(cfg)
    except CannotStart as e:  # as `nightshift collect` says it: one sentence, nothing left running
        print(logs.line(log_format, logging.ERROR, "nightshift", f"nightshift collect: {e}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
