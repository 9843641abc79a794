#!/usr/bin/env python
"""Publishing benchmark: seconds from a finished checkpoint to the first completion
served by the new adapter.

    python benchmarks/publish.py [--versions 5] [--vllm-url URL --model-dir DIR]

Without --vllm-url it starts `nightshift serve --engine transformers` (the CPU
stand-in) on the tiny model and trains --versions LoRA versions on synthetic
transitions first (not timed). Each version is then published with `nightshift
publish` semantics (vLLM rules checked, base checked, POST /v1/load_lora_adapter,
GET /v1/models, a verifying completion, registry written, old versions unloaded),
and the clock stops when an OpenAI client's completion with `"model":
"<name>@<version>"` returns. Printed: per version and the median; target < 10 s.
With --vllm-url, the same against a real vLLM server whose base is --model-dir.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))
from hardening.proc import free_port  # noqa: E402  one helper for every harness


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--vllm-url", default="", help="a running vLLM server (default: start the transformers stand-in)")
    ap.add_argument("--model-dir", default="", help="the server's base model folder (with --vllm-url)")
    ap.add_argument("--served-name", default="tiny")
    args = ap.parse_args()

    from openai import OpenAI

    from nightshift.settings import apply
    from nightshift.trainer.config import TrainConfig
    from nightshift.publish.publish import publish
    from nightshift.trainer.run import train
    from nightshift.trainer.tiny import save_tiny
    from transitions_data import row, write

    root = Path(tempfile.mkdtemp(prefix="nightshift-bench-publish-"))
    model = Path(args.model_dir) if args.model_dir else save_tiny(root / "tiny")
    server = None
    url = args.vllm_url
    if not url:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "nightshift.cli", "serve", "--engine", "transformers",
                                   "--model", str(model), "--served-model-name", args.served_name, "--port", str(port),
                                   "--max-loras", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
    try:
        write(root / "data", [row(f"What is {i} + {i}?", f"The answer is {2 * i}.", float(i % 2), advantage=(i % 2) - 0.5,
                                  group=f"q{i}") for i in range(64)])
        log(f"training {args.versions} versions (not timed)")
        paths = []
        for v in range(args.versions):
            cfg = TrainConfig()
            apply(cfg, dict(data=str(root / "data"), base_model=str(model), output=str(root / "ck"), max_steps=2,
                             batch_size=4, tensorboard=False, served_model_name=args.served_name, seed=v), "bench")
            paths.append(train(cfg, progress=False).path)
        client = OpenAI(base_url=f"{url}/v1", api_key=os.environ.get("VLLM_API_KEY", "x"))
        rows = []
        for p in paths:
            t0 = time.perf_counter()
            res = publish(p, url, name="bench", keep=2)
            t1 = time.perf_counter()
            client.chat.completions.create(model=res.lora_name, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                           max_tokens=8, temperature=0)
            t2 = time.perf_counter()
            rows.append((res.version, t1 - t0, t2 - t1, t2 - t0))
        engine = "vLLM at " + url if args.vllm_url else "nightshift serve --engine transformers (CPU stand-in)"
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
        except OSError:
            commit = "?"
        print("nightshift publishing benchmark")
        print(f"date: {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}, commit {commit}, "
              f"{platform.node()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
        print(f"server: {engine}; base: {model}")
        print(f"  {'version':8} {'publish s':>10} {'1st completion s':>17} {'total s':>8}")
        for v, a, b, c in rows:
            print(f"  {v:8} {a:>10.2f} {b:>17.2f} {c:>8.2f}")
        med = statistics.median(r[3] for r in rows)
        print(f"  median checkpoint -> first completion by the new adapter: {med:.2f} s "
              f"(target < 10 s: {'met' if med < 10 else 'NOT met'})")
        print("  publish = adapter checks, load, GET /v1/models, a verifying completion, registry, unloads beyond keep=2")
    finally:
        if server:
            server.terminate()
            server.wait(20)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
