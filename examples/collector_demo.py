"""`make demo`: the collector end to end on embedded defaults.

Starts `nightshift collect` (gRPC :4317, HTTP :4318, data in ./nightshift-data),
runs a small OpenTelemetry-instrumented program that knows nothing of Nightshift
(only OTEL_EXPORTER_OTLP_ENDPOINT points it here), stops the collector with
SIGTERM (it drains and flushes), and shows the spans with Polars.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
DATA = Path(os.environ.get("NIGHTSHIFT_DATA", "./nightshift-data"))


def _free(port: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            s.bind(("127.0.0.1", 0))
            print(f"port {port} is busy; using {s.getsockname()[1]}")
            return s.getsockname()[1]


def main() -> int:
    grpc_port, http_port = _free(4317), _free(4318)
    print(f"1/4 starting the collector: nightshift collect --data {DATA}")
    col = subprocess.Popen(
        [sys.executable, "-m", "nightshift.cli", "collect", "--data", str(DATA),
         "--grpc", f"127.0.0.1:{grpc_port}", "--http", f"127.0.0.1:{http_port}"],
        env={**os.environ, "NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "1s"},
    )
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
                break
            except OSError:
                if col.poll() is not None:
                    print("the collector exited; see its log above", file=sys.stderr)
                    return 1
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{grpc_port}"
        print(f"2/4 running an instrumented program with OTEL_EXPORTER_OTLP_ENDPOINT={endpoint}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "demo-agent"})
        app = subprocess.run([sys.executable, str(HERE / "otel_app.py"), "5"], env=env, capture_output=True, text=True)
        if app.returncode != 0:
            print(app.stderr, file=sys.stderr)
            return 1
        print(f"    the program made {len(json.loads(app.stdout))} LLM-call spans (plus their agent spans and log events)")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics").read().decode()
        accepted = [ln for ln in metrics.splitlines() if ln.startswith("nightshift_accepted_total")]
        print("    collector /metrics: " + "; ".join(accepted))
    finally:
        print("3/4 stopping the collector (SIGTERM: drain, flush to Parquet, exit 0)")
        col.send_signal(signal.SIGTERM)
        rc = col.wait(120)
    if rc != 0:
        return rc
    print("4/4 the spans, with Polars:  pl.scan_parquet('nightshift-data/spans/**/*.parquet', hive_partitioning=True)\n")
    return subprocess.call([sys.executable, "-m", "nightshift.cli", "show", "--data", str(DATA), "--rows", "10"])


if __name__ == "__main__":
    sys.exit(main())
