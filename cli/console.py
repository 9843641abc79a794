"""How every command talks to the terminal: its log on stderr, as text or as JSON
lines (`--log-format`, NIGHTSHIFT_LOG_FORMAT, top-level `log_format:`), so a
command's own output (summaries, tables) stays alone on stdout for scripts, and
a cluster's log pipeline reads each stderr line as one record."""

from __future__ import annotations

import argparse
import logging
import sys

from nightshift.settings import LOG_FORMAT_ENV, LOG_FORMATS, logs


def setup_logging(level: str, fmt: str = "") -> None:
    """The log at `level` in `fmt` (text or json; default NIGHTSHIFT_LOG_FORMAT, else
    text); exported to the processes this one starts."""
    logs.configure(level, fmt)


def log_format_flag(parser: argparse.ArgumentParser, **kw) -> None:
    """--log-format, on every command (`kw`: e.g. a default of SUPPRESS)."""
    parser.add_argument("--log-format", dest="log_format", metavar="{" + ",".join(LOG_FORMATS) + "}",
                        help=f"the log on stderr as text or as one JSON object per line (default: {LOG_FORMAT_ENV}, "
                             "else the YAML's top-level log_format, else text)", **kw)


def adopt_libraries(fmt: str) -> None:
    """In JSON, the log records of the libraries a command loads (transformers) come
    out as ours; in text they keep their own look."""
    if (fmt or logs.current()) == "json":
        logs.adopt_transformers()


def say(message: str, fmt: str = "", level: int = logging.ERROR) -> None:
    """A command's one sentence on stderr (a refusal, a deprecated flag): as written
    in text, and as a record of the `nightshift` logger in JSON, so it is one line
    of the same kind as the log's."""
    print(logs.line(fmt or "text", level, "nightshift", message), file=sys.stderr)
