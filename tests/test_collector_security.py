"""Bearer tokens, TLS, and redaction checked on the bytes on disk."""

from __future__ import annotations

import datetime
import json

import grpc
import pytest

from conftest import read_logs, read_spans
from helpers import grpc_export, make_request, post, run_app


def test_bearer_token_on_both_transports(collector_factory):
    c = collector_factory(extra_args=["--token", "s3cret-token"]).start()
    req, ids = make_request(2)
    body = req.SerializeToString()
    assert post(c.http_port, "/v1/traces", body)[0] == 401
    assert post(c.http_port, "/v1/traces", body, headers={"Authorization": "Bearer wrong"})[0] == 401
    _, err = grpc_export(c.grpc_port, body)
    assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
    # Real SDK exporters with the token in OTEL_EXPORTER_OTLP_HEADERS.
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20s3cret-token"}
    for protocol, url in (("grpc", c.grpc_url), ("http/protobuf", c.http_url)):
        p = run_app(url, protocol, n=1, extra_env=env)
        assert p.returncode == 0, p.stderr
    assert c.health()["status"] == "ok"  # health stays open for probes
    assert c.stop() == 0
    assert read_spans(c.data).height == 4  # 2 spans from each SDK run, nothing from the refused requests


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_on_both_transports(collector_factory, tmp_path):
    cert, key = _self_signed(tmp_path)
    c = collector_factory(extra_args=["--tls-cert", str(cert), "--tls-key", str(key)], scheme="https").start()
    env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(cert)}
    for protocol, url in (("grpc", c.grpc_url), ("http/protobuf", c.http_url)):
        p = run_app(url, protocol, n=1, extra_env=env)
        assert p.returncode == 0, p.stderr
    # Plain text to the TLS port is not accepted.
    req, _ = make_request(1)
    with pytest.raises(Exception):
        post(c.http_port, "/v1/traces", req.SerializeToString())
    assert c.stop() == 0
    assert read_spans(c.data).height == 4
    assert read_logs(c.data).height == 2


def test_redacted_values_never_touch_the_disk(collector_factory, tmp_path):
    cfg = tmp_path / "nightshift.yaml"
    cfg.write_text(
        "collector:\n"
        "  flush_interval: 60s\n"  # keep the data in the WAL so its bytes can be read
        "  redact:\n"
        "    presets: [email, api_key, bearer, credit_card]\n"
        "    rules: [{name: ticket, pattern: 'TICKET-[0-9]{6}'}]\n"
        "    drop_keys: [user.password]\n"
    )
    c = collector_factory(extra_args=["--config", str(cfg)]).start()
    secrets = ["alice@example.com", "sk-proj-AbCdEfGhIjKlMnOpQrSt1234", "4111 1111 1111 1111", "TICKET-123456", "hunter2-password"]
    req, ids = make_request(1, content="mail alice@example.com key sk-proj-AbCdEfGhIjKlMnOpQrSt1234 card 4111 1111 1111 1111 TICKET-123456 keepme-marker")
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    span = req.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.append(KeyValue(key="user.password", value=AnyValue(string_value="hunter2-password")))
    ev = span.events.add(name="prompt")
    ev.attributes.append(KeyValue(key="nested", value=AnyValue(array_value={"values": [AnyValue(string_value="to alice@example.com")]})))
    assert post(c.http_port, "/v1/traces", req.SerializeToString())[0] == 200
    wal_bytes = b"".join(p.read_bytes() for p in c.wal.glob("*.active"))
    assert b"keepme-marker" in wal_bytes  # the record is there...
    for s in secrets:
        assert s.encode() not in wal_bytes, f"{s} reached the write-ahead log"
    assert c.stop() == 0
    spans = read_spans(c.data)
    text = json.dumps(spans.drop("date", "start_time", "end_time", "received_time").to_dicts(), default=str)
    assert "keepme-marker" in text and "[REDACTED:email]" in text and "[REDACTED:ticket]" in text
    for s in secrets:
        assert s not in text, f"{s} reached the Parquet dataset"
    assert "user.password" not in text
    raw = b"".join(p.read_bytes() for p in (c.data / "spans").rglob("*.parquet"))
    for s in secrets:
        assert s.encode() not in raw


def test_loud_warning_when_listening_beyond_loopback_without_a_token(collector_factory):
    from conftest import free_port

    port = free_port()
    c = collector_factory()
    c.extra_args = ["--http", f"0.0.0.0:{port}"]  # overrides the loopback default given first
    c.http_port = port
    c.start()
    assert c.stop() == 0
    assert "WITHOUT a bearer token" in c.log_tail()
