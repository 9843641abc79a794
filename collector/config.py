"""The collector's settings, with the defaults a sidecar on a laptop wants:
loopback only, data under ./nightshift-data, nothing to configure."""

from __future__ import annotations

from dataclasses import dataclass, field

from .redact import DEFAULT_PRESETS


@dataclass
class RedactConfig:
    """`presets`: named rules (api_key, bearer, email, credit_card). `rules`: a list of
    `{name, pattern, replacement}` regexes on string values. `drop_keys`: attribute
    keys removed outright."""

    presets: list[str] = field(default_factory=lambda: list(DEFAULT_PRESETS))
    rules: list[dict] = field(default_factory=list)
    drop_keys: list[str] = field(default_factory=list)


@dataclass
class CollectorConfig:
    """`data`: where datasets go, a folder or an fsspec URL (`s3://bucket/prefix`).
    `wal`: the write-ahead log's folder, always local (default `<data>/wal`, or
    `./nightshift-wal` when `data` is remote). `grpc`/`http`: listen addresses,
    `off` to disable. `token`: a bearer token both transports require.
    `tls_cert`/`tls_key`: PEM files to serve TLS on both transports.
    `client_max_inflight`, `client_bytes_per_s`, `client_burst_bytes`: each
    client's (peer address's) share, so one noisy agent cannot starve the others
    (0 turns a limit off; behind a gateway every agent is one client).
    `flush_timeout`: a flush of one segment that takes longer (a hung object
    store) gets the flusher restarted; the segment is redone, nothing lost."""

    data: str = "./nightshift-data"
    grpc: str = "127.0.0.1:4317"
    http: str = "127.0.0.1:4318"
    wal: str = ""
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    max_request_bytes: int = 64 << 20
    wal_cap_bytes: int = 2 << 30
    segment_bytes: int = 256 << 20
    flush_interval: float = 10.0  # seconds before an idle segment is handed to the flusher
    dedup_window: float = 600.0  # how long resent spans are recognised (clients resend within ~10 s)
    max_inflight: int = 256  # concurrent requests before answering 503
    client_max_inflight: int = 32  # one client's concurrent requests before answering it 429
    client_bytes_per_s: int = 0  # one client's decompressed bytes per second (0: no limit)
    client_burst_bytes: int = 64 << 20
    flush_timeout: float = 600.0
    request_timeout: float = 60.0  # seconds a client may stall mid-request (or idle on a kept-alive connection)
    grpc_workers: int = 32
    fsync: bool = True
    shutdown_timeout: float = 60.0
    log_level: str = "info"
    storage_options: dict = field(default_factory=dict)
    redact: RedactConfig = field(default_factory=RedactConfig)

    def wal_dir(self) -> str:
        if self.wal:
            return self.wal
        if "://" in self.data and not self.data.startswith("file://"):
            return "./nightshift-wal"
        return self.data.removeprefix("file://").rstrip("/") + "/wal"
