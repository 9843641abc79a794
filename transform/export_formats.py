"""The export's formats and tool-argument styles, apart from the export itself:
the `nightshift` command builds every subcommand's parser, and reading these
from transform/export.py loaded pyarrow, fsspec and numpy into every command,
the route's proxy included (41 -> 87 MiB idle)."""

from __future__ import annotations

FORMATS = ("messages", "prompt_completion")
ARGUMENTS = ("object", "text")
