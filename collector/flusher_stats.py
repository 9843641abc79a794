"""What the receiver shares with its flusher process: the layout of the shared
counters."""

from __future__ import annotations

# Indices into the shared stats array.
SPANS, LOGS, DUPLICATES, SEGMENTS, ERRORS, LAST_FLUSH_S, OLDEST_PENDING_NS, FEEDBACK, FLUSH_STARTED_S = range(9)
NSTATS = 9  # FLUSH_STARTED_S: wall time the segment being flushed was started, 0 when idle

