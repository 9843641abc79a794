"""The collector's settings (YAML section `collector:`), with the defaults a sidecar
on a laptop wants: loopback only, data under ./nightshift-data, nothing to configure.
Each is declared once here; its flag, variable and `--help` line come from it."""

from __future__ import annotations

from dataclasses import dataclass

from nightshift.settings import invalid, listen_address_or_off, setting

from .redact import DEFAULT_PRESETS, PRESETS


@dataclass
class RedactConfig:
    """Redaction before anything reaches the disk: string values matching a rule are
    replaced, keys named in drop_keys removed."""

    presets: list[str] = setting(factory=lambda: list(DEFAULT_PRESETS),
                                 help=f"named rules on string values ({', '.join(sorted(PRESETS))}); empty turns them off")
    rules: list[dict] = setting(factory=list, help="more regexes on string values: a JSON list of "
                                                   "{name, pattern, replacement}", metavar="JSON")
    drop_keys: list[str] = setting(factory=list, help="attribute keys removed outright, e.g. user.password")


@dataclass
class CollectorConfig:
    """The OTLP receiver, its write-ahead log and the flusher that writes Parquet."""

    data: str = setting("./nightshift-data", help="dataset root: a folder or an fsspec URL (s3://bucket/prefix)",
                        metavar="DIR|URL")
    grpc: str = setting("127.0.0.1:4317", help="gRPC listen address, or `off`", check=listen_address_or_off,
                        metavar="HOST:PORT|off")
    http: str = setting("127.0.0.1:4318", help="HTTP listen address, or `off`", check=listen_address_or_off,
                        metavar="HOST:PORT|off")
    wal: str = setting("", help="the write-ahead log's folder, always local (default <data>/wal, or ./nightshift-wal "
                                "when data is remote)", metavar="DIR")
    token: str = setting("", help="require `Authorization: Bearer TOKEN` on both transports", metavar="TOKEN")
    tls_cert: str = setting("", help="serve TLS on both transports with this PEM certificate", metavar="PEM")
    tls_key: str = setting("", help="the private key (PEM) for --tls-cert", metavar="PEM")
    max_request_bytes: int = setting(64 << 20, help="largest request, after decompression (413 beyond)",
                                     bounds="[1, inf)", metavar="SIZE")
    wal_cap_bytes: int = setting(2 << 30, help="log size past which requests get 503 until the flusher catches up",
                                 bounds="[1, inf)", metavar="SIZE")
    segment_bytes: int = setting(64 << 20, help="log segment size handed to the flusher, one Parquet file per dataset "
                                                "and day: each of its chunks is a row group whose metadata the writer "
                                                "holds until the file closes (~90 KB each), so 64MiB segments peaked "
                                                "16 MiB lower than 256MiB, the default before 2026-11-27, for 4x the "
                                                "files above ~6 MB/s of spans (below it, flush_interval seals them first)",
                                 bounds="[1, inf)", metavar="SIZE")
    flush_interval: float = setting(10.0, help="seconds before an idle segment is handed to the flusher",
                                    bounds="(0, inf)", metavar="DURATION")
    dedup_window: float = setting(600.0, help="how long resent spans are recognised (clients resend within ~10 s)",
                                  bounds="[0, inf)", metavar="DURATION")
    dedup_memory: int = setting(4 << 20, help="memory for the keys of recent spans (16 bytes each: 262k keys in 4MiB, "
                                              "the whole window up to 430 spans/s, 5 s at 50k/s); when full the oldest "
                                              "are forgotten first (a later resend is stored twice, and the build keeps "
                                              "one), and a restart reads only the newest files' keys; 16MiB, the "
                                              "default before 2026-11-27, holds 20 s at 50k/s for 12 MiB more of the "
                                              "sidecar's RSS; 0 = only dedup_window bounds them",
                                bounds="[0, inf)", metavar="SIZE")
    compression: str = setting("zstd", help="Parquet codec: zstd (smallest files), snappy or lz4 (faster to write, "
                                            "1.3-1.6x larger), none", choices=("zstd", "snappy", "lz4", "none"))
    max_inflight: int = setting(256, help="concurrent requests before answering 503", bounds="[1, inf)")
    max_inflight_bytes: int = setting(16 << 20, help="request bytes (decompressed) being read, parsed or waiting for "
                                                     "the disk at once before answering 503: the receiver's memory "
                                                     "under load; one request is always let in when none is; 0 = no "
                                                     "limit", bounds="[0, inf)", metavar="SIZE")
    client_max_inflight: int = setting(32, help="one client's (peer address's) concurrent requests before answering "
                                                "it 429; 0 = no limit (behind a gateway every agent is one client)",
                                       bounds="[0, inf)")
    client_bytes_per_s: int = setting(0, help="one client's decompressed bytes per second; 0 = no limit",
                                      bounds="[0, inf)", metavar="SIZE")
    client_burst_bytes: int = setting(64 << 20, help="the burst a client may send above client_bytes_per_s",
                                      bounds="[0, inf)", metavar="SIZE")
    flush_timeout: float = setting(600.0, help="a flush of one segment taking longer (a hung object store) gets the "
                                               "flusher restarted; the segment is redone, nothing lost",
                                   bounds="(0, inf)", metavar="DURATION")
    request_timeout: float = setting(60.0, help="seconds a client may stall mid-request or idle on a kept-alive "
                                                "connection", bounds="(0, inf)", metavar="DURATION")
    grpc_workers: int = setting(32, help="gRPC server threads", bounds="[1, inf)")
    fsync: bool = setting(True, help="fsync the log before acknowledging (off only for benchmarks of the rest)")
    flush_chunk_bytes: int = setting(2 << 20, help="payload bytes the flusher converts at a time, a row group each: its "
                                                   "memory peak grows with it (measured at 50k spans/s: 4MiB, the "
                                                   "default before 2026-11-27, is ~10 MiB more RSS than 2MiB, for a "
                                                   "flusher 12-20 % faster per span; collector/flusher.py, CHUNK_BYTES)",
                                     bounds="[65536, inf)", metavar="SIZE")
    flusher: str = setting("auto", help="where the flusher runs: `thread` (inside the receiver: one process, 20-30 MB "
                                        "smaller at 50k spans/s; acks wait while a flush holds the GIL; a flush stuck "
                                        "on a hung store is only reported), `process` (its own, the default before "
                                        "2026-11-27: converting spans never holds the receiver's GIL; a stuck flush "
                                        "is killed and redone) or `auto`: a thread when data is a folder, a process "
                                        "when it is an object store (where uploads can hang)",
                           choices=("auto", "process", "thread"))
    shutdown_timeout: float = setting(60.0, help="seconds SIGTERM waits for the flusher to drain",
                                      bounds="[0, inf)", metavar="DURATION")
    log_level: str = setting("info", help="debug, info, warning or error", pattern=r"(?i)debug|info|warning|error|critical",
                             metavar="LEVEL")
    storage_options: dict = setting(factory=dict, help="passed to fsspec for data, e.g. {\"anon\": false}")
    redact: RedactConfig = setting(factory=RedactConfig, help="redaction rules")

    def rules(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise invalid("tls_cert" if self.tls_cert else "tls_key", "tls_cert and tls_key go together: give both")
        unknown = [p for p in self.redact.presets if p not in PRESETS]
        if unknown:
            raise invalid("redact.presets", f"unknown preset(s) {', '.join(map(repr, unknown))} "
                                            f"(known: {', '.join(sorted(PRESETS))})")

    def check(self) -> None:
        from nightshift.settings import validate

        validate(self, "collector")

    def remote_data(self) -> bool:
        return "://" in self.data and not self.data.startswith("file://")

    def flusher_form(self) -> str:
        """`flusher` resolved. `auto` weighs the one thing a thread cannot do, be
        killed, against 20-30 MB: an upload to an object store can hang past
        `flush_timeout` and then only a process can be killed and redone; a write to
        a folder does not hang that way, so a folder's sidecar is one process."""
        if self.flusher != "auto":
            return self.flusher
        return "process" if self.remote_data() else "thread"

    def wal_dir(self) -> str:
        if self.wal:
            return self.wal
        if self.remote_data():
            return "./nightshift-wal"
        return self.data.removeprefix("file://").rstrip("/") + "/wal"
