"""`make demo`: collector, transform and trainer end to end on embedded defaults.

Starts `nightshift collect` (gRPC :4317, HTTP :4318, data in ./nightshift-data),
runs a small OpenTelemetry-instrumented program that knows nothing of Nightshift
(only OTEL_EXPORTER_OTLP_ENDPOINT points it here), posts delayed feedback for its
runs to `/v1/feedback`, stops the collector with SIGTERM (it drains and flushes),
shows the spans with Polars, then builds the transitions dataset with
`nightshift build` and shows one credit-assigned row per LLM call, then trains a
tiny model (built offline, CPU) on them with `nightshift train` and lists the
versioned checkpoint.
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
    print(f"1/6 starting the collector: nightshift collect --data {DATA}")
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
        print(f"2/6 running an instrumented program with OTEL_EXPORTER_OTLP_ENDPOINT={endpoint}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update({"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "demo-agent"})
        app = subprocess.run([sys.executable, str(HERE / "otel_app.py"), "5"], env=env, capture_output=True, text=True)
        if app.returncode != 0:
            print(app.stderr, file=sys.stderr)
            return 1
        runs = json.loads(app.stdout)
        print(f"    the program made {len(runs)} LLM-call spans (plus their agent spans and log events)")
        labels = [{"trace_id": r["trace_id"], "name": "user_rating", "value": float(i % 2)} for i, r in enumerate(runs)]
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/feedback", data=json.dumps(labels).encode(),
                                     headers={"Content-Type": "application/json"})
        print(f"    feedback arrives later: POST /v1/feedback -> {urllib.request.urlopen(req).read().decode()}")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics").read().decode()
        accepted = [ln for ln in metrics.splitlines() if ln.startswith("nightshift_accepted_total")]
        print("    collector /metrics: " + "; ".join(accepted))
    finally:
        print("3/6 stopping the collector (SIGTERM: drain, flush to Parquet, exit 0)")
        col.send_signal(signal.SIGTERM)
        rc = col.wait(120)
    if rc != 0:
        return rc
    print("4/6 the spans, with Polars:  pl.scan_parquet('nightshift-data/spans/**/*.parquet', hive_partitioning=True)\n")
    rc = subprocess.call([sys.executable, "-m", "nightshift.cli", "show", "--data", str(DATA), "--rows", "5"])
    if rc != 0:
        return rc
    print(f"\n5/6 transitions: nightshift build --data {DATA} --settle 0\n")
    rc = subprocess.call([sys.executable, "-m", "nightshift.cli", "build", "--data", str(DATA), "--settle", "0"])
    if rc != 0:
        return rc
    import polars as pl

    t = pl.read_parquet(DATA / "transitions", hive_partitioning=True)
    with pl.Config(tbl_cols=-1, fmt_str_lengths=30, tbl_width_chars=160, tbl_rows=6):
        print(t.select("trajectory_id", "step", "agent_name", "model", pl.col("input_messages").list.len().alias("n_in"),
                       pl.col("output_message").struct.field("content").alias("output"), "reward", "reward_source",
                       "advantage", "convention").head(6))
    model = DATA / "models" / "tiny-qwen2"
    if not (model / "config.json").exists():
        from nightshift.trainer.tiny import save_tiny

        save_tiny(model)  # a two-layer Qwen2-shaped model and tokenizer, built from a config: no download
    ckpts = DATA / "checkpoints"
    print(f"\n6/6 training: nightshift train --data {DATA} --base-model {model} --output {ckpts} --max-steps 8\n")
    rc = subprocess.call([sys.executable, "-m", "nightshift.cli", "train", "--data", str(DATA), "--base-model", str(model),
                          "--output", str(ckpts), "--max-steps", "8", "--batch-size", "2", "--learning-rate", "1e-3",
                          "--quiet"])
    if rc != 0:
        return rc
    return subprocess.call([sys.executable, "-m", "nightshift.cli", "checkpoints", "--output", str(ckpts)])


if __name__ == "__main__":
    sys.exit(main())
