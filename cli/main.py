"""The `nightshift` command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from nightshift.settings import SettingsError, add_flags, check_sections, flag_names, flags_of, load

from .console import setup_logging

EPILOG = """Settings come from, lowest first: built-in defaults, the YAML file given with
--config (top-level `data:` and a `collector:` section), NIGHTSHIFT_* environment
variables (NIGHTSHIFT_DATA, NIGHTSHIFT_COLLECTOR_TOKEN, ...), then flags.
Agents send to OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 (gRPC) or
http://127.0.0.1:4318 with OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, through an
instrumentation that records their LLM calls, with its content switch on, e.g.:
  pip install opentelemetry-distro opentelemetry-exporter-otlp opentelemetry-instrumentation-openai-v2
  OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY opentelemetry-instrument python agent.py
(OpenInference, OpenLLMetry, OpenLIT and frameworks' own spans are read too).
`nightshift doctor` says what arrived and what is missing."""


#: The YAML file's top-level keys: the shared `data:`, and the section of each stage
#: that reads the file (`load(Config, "<section>", args.config, ...)` in the
#: commands). A key not here is a typo, refused before any command runs, never
#: silently ignored with everything under it. The publish settings are the nightly
#: job's (`nightly:`), so `publish:` is not one.
SECTIONS = ("data", "collector", "transform", "train", "nightly", "serve", "route", "apo")


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
    setup_logging(cfg.log_level)
    from nightshift.collector.server import CannotStart, run

    try:
        return run(cfg)
    except CannotStart as e:  # a busy port, a WAL another collector holds: nothing was left running
        print(f"nightshift collect: {e}", file=sys.stderr)
        return 2


def cmd_ingest(args: argparse.Namespace) -> int:
    cfg = _collector_config(args)
    setup_logging(cfg.log_level)
    from nightshift.collector.datasets import DatasetStore
    from nightshift.collector.fileingest import ingest
    from nightshift.collector.redact import Redactor

    store = DatasetStore(cfg.data, cfg.storage_options)
    redactor = Redactor.from_config(cfg.redact.presets, cfg.redact.rules, cfg.redact.drop_keys)
    try:
        st = ingest(args.files, store, redactor, progress=not args.quiet and sys.stderr.isatty())
    except FileNotFoundError as e:
        print(f"nightshift ingest: {e}", file=sys.stderr)
        return 2
    for note in st.notes:
        print(f"note: {note}", file=sys.stderr)
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
    setup_logging(cfg.log_level)
    from nightshift.collector.datasets import DatasetStore
    from nightshift.collector.feedback_file import BadRows, FeedbackFileError, load
    from nightshift.collector.redact import Redactor

    if not args.name:
        print("nightshift feedback: --name must not be empty", file=sys.stderr)
        return 2
    redactor = Redactor.from_config(cfg.redact.presets, cfg.redact.rules, cfg.redact.drop_keys)
    redact = (lambda text: redactor.redact_text(text)[0]) if redactor.enabled else None
    try:
        st = load(args.files, DatasetStore(cfg.data, cfg.storage_options), args.name, args.skip_bad, redact)
    except FeedbackFileError as e:
        print(f"nightshift feedback: {e}; nothing written", file=sys.stderr)
        return 2
    except BadRows as e:
        for problem in e.problems:
            print(f"bad row: {problem}", file=sys.stderr)
        print(f"nightshift feedback: {len(e.problems)} bad row(s); nothing written "
              "(fix them, or --skip-bad to write the rest)", file=sys.stderr)
        return 1
    for problem in st.skipped_rows:
        print(f"skipped: {problem}", file=sys.stderr)
    print(f"feedback: {st.files} file(s) into {cfg.data}: {st.written} rows written, "
          f"{st.duplicates} duplicates, {st.skipped} skipped")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    import polars as pl

    data = _collector_config(args).data
    pattern = f"{data.rstrip('/')}/spans/**/*.parquet"
    try:
        lf = pl.scan_parquet(pattern, hive_partitioning=True)
        summary = (
            lf.group_by("date", "service_name", "gen_ai_operation_name", "gen_ai_request_model")
            .agg(pl.len().alias("spans"), pl.col("trace_id").n_unique().alias("traces"))
            .sort("date", "spans", descending=[False, True])
            .collect()
        )
    except (FileNotFoundError, pl.exceptions.ComputeError) as e:
        print(f"no spans under {data} yet ({e.__class__.__name__})", file=sys.stderr)
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

    def common(sp: argparse.ArgumentParser, cls: type | None = None, section: str = "", only: tuple[str, ...] = ()) -> None:
        """--config, then the flags of `cls`'s declared settings (all, or `only`
        these), and --log-level; without `cls`, a plain --data."""
        sp.add_argument("--config", metavar="FILE", help="YAML settings file")
        if cls is None:
            sp.add_argument("--data", metavar="DIR|URL", help="dataset root: a folder or fsspec URL (default ./nightshift-data)")
        else:
            add_flags(sp, cls, section=section, only=only)
            if not only:  # every setting is a flag: a usage line listing them all would hide the command
                sp.usage = "%(prog)s [--config FILE] [--SETTING VALUE ...] [options]"
        if "log_level" not in [p for p in (flag_names(cls) if cls else ()) if not only or p in only]:
            sp.add_argument("--log-level", dest="log_level", metavar="LEVEL", help="debug, info, warning, error")

    from nightshift.collector.config import CollectorConfig

    collector_only = ("data", "log_level")  # ingest, feedback, show: where the data is; YAML/env for the rest

    c = sub.add_parser(
        "collect", help="run the OTLP receiver (gRPC :4317, HTTP :4318) that writes span datasets",
        description="Receive OTLP traces, logs and metrics over gRPC and HTTP (protobuf or JSON, gzip/deflate/zstd), "
        "acknowledge each request only once it is fsync'd to a write-ahead log, and write spans/ and logs/ Parquet "
        "datasets under --data. POST /v1/feedback takes delayed rewards as JSON (see `nightshift feedback --help` "
        "for the fields) into feedback/. GET /healthz and /metrics on the HTTP port. SIGTERM drains and exits 0.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(c, CollectorConfig, "collector")
    c.set_defaults(func=cmd_collect)

    i = sub.add_parser(
        "ingest", help="load files written by an OpenTelemetry Collector's fileexporter",
        description="Load OTLP/JSON lines or length-prefixed protobuf (optionally zstd) written by the "
        "OpenTelemetry Collector's fileexporter, rotated backups included, into the same datasets, deduplicated.",
    )
    common(i, CollectorConfig, "collector", collector_only)
    i.add_argument("files", nargs="+", metavar="FILE", help="files, globs or folders")
    i.add_argument("--quiet", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    i.set_defaults(func=cmd_ingest)

    f = sub.add_parser(
        "feedback", help="load delayed rewards (labels) from CSV, Parquet or JSON lines",
        description="Load rewards that arrived after the agent's run (ratings, task outcomes, reviews) into the "
        "feedback dataset, joined to trajectories later by trace_id or conversation_id.",
        epilog=FEEDBACK_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common(f, CollectorConfig, "collector", collector_only)
    f.add_argument("files", nargs="+", metavar="FILE", help="label files: .csv, .parquet, .jsonl")
    f.add_argument("--name", default="feedback", help="label name for rows without one (default: feedback)")
    f.add_argument("--skip-bad", dest="skip_bad", action="store_true",
                   help="write the good rows of files with bad rows, and list the bad ones")
    f.set_defaults(func=cmd_feedback)

    s = sub.add_parser("show", help="summarize the spans dataset with Polars")
    common(s, CollectorConfig, "collector", collector_only)
    s.add_argument("--rows", type=int, default=20, help="rows to print (default 20)")
    s.set_defaults(func=cmd_show)

    from .build_cmd import add_build

    add_build(sub, common)
    from .doctor_cmd import add_doctor

    add_doctor(sub, common)
    from .export_cmd import add_export

    add_export(sub, common)
    from .train_cmd import add_train

    add_train(sub, common)
    from .serve_cmd import add_serve

    add_serve(sub, common)
    from .route_cmd import add_route

    add_route(sub)
    from .publish_cmd import add_publish

    add_publish(sub, common)
    from .prompts_cmd import add_prompts

    add_prompts(sub, common)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "config", None):
            check_sections(args.config, SECTIONS)
        return args.func(args)
    except SettingsError as e:
        print(f"nightshift: configuration error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
