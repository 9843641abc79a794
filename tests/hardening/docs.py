"""Writes the campaigns' figures into docs/RELIABILITY.md, each campaign into its
own marked section (`<!-- BEGIN name -->` .. `<!-- END name -->`), so a rerun of
one campaign replaces its own figures and leaves the rest of the page alone."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md"


def stamp(command: str) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=DOC.parent.parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"],
                               capture_output=True, text=True, cwd=DOC.parent.parent).stdout.strip()  # this page aside
    except OSError:
        commit, dirty = "?", ""
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"_{when}, commit {commit}{' + local changes' if dirty else ''}, {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, {platform.system()}: `{command}`_")


def write_section(name: str, text: str) -> None:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    page = DOC.read_text() if DOC.exists() else "# Reliability and security, measured\n"
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in page and end in page:
        head, rest = page.split(begin, 1)
        page = head + block + rest.split(end, 1)[1]
    else:
        page = page.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(page)
    print(f"wrote the {name} section of {DOC}", file=sys.stderr)


def _table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| figure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def fuzz_section(summary: dict, args) -> str:
    s = summary["in_process"]
    rows = [
        ("cases", f"{s['cases']:,} through the HTTP handler, {s['grpc_cases']:,} of them also through the gRPC handler"),
        ("time", f"{s['wall_s']:.0f} s on {s['jobs']} process(es), {s['cases'] / max(s['wall_s'], 1e-9):,.0f} cases/s"),
        ("crashes (500, INTERNAL, an exception)", str(s["crashes"])),
        ("a status code other than the spec's", str(s["wrong_code"])),
        ("a partial-success count other than the records broken", str(s["wrong_rejected"])),
        ("hangs (over the per-case limit)", f"{s['hangs']} (slowest case {s['slowest_s'] * 1000:.0f} ms, {s['slowest_kind']})"),
        ("records acknowledged / read back by the flusher", f"{s['acknowledged']:,} / {s['flushed']:,} (lost {s['lost']})"),
        ("poison records (acknowledged, then the flusher failed on them)", str(s["flush_errors"])),
        ("memory, worst worker, first chunk to last", f"{s['rss_growth_mib']:+.1f} MiB RSS"),
    ]
    out = [stamp(f"python tests/hardening/fuzz.py --cases {args.cases} --jobs {args.jobs}"
                 + (f" --wire {args.wire}" if args.wire else "")), "", _table(rows), "",
           "Answers: " + ", ".join(f"{k} {v:,}" for k, v in s["by_code"].items()) + ".", "",
           "Cases by generator: " + ", ".join(f"{k} {v:,}" for k, v in s["by_kind"].items()) + "."]
    if "wire" in summary:
        w = summary["wire"]
        out += ["", "Over real sockets, to a `nightshift collect` process:", "", _table([
            ("requests", f"{w['cases']:,} fuzz cases over HTTP, {w['grpc_cases']:,} over gRPC, {w['framing']:,} "
                         "malformed HTTP exchanges on raw sockets (bad request lines, 70 KB headers, 150 headers, "
                         "negative or garbled Content-Length, bodies cut short, bad chunking, stalls)"),
            ("crashes / wrong status codes", f"{w['crashes']} / {w['wrong_code']}"),
            ("healthy afterwards; SIGTERM exit code", f"{w['healthy_after']}; {w['exit_code']}"),
            ("acknowledged / read by the flusher / rows in Parquet",
             f"{w['acknowledged']:,} / {w['flusher_read']:,} / {w['rows_in_parquet']:,} (the difference: resent duplicates)"),
            ("collector RSS at start / end", f"{w['rss_mib_before']:.0f} / {w['rss_mib_after']:.0f} MiB"),
        ])]
    if s["failures"]:
        out += ["", "Failures (first 10):", ""] + [f"- `{f['case_id']}` {f['kind']} over {f['transport']}: expected "
                                                   f"{f['expected']}, got {f['got']}" for f in s["failures"][:10]]
    return "\n".join(out)


def fault_section(name: str, r: dict) -> str:
    cmd = {"kill9": f"python tests/hardening/faults.py kill9 --rounds {r.get('rounds', '?')}",
           "disk-full": "python tests/hardening/faults.py disk-full",
           "flusher-kill": f"python tests/hardening/faults.py flusher-kill --times {r.get('times', '?')}",
           "object-store": "python tests/hardening/faults.py object-store"}[name]
    common = [("spans acknowledged", f"{r.get('acknowledged', 0):,}"), ("lost", str(r.get("lost"))),
              ("stored twice", str(r.get("duplicated"))), ("SIGTERM exit code at the end", str(r.get("exit_code"))),
              ("answers the senders got", ", ".join(f"{k} {v:,}" for k, v in r.get("answers", {}).items())),
              ("retryable answers without Retry-After / RetryInfo", str(r.get("retryable_without_retry_after")))]
    if name == "kill9":
        rows = [("kills", f"{r['rounds']} (the flusher killed too in {r['flusher_killed_too']})"),
                ("restart to healthy", f"median {r['restart_to_healthy_s_median']:.2f} s, max {r['restart_to_healthy_s_max']:.2f} s")]
    elif name == "disk-full":
        rows = [("how", r["how"]), ("503 / UNAVAILABLE answers while full", f"{r.get('refused_while_full', 0):,}"),
                ("healthy while full", str(r.get("healthy_while_full"))),
                ("flusher resumed to first acknowledgement", f"{r['resume_to_first_ack_s']:.2f} s" if r.get("resume_to_first_ack_s") is not None else "never")]
        if "data_disk_lost" in r:
            rows += [("data folder full: flush failures, then space freed", f"{r['data_disk_flush_errors']} failed flush(es)"),
                     ("data folder: space freed to everything flushed", f"{r['data_disk_space_to_flushed_s']:.2f} s"),
                     ("data folder: acknowledged / lost / stored twice",
                      f"{r['data_disk_acknowledged']:,} / {r['data_disk_lost']} / {r['data_disk_duplicated']}")]
        else:
            rows += [("data folder full", r.get("data_disk", "not run"))]
    elif name == "flusher-kill":
        rows = [("kills between the Parquet commit and the log trim", str(r["times"])),
                ("kill to the next flush (restart, redo)", f"median {r['kill_to_next_flush_s_median']:.2f} s, max {r['kill_to_next_flush_s_max']:.2f} s")]
    else:
        rows = [("store", r["store"]), ("load", r.get("load", ""))]
        for mode, p in r["phases"].items():
            rows.append((f"store {mode}s: acks meanwhile / failed flushes / flusher restarted stuck / back to caught up",
                         f"{p['acks_during']:,} / {p['flush_errors_during']} / {p['flusher_restarts_stuck']} / "
                         f"{p['store_back_to_caught_up_s']:.1f} s (log peak {p['wal_bytes_peak'] / 2**20:.1f} MiB)"))
        rows.append(("Parquet files on the store", str(r.get("files"))))
    return "\n".join([stamp(cmd), "", _table(rows + common + [("wall time", f"{r.get('wall_s', 0):.0f} s")])])


def security_section(results: dict) -> str:
    import security

    out = [stamp("python tests/hardening/security.py"), ""]
    rows = []
    if "tokens" in results:
        t = results["tokens"]
        rows.append(("bearer token: 4 HTTP paths x (none, wrong, no `Bearer`, right) + 3 gRPC services x (none, wrong, right)",
                     f"{t['checks']} checks, {t['refused_as_expected']} refused 401/UNAUTHENTICATED, "
                     f"{t['accepted_as_expected']} accepted; wrong: {len(t['wrong'])}; /healthz open: {t['health_open_for_probes']}"))
    if "tls" in results:
        t = results["tls"]
        rows.append(("TLS: HTTPS / plain HTTP to the TLS port / gRPC TLS / gRPC plaintext",
                     f"{t['https_post']} / {t['plain_http_post']} / {t['grpc_tls']} / {t['grpc_plaintext']}"))
    if "warning" in results:
        w = results["warning"]
        rows.append(("bound to 0.0.0.0: WARNING without a token / with one", f"{w['no_token']} / {w['token']}"))
    if "redaction" in results:
        r = results["redaction"]
        rows.append(("redaction: secrets planted (span attributes, log bodies and attributes, feedback comments; protobuf, JSON, gzip)",
                     f"{r['planted']}; found in the log folder {r['found_in_wal']}, in Parquet (pages decompressed) "
                     f"{r['found_in_data']}, in the collector's own log {r['found_in_log_file']}"))
    if "paths" in results:
        p = results["paths"]
        rows.append((f"paths: {p['hostile_names']} hostile names (`../../etc`, `/etc/passwd`, NUL, 300 chars...) "
                     "as service, scope, span, attribute, agent and feedback names",
                     f"{p['files_written']} files written, {len(p['files_not_matching_the_pattern'])} not of the form "
                     f"`<dataset>/date=YYYY-MM-DD/part-<log id>-<segment>.parquet`, {len(p['escaped'])} outside the "
                     f"data folder; {p['spans_stored']} spans stored"))
    out.append(_table(rows))
    if "fairness" in results:
        f = results["fairness"]
        out += ["", security.fairness.__doc__.split("\n\n")[0].replace("\n    ", " ").strip(), "",
                "| per-client limits | quiet client accepted first try | quiet p50 / p99 | noisy: accepted / 429 / 503 |",
                "|---|---|---|---|"]
        for name in ("limits_off", "limits_on"):
            x = f[name]
            out.append(f"| {name.split('_')[1]} | {x['quiet_accepted_first_try_pct']:.0f} % of {x['quiet_requests']} | "
                       f"{x['quiet_p50_ms']:.1f} / {x['quiet_p99_ms']:.1f} ms | {x['noisy_answers'].get('http:200', 0)} / "
                       f"{x['noisy_answers'].get('http:429', 0)} / {x['noisy_answers'].get('http:503', 0)} |")
    return "\n".join(out)


def route_fuzz_section(r: dict, args) -> str:
    rows = [
        ("cases", f"{r['cases']:,} to one `nightshift route` process over loopback, in front of a scripted stand-in "
                  f"for vLLM ({r['wall_s']:.0f} s, {r['cases'] / max(r['wall_s'], 1e-9):,.0f} cases/s)"),
        ("server errors (a 5xx the upstream did not answer, or no answer)", str(r["server_errors"])),
        ("a status other than the case's", str(r["wrong_code"])),
        ("refused requests the upstream heard of anyway", str(r["reached_upstream"])),
        ("forwarded requests that never reached it", str(r["not_forwarded"])),
        ("forwarded but not byte for byte (body beyond `model`, path, headers that must not cross)",
         str(r["altered"])),
        ("tracebacks in the proxy's log", str(r["tracebacks"])),
        ("healthy afterwards; SIGTERM exit code", f"{r['healthy_after']}; {r['exit_code']}"),
    ]
    out = [stamp(f"python tests/hardening/route_fuzz.py --cases {args.cases} --seed {args.seed}"), "", _table(rows), "",
           "Answers: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r["by_code"].items())) + " (the 500s are the "
           "stand-in's own, on purpose).", "",
           "Cases by generator: " + ", ".join(f"{k} {v:,}" for k, v in sorted(r["by_kind"].items())) + "."]
    if r["failures"]:
        out += ["", "Failures (first 10):", ""] + [f"- `{f['case_id']}` {f['kind']}: {f['what']}"
                                                   for f in r["failures"][:10]]
    return "\n".join(out)


def state_fuzz_section(s, args) -> str:
    """The state files campaign (hardening/state_fuzz.py): `s` its Summary."""
    rows = [
        ("cases", f"{s.cases:,} ({', '.join(f'{k} {v:,}' for k, v in sorted(s.by_target.items()))}), "
                  f"{s.commands:,} commands and readers run on them"),
        ("time", f"{s.wall_s:.0f} s, {s.cases / max(s.wall_s, 1e-9):,.0f} cases/s (in process, one core)"),
        ("tracebacks (an exception out of a command, or one printed)", str(s.tracebacks)),
        ("a broken file not refused with exit 2, or a valid one refused", str(s.wrong_exit)),
        ("broken files refused (exit 2, one line naming the file)", f"{s.refused:,} ({s.unclear} not one such line)"),
        ("requests to the server while the registry or state was broken", str(s.server_touched)),
        ("broken registry or state files rewritten", str(s.file_changed)),
        ("decisions appended after a broken gate log that did not read back", str(s.glued)),
        ("whole nightly reports written (with the plot)", str(s.full_reports)),
        ("slowest case", f"{s.slowest_s:.2f} s ({s.slowest})"),
    ]
    out = [stamp(f"python tests/hardening/state_fuzz.py --cases {args.cases} --seed {args.seed}"), "", _table(rows), "",
           "Cases by generator: " + ", ".join(f"{k} {v:,}" for k, v in sorted(s.by_kind.items())) + "."]
    if s.failures:
        out += ["", "Failures (first 10):", ""] + [f"- `{f.case_id}` {f.target}:{f.kind}, {f.command}: {f.what[:200]}"
                                                   for f in s.failures[:10]]
    return "\n".join(out)
