"""The `nightshift` command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

import logging

from nightshift.settings import (LOG_FORMAT_ENV, LOG_FORMATS, SettingsError, add_flags, check_sections, flag_names,
                                 flags_of, load, log_format, notes)

from .console import log_format_flag, say, setup_logging
from .helptext import epilog

AGENTS = """Agents send to OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 (gRPC) or
http://127.0.0.1:4318 with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, through an
instrumentation that records their LLM calls, with its content switch on, e.g.:
  pip install opentelemetry-distro opentelemetry-exporter-otlp \
    opentelemetry-instrumentation-openai-v2 opentelemetry-util-genai==1.1b0
  OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY opentelemetry-instrument python agent.py
(OpenInference, OpenLLMetry, OpenLIT and frameworks' own spans are read too).
`nightshift doctor` says what arrived and what is missing."""

EPILOG = """Settings come from, lowest first: built-in defaults, the YAML file given with
--config (top-level `data:` and `log_format:`, and one section per stage),
NIGHTSHIFT_* environment variables (NIGHTSHIFT_DATA, NIGHTSHIFT_COLLECTOR_TOKEN,
NIGHTSHIFT_LOG_FORMAT, ...), then flags. `nightshift COMMAND --help` ends with
the command's YAML section, its variables and its exit codes.
""" + AGENTS

#: Where the collector's commands read their settings (`helptext.tail`'s first two).
COLLECTOR_SETTINGS = ("the `collector:` section and top-level `data:`", "NIGHTSHIFT_COLLECTOR_*, NIGHTSHIFT_DATA")


#: The YAML file's top-level keys: the shared `data:` and `log_format:`, and the
#: section of each stage that reads the file (`load(Config, "<section>", args.config,
#: ...)` in the commands). A key not here is a typo, refused before any command
#: runs, never silently ignored with everything under it. The publish settings are
#: the nightly job's (`nightly:`), so `publish:` is not one.
SECTIONS = ("data", "log_format", "collector", "transform", "retention", "compaction", "train", "publish", "nightly",
            "serve", "route", "apo")


#: The distribution's name on the package index (`nightshift` there is another project).
DISTRIBUTION = "nightshift-rl"


def _version() -> str:
    """This install's version: `nightshift-rl`, or an install from before the rename
    (the name `nightshift`, but only when it is this project: its script is ours)."""
    from importlib.metadata import distribution

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    try:
        old = distribution("nightshift")
    except PackageNotFoundError:
        return "dev"
    ours = any(e.value == "nightshift.cli.main:main" for e in old.entry_points)
    return old.version if ours else "dev"


def _collector_config(args: argparse.Namespace):
    from nightshift.collector.config import CollectorConfig

    return load(CollectorConfig, "collector", args.config, flags_of(CollectorConfig, args))


def cmd_collect(args: argparse.Namespace) -> int:
    cfg = _collector_config(args)
    setup_logging(cfg.log_level, args.log_format)
    from nightshift.collector.server import CannotStart, run

    try:
        return run(cfg)
    except CannotStart as e:  # a busy port, a WAL another collector holds: nothing was left running
        say(f"nightshift collect: {e}", args.log_format)
        return 2


def cmd_ingest(args: argparse.Namespace) -> int:
    cfg = _collector_config(args)
    setup_logging(cfg.log_level, args.log_format)
    from nightshift.collector.datasets import DatasetStore
    from nightshift.collector.fileingest import ingest
    from nightshift.collector.redact import Redactor

    store = DatasetStore(cfg.data, cfg.storage_options)
    redactor = Redactor.from_config(cfg.redact.presets, cfg.redact.rules, cfg.redact.drop_keys)
    try:
        st = ingest(args.files, store, redactor, progress=not args.quiet and sys.stderr.isatty())
    except FileNotFoundError as e:
        say(f"nightshift ingest: {e}", args.log_format)
        return 2
    for note in st.notes:
        say(f"note: {note}", args.log_format, logging.INFO)
    print(
        f"ingested {st.files} file(s) into {cfg.data}: {st.spans} spans, {st.logs} log records written; "
        f"{st.duplicates} already stored; {st.rejected} invalid records rejected; {st.bad_records} unreadable; "
        f"{st.skipped_metrics} metric batches skipped"
    )
    return 1 if st.bad_records and not (st.spans or st.logs) else 0


FEEDBACK_HELP = """Columns (a CSV header, Parquet column names, or JSON-lines keys):
  value            required: a finite number; true/false count as 1.0/0.0
  trace_id         32 hex digits (stored lowercase)       } at least one of
  conversation_id  the agent's gen_ai.conversation.id     } these two
  name             what the label measures, e.g. user_rating (default: --name)
  span_id          16 hex digits: the one call the label is about
  comment          free text (redacted like span attributes)
  time             when the label was given: RFC 3339 with an offset
                   (2025-11-22T10:15:00Z) or unix seconds
  id               your idempotency key; without it, a hash of the row's content

Any other column is refused, so a typo (`reward` for `value`) cannot vanish.
Every file is checked before anything is written: a missing or unknown column
exits 2; bad rows are all listed (CSV and JSON lines by line, Parquet by row, from
1) and nothing is written unless --skip-bad. Rows land in <data>/feedback/,
partitioned by the UTC date they were loaded, source `file:<name>`. Loading the
same file again adds nothing, and a label id already stored is not stored twice.
The same rules apply to the collector's POST /v1/feedback."""


def cmd_feedback(args: argparse.Namespace) -> int:
    cfg = _collector_config(args)
    setup_logging(cfg.log_level, args.log_format)
    from nightshift.collector.datasets import DatasetStore
    from nightshift.collector.feedback_file import BadRows, FeedbackFileError, load
    from nightshift.collector.redact import Redactor

    if not args.name:
        say("nightshift feedback: --name must not be empty", args.log_format)
        return 2
    redactor = Redactor.from_config(cfg.redact.presets, cfg.redact.rules, cfg.redact.drop_keys)
    redact = (lambda text: redactor.redact_text(text)[0]) if redactor.enabled else None
    try:
        st = load(args.files, DatasetStore(cfg.data, cfg.storage_options), args.name, args.skip_bad, redact)
    except FeedbackFileError as e:
        say(f"nightshift feedback: {e}; nothing written", args.log_format)
        return 2
    except BadRows as e:
        for problem in e.problems:
            say(f"bad row: {problem}", args.log_format)
        say(f"nightshift feedback: {len(e.problems)} bad row(s); nothing written "
            "(fix them, or --skip-bad to write the rest)", args.log_format)
        return 1
    for problem in st.skipped_rows:
        say(f"skipped: {problem}", args.log_format, logging.WARNING)
    print(f"feedback: {st.files} file(s) into {cfg.data}: {st.written} rows written, "
          f"{st.duplicates} duplicates, {st.skipped} skipped")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import polars as pl

    data = _collector_config(args).data
    from nightshift.schemas import layout

    pattern = layout.files(data, layout.SPANS)
    try:
        # a span stored twice (a retry past the collector's duplicate check, a compaction
        # stopped part way) is one span, as the build counts it
        lf = pl.scan_parquet(pattern, hive_partitioning=True).unique(["trace_id", "span_id"], keep="any")
        summary = (
            lf.group_by("date", "service_name", "gen_ai_operation_name", "gen_ai_request_model")
            .agg(pl.len().alias("spans"), pl.col("trace_id").n_unique().alias("traces"))
            .sort("date", "spans", descending=[False, True])
            .collect()
        )
    except (FileNotFoundError, pl.exceptions.ComputeError) as e:
        say(f"no spans under {data} yet ({e.__class__.__name__})", args.log_format)
        return 1
    with pl.Config(tbl_rows=args.rows, tbl_cols=-1, fmt_str_lengths=40, tbl_width_chars=160):
        # the per-group counts overlap (a trace has agent spans and call spans): count the traces once
        traces = lf.select(pl.col("trace_id").n_unique()).collect().item()
        print(f"spans under {data}: {summary['spans'].sum()} in {traces} trace(s)")
        print(summary)
        latest = (
            lf.sort("start_time", descending=True).head(args.rows)
            .select("start_time", "service_name", "name", "kind", "status_code", "trace_id", "span_id")
            .collect()
        )
        print(latest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nightshift",
        description="Turn the OpenTelemetry traces your LLM agents already emit into better models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"nightshift {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    common = common_flags

    from nightshift.collector.config import CollectorConfig

    collector_only = ("data", "log_level")  # ingest, feedback, show: where the data is; YAML/env for the rest

    c = sub.add_parser(
        "collect", help="run the OTLP receiver (gRPC :4317, HTTP :4318) that writes span datasets",
        description="Receive OTLP traces, logs and metrics over gRPC and HTTP (protobuf or JSON, gzip/deflate/zstd), "
        "acknowledge each request only once it is fsync'd to a write-ahead log, and write spans/ and logs/ Parquet "
        "datasets under --data. POST /v1/feedback takes delayed rewards as JSON (see `nightshift feedback --help` "
        "for the fields) into feedback/. GET /healthz and /metrics on the HTTP port. SIGTERM drains and exits 0.",
        epilog=epilog(AGENTS, *COLLECTOR_SETTINGS, "0 stopped by SIGTERM or SIGINT after draining to Parquet, 2 bad "
                      "settings or it cannot start (a busy port, a write-ahead log another collector holds, "
                      "unreadable TLS files: one sentence, nothing left running)"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(c, CollectorConfig, "collector")
    c.set_defaults(func=cmd_collect)

    i = sub.add_parser(
        "ingest", help="load files written by an OpenTelemetry Collector's fileexporter",
        description="Load OTLP/JSON lines or length-prefixed protobuf (optionally zstd) written by the "
        "OpenTelemetry Collector's fileexporter, rotated backups included, into the same datasets, deduplicated.",
        epilog=epilog("", *COLLECTOR_SETTINGS, "0 ingested (records already stored count as done), 1 nothing "
                      "readable in any file, 2 a file not found or bad settings"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(i, CollectorConfig, "collector", collector_only)
    i.add_argument("files", nargs="+", metavar="FILE", help="files, globs or folders")
    i.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    i.set_defaults(func=cmd_ingest)

    f = sub.add_parser(
        "feedback", help="load delayed rewards (labels) from CSV, Parquet or JSON lines",
        description="Load rewards that arrived after the agent's run (ratings, task outcomes, reviews) into the "
        "feedback dataset, joined to trajectories later by trace_id or conversation_id.",
        epilog=epilog(FEEDBACK_HELP, *COLLECTOR_SETTINGS, "0 written, 1 bad rows (listed; nothing written "
                      "without --skip-bad), 2 a file or column that cannot be used, or bad settings"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(f, CollectorConfig, "collector", collector_only)
    f.add_argument("files", nargs="+", metavar="FILE", help="label files: .csv, .parquet, .jsonl")
    f.add_argument("--name", default="feedback", help="label name for rows without one (default: feedback)")
    f.add_argument("--skip-bad", dest="skip_bad", action="store_true",
                   help="write the good rows of files with bad rows, and list the bad ones")
    f.set_defaults(func=cmd_feedback)

    s = sub.add_parser("show", help="summarize the spans dataset with Polars",
                       description="Count the stored spans per date, service, operation and model, and list the "
                       "latest.", epilog=epilog("", *COLLECTOR_SETTINGS, "0 shown, 1 no spans yet, 2 bad settings"),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(s, CollectorConfig, "collector", collector_only)
    s.add_argument("--rows", type=int, default=20, help="rows to print (default 20)")
    s.set_defaults(func=cmd_show)

    from .build_cmd import add_build, add_compact, add_prune

    add_build(sub, common)
    add_prune(sub, common)
    add_compact(sub, common)
    from .doctor_cmd import add_doctor

    add_doctor(sub, common)
    from .export_cmd import add_export

    add_export(sub, common)
    from .train_cmd import add_train

    add_train(sub, common)
    from .serve_cmd import add_serve

    add_serve(sub, common)
    from .route_cmd import add_route

    add_route(sub, common)
    from .publish_cmd import add_publish

    add_publish(sub, common)
    from .prompts_cmd import add_prompts

    add_prompts(sub, common)
    return p


def common_flags(sp: argparse.ArgumentParser, cls: type | None = None, section: str = "",
                 only: tuple[str, ...] = (), data: bool = True) -> None:
    """--config, then the flags of `cls`'s declared settings (all, or `only`
    these), --log-level and --log-format; without `cls`, a plain --data (unless
    `data` is false: a command that reads no dataset)."""
    sp.add_argument("--config", metavar="FILE", help="YAML settings file (the same file for every command)")
    if cls is None:
        if data:
            sp.add_argument("--data", metavar="DIR|URL", help="dataset root: a folder or fsspec URL (default "
                            "./nightshift-data)")
    else:
        add_flags(sp, cls, section=section, only=only)
        if not only:  # every setting is a flag: a usage line listing them all would hide the command
            sp.usage = "%(prog)s [--config FILE] [--SETTING VALUE ...] [options]"
    if "log_level" not in [p for p in (flag_names(cls) if cls else ()) if not only or p in only]:
        sp.add_argument("--log-level", dest="log_level", metavar="LEVEL", help="debug, info, warning, error")
    log_format_flag(sp)


def _format_at_once(args: argparse.Namespace) -> str:
    """The log format from the flag or the environment, for what is said before the
    settings file is read (or when it cannot be): never raises."""
    import os

    for value in (getattr(args, "log_format", None), os.environ.get(LOG_FORMAT_ENV)):
        if value and str(value).strip().lower() in LOG_FORMATS:
            return str(value).strip().lower()
    return "text"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    fmt = _format_at_once(args)
    try:
        config = getattr(args, "config", None)
        if config:
            check_sections(config, SECTIONS)
        fmt = args.log_format = log_format(config, getattr(args, "log_format", None))
        for note in notes(args):
            say(f"nightshift: {note}", fmt, logging.WARNING)
        return args.func(args)
    except SettingsError as e:
        say(f"nightshift: configuration error: {e}", fmt)
        return 2


if __name__ == "__main__":
    sys.exit(main())
