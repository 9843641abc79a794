"""How every Nightshift process writes its log: text for a person at a terminal, or
one JSON object per line for a cluster's log pipeline.

A sidecar that ships stderr to Loki, Elasticsearch or Cloud Logging reads each line
as one record; a text traceback becomes a dozen records that belong to nothing, and
its fields are lost in a sentence. Here because every stage's processes set their
log up the same way, the collector's flusher included: a process of its own that
starts fresh and may not import the command line (settings/ is importable by all).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
import threading

from . import LOG_FORMAT_ENV, LOG_FORMATS

FORMATS = LOG_FORMATS
#: The variable a process's children read: whatever starts them (the collector's
#: flusher, a gate command that runs `nightshift ...`) writes the same format.
ENV = LOG_FORMAT_ENV
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: A LogRecord's own attributes: anything else on a record came from `extra=` and
#: is a structured field of that line.
_OWN = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def rfc3339(seconds: float) -> str:
    """UTC with milliseconds and a Z: what log stores parse without a format string."""
    t = dt.datetime.fromtimestamp(seconds, dt.timezone.utc)
    return t.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One line per record: time, level, logger, message, pid, the fields a call
    passed with `extra=`, and an exception as a field (type, message, traceback
    text) rather than lines of its own."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict = {"time": rfc3339(record.created), "level": record.levelname, "logger": record.name,
                     "message": record.getMessage(), "pid": record.process}
        for key, value in vars(record).items():
            if key not in _OWN and not key.startswith("_") and key not in out:
                out[key] = value
        if record.exc_info and record.exc_info[0] is not None:
            kind, exc, _ = record.exc_info
            out["exception"] = {"type": kind.__name__, "message": str(exc),
                                "traceback": self.formatException(record.exc_info)}
        elif record.exc_text:
            out["exception"] = {"traceback": record.exc_text}
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT)


def line(fmt: str, level: int, logger: str, message: str) -> str:
    """`message` as the line a log record of `logger` would be, for what a command
    says on stderr before (or without) its log being set up: its one-sentence
    refusal stays one record in a JSON pipeline."""
    if fmt != "json":
        return message
    record = logging.LogRecord(logger, level, "", 0, message, (), None)
    return JsonFormatter().format(record)


def current() -> str:
    """The format this process writes its log in: what `configure` set, else the
    environment's, else text. Handed to processes started fresh (spawn), which
    inherit no logging."""
    for h in logging.getLogger().handlers:
        if _is_ours(h):
            return "json" if isinstance(h.formatter, JsonFormatter) else "text"
    return os.environ.get(ENV) or "text"


def _is_ours(handler: logging.Handler) -> bool:
    return getattr(handler, "_nightshift", False)


def configure(level: int | str, fmt: str = "") -> None:
    """The root logger writes `fmt` (default: `NIGHTSHIFT_LOG_FORMAT`, else text) to
    stderr at `level`. Called again, it changes the level and format it set; a root
    logger someone else configured (a test runner, an application embedding us) is
    left alone, as `logging.basicConfig` would. With json, warnings and uncaught
    exceptions are log records too, and the format is exported to child processes."""
    fmt = fmt or os.environ.get(ENV) or "text"
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    root = logging.getLogger()
    ours = [h for h in root.handlers if _is_ours(h)]
    if root.handlers and not ours:
        return
    if not ours:
        handler = logging.StreamHandler(sys.stderr)
        handler._nightshift = True  # type: ignore[attr-defined]
        root.addHandler(handler)
        ours = [handler]
    for h in ours:
        h.setFormatter(formatter(fmt))
    root.setLevel(level)
    if fmt == "json" or ENV in os.environ:
        os.environ[ENV] = fmt
    if fmt == "json":
        # progress bars redraw one terminal line with carriage returns: in a log
        # pipeline each redraw is a line that is not JSON (tqdm reads TQDM_* as its
        # defaults; Hugging Face's bars go through tqdm and their own switch)
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback, a.thread)


def adopt_transformers() -> None:
    """transformers writes its warnings through a stderr handler of its own that
    does not propagate: handed to the root logger instead, they come out in our
    format. Called by the commands that load transformers anyway (it costs a
    second to import, which the collector and the proxy should not pay)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def _log_uncaught(kind, exc, tb, thread=None) -> None:
    """An exception nothing caught, as one record (a crash is a line a pipeline can
    alert on, not a traceback spread over twenty)."""
    if kind is not None and issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    where = f" in thread {thread.name}" if thread is not None else ""
    logging.getLogger("nightshift").critical("uncaught %s%s: %s", getattr(kind, "__name__", kind), where, exc,
                                             exc_info=(kind, exc, tb))
