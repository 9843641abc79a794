"""The `nightshift` command line.

Allocator settings come first, before Polars or Arrow is imported: both keep freed
pages for reuse by default (jemalloc for ten seconds, mimalloc indefinitely), so a
build that reads bucket after bucket would keep the high-water mark of all of them
and a long-running collector would hold its peak. Returned at once here; a user's
own setting of either variable wins.
"""

import os

os.environ.setdefault("_RJEM_MALLOC_CONF", "background_thread:true,dirty_decay_ms:0,muzzy_decay_ms:0")  # Polars
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
