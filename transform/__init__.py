"""Transform: traces to credit-assigned transition datasets (`nightshift build`).

spans/ (+ logs/, feedback/) -> `build` reads whole traces by bucket ->
`calls` (which spans are LLM calls, agents, reward carriers; one record per call,
read by the layout readers of `conventions` into the `messages` shape) ->
trajectories -> `rewards` -> `credit` (assignment and advantages) -> `output`
(one date partition at a time, replaced whole). Settings: `config`.
"""

import os
import sys

#: What `nightshift` sets for every command before Polars loads (cli/__init__.py): freed
#: pages handed back to the kernel at once, so a collector never holds its peak.
_AT_ONCE = "background_thread:true,dirty_decay_ms:0,muzzy_decay_ms:0"
# A build frees and reallocates each bucket's buffers all the time, and with pages
# given back at once it faulted every one in again: a third of its CPU was the
# kernel's (100k spans: 4.3-4.9 of 11-12 CPU-s sys, 1.6M page faults). Freed pages
# kept five seconds (jemalloc reuses them for the next bucket, then returns them):
# 1.8-2.2 sys, 0.57-0.60M faults, peak RSS 608 -> 624 MB. Only where Polars is not
# loaded yet (it reads this once), and never over a setting of the user's own.
if "polars" not in sys.modules and os.environ.get("_RJEM_MALLOC_CONF", _AT_ONCE) == _AT_ONCE:
    os.environ["_RJEM_MALLOC_CONF"] = "background_thread:true,dirty_decay_ms:5000,muzzy_decay_ms:0"
