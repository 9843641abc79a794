"""What the receiver shares with its flusher process: the layout of the shared
counters, and an entry point that imports the (heavy: pyarrow, polars) flusher
only inside the child, so the receiver process stays small."""

from __future__ import annotations

# Indices into the shared stats array.
SPANS, LOGS, DUPLICATES, SEGMENTS, ERRORS, LAST_FLUSH_S, OLDEST_PENDING_NS, FEEDBACK = range(8)
NSTATS = 8


def run_flusher(*args, **kwargs) -> None:
    from .flusher import run

    run(*args, **kwargs)
