"""What the sidecar's flusher costs (issue 28 item 6): its allocator, the codec
it writes with. Sizes and speeds are measured by benchmarks/ingest.py; here only
that each choice takes effect."""

from __future__ import annotations

import os
import subprocess
import sys

from nightshift.collector import flusher_process


def _backend(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", "import pyarrow as pa; print(pa.default_memory_pool().backend_name)"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_the_flusher_allocates_arrow_memory_with_jemalloc_unless_the_operator_chose():
    """pyarrow's default (mimalloc) kept 20-25 MiB more of a flush's freed memory."""
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    assert _backend(flusher_process.child_environment(env)) == "jemalloc"
    assert _backend(flusher_process.child_environment({**env, "ARROW_DEFAULT_MEMORY_POOL": "system"})) == "system"


def test_a_running_collectors_flusher_starts_with_that_allocator(collector):
    pid = collector.health()["flusher_pid"]
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert b"ARROW_DEFAULT_MEMORY_POOL=jemalloc" in environ
    assert collector.stop() == 0
