"""`nightshift doctor`: what the last hours of spans would become, and what to change."""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.error
import urllib.request

from nightshift.settings import flags_of, load

from .build_cmd import TRANSFORM_SETTINGS
from .helptext import epilog

DESCRIPTION = """Read the spans of the last hours (the traces that received a span in the
window, whole) with the build's own rules and say, per service and agent: which
instrumentation made the calls, whether their messages were captured, which agents
are named, whether a reward reaches them (span attributes, feedback, your reward
functions), how many calls would become rows if `nightshift build` ran now, and
why the others would not. Each finding names the exact environment variable, flag
or setting that fixes it. It takes the build's settings (--config, transform:),
so it judges what your build would do.

With --collector URL (a running collector's HTTP address), it also says what the
collector holds in its write-ahead log and has not written to Parquet yet (the
doctor reads Parquet), and which requests it refused, and why."""

EPILOG = """--json prints the report as one JSON object (services, agents, findings, ok)."""
EXITS = "0 the data would build rewarded transitions with content now, 1 it would not (the findings say why), 2 bad settings"

#: Settings the doctor reads: where the data is and what the build does with it.
SETTINGS = ("data", "trajectory", "group_by", "settle", "agents_include", "agents_exclude", "storage_options",
            "reward.name", "reward.keys", "reward.functions", "reward.prefer", "reward.default")

#: A refused request's reason (collector/errors.py) -> what the agent should change.
REFUSAL_FIXES = {
    "unauthenticated": "send the collector's token: OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token> "
                       "(the value is URL-encoded)",
    "too_large": "smaller batches (OTEL_BSP_MAX_EXPORT_BATCH_SIZE=128) or a larger collector.max_request_bytes",
    "unsupported_media_type": "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf (or grpc, to port 4317)",
    "not_found": "OTEL_EXPORTER_OTLP_ENDPOINT is the base address (http://host:4318), without /v1/traces",
    "overloaded": "the collector's WAL is full or the flusher behind: see its log and /healthz",
    "throttled": "one agent sends more than its share: see collector.fairness settings",
    "timeout": "the WAL's fsync was slow: see the collector's log",
}


def add_doctor(sub, common) -> None:
    from nightshift.transform.config import TransformConfig

    d = sub.add_parser("doctor", help="say what the stored spans would become, and the setting that fixes each gap",
                       description=DESCRIPTION, epilog=epilog(EPILOG, *TRANSFORM_SETTINGS, EXITS),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(d, TransformConfig, "transform", SETTINGS)
    d.add_argument("--hours", type=float, default=24.0, metavar="H",
                   help="look at traces that received a span in the last H hours (default 24; 0: everything)")
    d.add_argument("--max-traces", type=int, default=2000, metavar="N",
                   help="look at a random sample of N of the window's traces when it holds more (default 2000; "
                        "0: all): proportions, without a day of prompts in memory")
    d.add_argument("--collector", metavar="URL", help="a running collector's HTTP address, e.g. http://127.0.0.1:4318")
    d.add_argument("--json", action="store_true", help="the report as JSON")
    d.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from nightshift.transform import doctor, recent
    from nightshift.transform.config import TransformConfig

    from .console import say, setup_logging

    cfg = load(TransformConfig, "transform", args.config, flags_of(TransformConfig, args))
    setup_logging(args.log_level or "warning", args.log_format)
    if args.hours < 0 or args.max_traces < 0:
        say("nightshift doctor: --hours and --max-traces must be 0 (everything) or more", args.log_format)
        return 2
    now = time.time_ns()
    window = recent.read(cfg.data, args.hours, now, cfg.storage_options, args.max_traces)
    span = f"the last {args.hours:g} h" if args.hours else "all time"
    n = window.spans["trace_id"].n_unique() if window.spans.height else 0
    sample = f", a random sample of {n} of its {window.traces} traces" if n < window.traces else ""
    try:
        report = doctor.diagnose(window.spans, window.logs, window.feedback, cfg, now,
                                 f"{cfg.data}, traces active in {span}{sample} (clock {doctor.clock(now)})",
                                 now - int(args.hours * 3600e9) if args.hours else None)
    except ValueError as e:  # a reward function that cannot be loaded
        say(f"nightshift doctor: {e}", args.log_format)
        return 2
    for what in window.unreadable[:10]:
        report.add("warning", "data", f"unreadable, left out: {what}", "a torn or foreign file in a dataset folder",
                   "move it out of the dataset folder (`nightshift build` skips it too)")
    if args.collector:
        collector_findings(report, args.collector)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1, default=str))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def collector_findings(report, url: str) -> None:
    """What a running collector holds that Parquet does not show yet, and what it refused."""
    scope = f"collector {url}"
    try:
        m = _metrics(url)
    except (urllib.error.URLError, OSError, ValueError) as e:
        report.add("warning", scope, f"cannot read {url.rstrip('/')}/metrics ({getattr(e, 'reason', e)})",
                   "the doctor could not ask the collector what it holds",
                   "--collector is the collector's HTTP address (collector.http, default http://127.0.0.1:4318)")
        return
    # the active segment always holds its 8-byte header (collector.wal.MAGIC), records or not:
    # an idle collector that has flushed everything reports exactly that much
    from nightshift.collector.wal import MAGIC

    wal = max(m.get("nightshift_wal_bytes", 0.0) - len(MAGIC), 0.0)
    lag = m.get("nightshift_flush_lag_seconds", 0.0)
    if wal > 0:
        behind = lag > 300 or m.get("nightshift_flush_errors", 0.0) > 0
        report.add("warning" if behind else "info", scope,
                   f"{int(wal)} bytes of spans and logs in its write-ahead log, not in Parquet yet (oldest {lag:.0f} s)",
                   "the flusher writes them every flush interval; the doctor and the build read Parquet only"
                   + (f"; {int(m.get('nightshift_flush_errors', 0))} flushes failed" if behind else ""),
                   "see the collector's log for flush errors" if behind else
                   "run the doctor again after the next flush, or stop the collector (SIGTERM flushes everything)",
                   int(wal))
    refused: dict[str, float] = {}
    for key, n in m.items():
        if key.startswith("nightshift_refused_requests_total{") and n > 0:
            reason = dict(re.findall(r'(\w+)="([^"]*)"', key)).get("reason", "refused")
            refused[reason] = refused.get(reason, 0.0) + n
    for reason, n in sorted(refused.items()):
        report.add("warning", scope, f"{int(n)} requests refused whole ({reason})",
                   "their spans never reached the write-ahead log; the agents' exporters log the refusals",
                   REFUSAL_FIXES.get(reason, "see the collector's log"), int(n))
    rejected = sum(v for k, v in m.items() if k.startswith("nightshift_rejected_total"))
    if rejected:
        report.add("warning", scope, f"{int(rejected)} records refused one by one (invalid ids or values)",
                   "OTLP partial success: the rest of each request was stored", "see the collector's log", int(rejected))
