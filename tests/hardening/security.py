#!/usr/bin/env python
"""Security campaign against a real `nightshift collect`: who may write, what
reaches the disk, where files go, and whether one client can starve the others.

    python tests/hardening/security.py                # every check, printed
    python tests/hardening/security.py fairness       # one of: tokens, tls, warning, redaction, paths, fairness
    python tests/hardening/security.py --write-docs   # the figures into docs/RELIABILITY.md
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import http.client
import json
import os
import re
import ssl
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grpc  # noqa: E402

from load import Load, make_request  # noqa: E402
from proc import Collector, drained, stored_keys  # noqa: E402

PATHS = ("/v1/traces", "/v1/logs", "/v1/metrics", "/v1/feedback")
SERVICES = {"traces": "opentelemetry.proto.collector.trace.v1.TraceService",
            "logs": "opentelemetry.proto.collector.logs.v1.LogsService",
            "metrics": "opentelemetry.proto.collector.metrics.v1.MetricsService"}


def _post(port: int, path: str, body: bytes, ctype: str, headers: dict | None = None, source: str = "127.0.0.1",
          tls: ssl.SSLContext | None = None) -> tuple[int, dict]:
    cls = http.client.HTTPSConnection if tls else http.client.HTTPConnection
    kw = {"context": tls} if tls else {}
    conn = cls("127.0.0.1", port, timeout=30, source_address=(source, 0), **kw)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": ctype, **(headers or {})})
        r = conn.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def _bodies() -> dict[str, tuple[bytes, str]]:
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    logs = ExportLogsServiceRequest()
    logs.resource_logs.add().scope_logs.add().log_records.add(time_unix_nano=time.time_ns(), event_name="e")
    metrics = ExportMetricsServiceRequest()
    metrics.resource_metrics.add().scope_metrics.add().metrics.add(name="m").sum.data_points.add(as_int=1)
    fb = json.dumps({"trace_id": os.urandom(16).hex(), "value": 1}).encode()
    return {"/v1/traces": (make_request(2, "x")[0], "application/x-protobuf"),
            "/v1/logs": (logs.SerializeToString(), "application/x-protobuf"),
            "/v1/metrics": (metrics.SerializeToString(), "application/x-protobuf"),
            "/v1/feedback": (fb, "application/json")}


# --- tokens -----------------------------------------------------------------------------------

def tokens(root: Path | None = None) -> dict:
    """Every write path on both transports, with no token, a wrong one, the right one."""
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-tokens-"))
    c = Collector(root / "data", root / "wal", root / "collector.log", extra_args=["--token", "s3cret"]).start()
    bodies = _bodies()
    out = {"checks": 0, "refused_as_expected": 0, "accepted_as_expected": 0, "wrong": []}
    try:
        for path, (body, ctype) in bodies.items():
            for auth, want in ((None, 401), ("Bearer wrong", 401), ("s3cret", 401), ("Bearer s3cret", 200)):
                got, _ = _post(c.http_port, path, body, ctype, {"Authorization": auth} if auth else {})
                out["checks"] += 1
                if got == want:
                    out["refused_as_expected" if want == 401 else "accepted_as_expected"] += 1
                else:
                    out["wrong"].append(f"HTTP {path} auth={auth!r}: {got}, expected {want}")
        with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as ch:
            for sig, svc in SERVICES.items():
                call = ch.unary_unary(f"/{svc}/Export")
                body = bodies[f"/v1/{sig}"][0]
                for md, want in ((None, grpc.StatusCode.UNAUTHENTICATED), ((("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
                                 ((("authorization", "Bearer s3cret"),), grpc.StatusCode.OK)):
                    try:
                        call(body, metadata=md, timeout=10)
                        got = grpc.StatusCode.OK
                    except grpc.RpcError as e:
                        got = e.code()
                    out["checks"] += 1
                    if got == want:
                        out["refused_as_expected" if want != grpc.StatusCode.OK else "accepted_as_expected"] += 1
                    else:
                        out["wrong"].append(f"gRPC {sig} metadata={md}: {got.name}, expected {want.name}")
        out["health_open_for_probes"] = bool(c.health())
        m = drained(c)
        out["refused_metric"] = int(sum(v for k, v in m.items() if "nightshift_refused_requests_total" in k and "unauthenticated" in k))
        out["exit_code"] = c.stop()
        rows = stored_keys(c.data)
        out["spans_stored"] = len(rows)  # only the two requests with the right token
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
    return out


# --- TLS ----------------------------------------------------------------------------------

def self_signed(folder: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    c, k = folder / "cert.pem", folder / "key.pem"
    c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    return c, k


def tls(root: Path | None = None) -> dict:
    """Both transports speak TLS with the configured certificate; plaintext gets nothing in."""
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-tls-"))
    cert, key = self_signed(root)
    c = Collector(root / "data", root / "wal", root / "collector.log",
                  extra_args=["--tls-cert", str(cert), "--tls-key", str(key)])
    out: dict = {}
    c.health = lambda: _https_health(c, cert)  # type: ignore[method-assign]
    try:
        c.start()
        ctx = ssl.create_default_context(cafile=str(cert))
        body, ctype = _bodies()["/v1/traces"]
        out["https_post"] = _post(c.http_port, "/v1/traces", body, ctype, tls=ctx)[0]
        try:
            out["plain_http_post"] = _post(c.http_port, "/v1/traces", body, ctype)[0]
        except (OSError, http.client.HTTPException) as e:
            out["plain_http_post"] = type(e).__name__
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{c.grpc_port}", creds) as ch:
            try:
                ch.unary_unary(f"/{SERVICES['traces']}/Export")(make_request(2, "x")[0], timeout=10)
                out["grpc_tls"] = "OK"
            except grpc.RpcError as e:
                out["grpc_tls"] = e.code().name
        with grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}") as ch:
            try:
                ch.unary_unary(f"/{SERVICES['traces']}/Export")(body, timeout=5)
                out["grpc_plaintext"] = "OK"
            except grpc.RpcError as e:
                out["grpc_plaintext"] = e.code().name
        c.proc.send_signal(15)
        out["exit_code"] = c.proc.wait(60)
        out["spans_stored"] = len(stored_keys(c.data))
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
    return out


def _https_health(c: Collector, cert: Path) -> dict | None:
    import urllib.request

    try:
        ctx = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://127.0.0.1:{c.http_port}/healthz", timeout=2, context=ctx) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001
        return None


# --- the warning ----------------------------------------------------------------------------

def warning(root: Path | None = None) -> dict:
    """Bound beyond loopback without a token: a WARNING in the log; with a token, none."""
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-warning-"))
    out = {}
    for name, args in (("no_token", []), ("token", ["--token", "t"])):
        c = Collector(root / name / "data", root / name / "wal", root / f"{name}.log", extra_args=args, host="0.0.0.0")
        c.start()
        c.stop()
        text = c.log_path.read_text()
        out[name] = bool(re.search(r"WARNING .*non-loopback .*WITHOUT a bearer token", text))
    return out


# --- redaction ------------------------------------------------------------------------------

SECRETS = ["sk-proj-" + "Ab3dEf6hIj9kLm2nOp5qRs8t", "Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJl",
           "AKIAIOSFODNN7EXAMPLE"]


def redaction(root: Path | None = None) -> dict:
    """Secrets planted in span attributes, log bodies and feedback comments, over
    both encodings and gzip; then every byte under the log and data folders is
    searched for them, while still in the log and after flushing."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    root = root or Path(tempfile.mkdtemp(prefix="nightshift-redaction-"))
    c = Collector(root / "data", root / "wal", root / "collector.log",
                  env={"NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "3600"}).start()
    out: dict = {"planted": 0}
    try:
        for i, secret in enumerate(SECRETS):
            body, _ = make_request(3, f"my key is {secret} ok")  # span attribute `content`
            out["planted"] += 3
            if i % 2:
                st, _ = _post(c.http_port, "/v1/traces", gzip.compress(body), "application/x-protobuf", {"Content-Encoding": "gzip"})
            else:
                st, _ = _post(c.http_port, "/v1/traces", body, "application/x-protobuf")
            assert st == 200, st
            logs = ExportLogsServiceRequest()
            rec = logs.resource_logs.add().scope_logs.add().log_records.add(time_unix_nano=time.time_ns())
            rec.body.string_value = f"user said {secret}"
            rec.attributes.append(KeyValue(key="x", value=AnyValue(string_value=secret)))
            from nightshift.collector import otlp_json

            assert _post(c.http_port, "/v1/logs", otlp_json.encode(logs), "application/json")[0] == 200
            fb = json.dumps({"trace_id": os.urandom(16).hex(), "value": 1, "comment": f"token {secret}"}).encode()
            assert _post(c.http_port, "/v1/feedback", fb, "application/json")[0] == 200
            out["planted"] += 3
        # the secrets, and their distinctive tails (a partial redaction would leave those)
        raw = [s.encode() for s in SECRETS] + [SECRETS[0].split("-", 2)[2].encode(), SECRETS[1].split(".")[-1].encode()]
        out["found_in_wal"] = _scan(c.wal, raw)
        out["exit_code"] = c.stop()
        out["found_in_data"] = _scan(Path(c.data), raw)
        out["found_in_log_file"] = _scan(c.log_path.parent, raw, only=c.log_path.name)
        out["bytes_scanned"] = sum(p.stat().st_size for p in Path(c.data).rglob("*") if p.is_file())
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
    return out


def _scan(folder: Path, needles: list[bytes], only: str = "") -> int:
    """Occurrences of any needle in any file under `folder`, Parquet pages
    decompressed (zstd hides plain text), raw bytes otherwise."""
    import pyarrow.parquet as pq

    n = 0
    for p in folder.rglob(only or "*"):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.suffix == ".parquet":
            data += json.dumps(pq.read_table(p).to_pylist(), default=str).encode()
        n += sum(data.count(x) for x in needles)
    return n


# --- paths --------------------------------------------------------------------------------

HOSTILE = ["../../etc", "../../../../tmp/evil", "/etc/passwd", "a/b\\c", "date=1999-01-01", "..", "\x00", "con",
           "%2e%2e%2f", "x" * 300]


def paths(root: Path | None = None) -> dict:
    """Hostile service names, scope names, event names and feedback names: every
    file the collector writes must stay under its data and log folders, with the
    names it chooses itself (`<dataset>/date=YYYY-MM-DD/part-<log id>-<segment>.parquet`)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    root = root or Path(tempfile.mkdtemp(prefix="nightshift-paths-"))
    inside = root / "inside"
    c = Collector(inside / "data", inside / "wal", root / "collector.log").start()
    before = {p for p in root.parent.iterdir()}
    out: dict = {"hostile_names": len(HOSTILE)}
    try:
        req = ExportTraceServiceRequest()
        for name in HOSTILE:
            rs = req.resource_spans.add()
            rs.resource.attributes.append(KeyValue(key="service.name", value=AnyValue(string_value=name)))
            ss = rs.scope_spans.add()
            ss.scope.name = name
            s = Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=name, start_time_unix_nano=time.time_ns())
            s.attributes.append(KeyValue(key=name, value=AnyValue(string_value=name)))
            s.attributes.append(KeyValue(key="gen_ai.agent.name", value=AnyValue(string_value=name)))
            ss.spans.append(s)
        out["traces_status"] = _post(c.http_port, "/v1/traces", req.SerializeToString(), "application/x-protobuf")[0]
        fb = [{"trace_id": os.urandom(16).hex(), "value": 1, "name": n, "id": n, "conversation_id": n} for n in HOSTILE if "\x00" not in n]
        out["feedback_status"] = _post(c.http_port, "/v1/feedback", json.dumps(fb).encode(), "application/json")[0]
        out["exit_code"] = c.stop()
        pattern = re.compile(r"(spans|logs|feedback)/date=\d{4}-\d{2}-\d{2}/part-[0-9a-f]{12}-\d{20}\.parquet")
        files = [p.relative_to(inside / "data").as_posix() for p in (inside / "data").rglob("*") if p.is_file()]
        out["files_written"] = len(files)
        out["files_not_matching_the_pattern"] = [f for f in files if not pattern.fullmatch(f)]
        out["new_entries_outside"] = sorted(str(p) for p in set(root.parent.iterdir()) - before)
        everything = [p for p in root.rglob("*")]
        out["escaped"] = [str(p) for p in everything if not (p == root / "collector.log" or inside in p.parents or p == inside)]
        out["spans_stored"] = len(stored_keys(inside / "data"))
    finally:
        if c.proc and c.proc.poll() is None:
            c.kill9()
    return out


# --- fairness -----------------------------------------------------------------------------

def fairness(seconds: float = 8.0, noisy_threads: int = 24, root: Path | None = None) -> dict:
    """A noisy client (24 connections, each uploading 200 KB requests slowly, over
    a second, back to back) beside a quiet one (one small request every 50 ms),
    each from its own loopback address, with a pool of 16 request slots and
    per-client limits off, then on (4 slots a client). The quiet client's figures
    are the point: without the limits the noisy one holds every slot."""
    root = root or Path(tempfile.mkdtemp(prefix="nightshift-fairness-"))
    out = {}
    for name, limit in (("limits_off", "0"), ("limits_on", "4")):
        c = Collector(root / name / "data", root / name / "wal", root / f"{name}.log",
                      env={"NIGHTSHIFT_COLLECTOR_MAX_INFLIGHT": "16", "NIGHTSHIFT_COLLECTOR_CLIENT_MAX_INFLIGHT": limit}).start()
        try:
            noisy = Load(c.http_port, c.grpc_port, senders=noisy_threads, spans=100, content="n" * 2000,
                         source="127.0.0.2", grpc_share=False, max_attempts=1, upload_s=1.0)
            quiet = Load(c.http_port, c.grpc_port, senders=1, spans=5, content="q" * 200, source="127.0.0.3",
                         grpc_share=False, max_attempts=1, pace_s=0.05)
            noisy.start()
            time.sleep(0.5)
            quiet.start()
            time.sleep(seconds)
            quiet.stop()
            noisy.stop()
            q_tries = sum(quiet.answers.values())
            q_ok = quiet.answers.get("http:200", 0)
            lat = sorted(quiet.latencies)
            out[name] = {
                "quiet_requests": q_tries, "quiet_accepted_first_try_pct": 100.0 * q_ok / max(q_tries, 1),
                "quiet_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
                "quiet_p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
                "quiet_answers": dict(quiet.answers), "noisy_answers": dict(noisy.answers),
                "noisy_throttled_429": noisy.answers.get("http:429", 0),
                "retryable_without_retry_after": quiet.retry_after_missing + noisy.retry_after_missing,
            }
            drained(c)
            out[name]["exit_code"] = c.stop()
            stored = set(stored_keys(Path(c.data)))
            out[name]["lost"] = len(set(quiet.acked + noisy.acked) - stored)
        finally:
            if c.proc and c.proc.poll() is None:
                c.kill9()
    return out


CHECKS = {"tokens": tokens, "tls": tls, "warning": warning, "redaction": redaction, "paths": paths, "fairness": fairness}


def ok(name: str, r: dict) -> bool:
    if name == "tokens":
        return not r["wrong"] and r["spans_stored"] == 2 and r["exit_code"] == 0
    if name == "tls":
        return (r["https_post"] == 200 and r["plain_http_post"] != 200 and r["grpc_tls"] == "OK"
                and r["grpc_plaintext"] != "OK" and r["spans_stored"] == 4)
    if name == "warning":
        return r["no_token"] and not r["token"]
    if name == "redaction":
        return r["found_in_wal"] == 0 and r["found_in_data"] == 0 and r["found_in_log_file"] == 0
    if name == "paths":
        return (not r["files_not_matching_the_pattern"] and not r["escaped"] and not r["new_entries_outside"]
                and r["spans_stored"] == len(HOSTILE))
    if name == "fairness":
        on = r["limits_on"]
        return on["quiet_accepted_first_try_pct"] == 100.0 and on["noisy_throttled_429"] > 0 and on["lost"] == 0
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("checks", nargs="*", default=list(CHECKS))
    ap.add_argument("--json")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    results, good = {}, True
    for name in args.checks:
        r = CHECKS[name]()
        results[name] = r
        good = good and ok(name, r)
        print(f"{name}: {'OK' if ok(name, r) else 'FAILED'}")
        for k, v in r.items():
            print(f"  {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    if args.write_docs:
        import docs

        docs.write_section("security", docs.security_section(results))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
