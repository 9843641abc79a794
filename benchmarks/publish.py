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
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from hardening.proc import free_port  # noqa: E402  one helper for every harness
from harness import Target, log  # noqa: E402

#: The median from a finished checkpoint to the first completion by the new adapter.
T_PUBLISH = Target("<", 10.0, "10 s")


def parse_args() -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--vllm-url", default="", help="a running vLLM server (default: start the transformers stand-in)")
    ap.add_argument("--model-dir", default="", help="the server's base model folder (with --vllm-url)")
    ap.add_argument("--served-name", default="tiny")
    return ap.parse_args()


@contextmanager
def server(args: argparse.Namespace, model: Path) -> Iterator[str]:
    """--vllm-url, or `nightshift serve --engine transformers` on `model`, started
    here and stopped afterwards; yields the server's URL."""
    if args.vllm_url:
        yield args.vllm_url
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "nightshift.cli", "serve", "--engine", "transformers",
                             "--model", str(model), "--served-model-name", args.served_name, "--port", str(port),
                             "--max-loras", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def train_versions(root: Path, model: Path, args: argparse.Namespace) -> list[Path]:
    """--versions LoRA checkpoints on synthetic transitions (not timed)."""
    from nightshift.settings import apply
    from nightshift.trainer.config import TrainConfig
    from nightshift.trainer.run import train
    from transitions_data import row, write

    write(root / "data", [row(f"What is {i} + {i}?", f"The answer is {2 * i}.", float(i % 2), advantage=(i % 2) - 0.5,
                              group=f"q{i}") for i in range(64)])
    log(f"training {args.versions} versions (not timed)")
    paths = []
    for v in range(args.versions):
        cfg = TrainConfig()
        apply(cfg, dict(data=str(root / "data"), base_model=str(model), output=str(root / "ck"), max_steps=2,
                        batch_size=4, tensorboard=False, served_model_name=args.served_name, seed=v), "bench")
        paths.append(train(cfg, progress=False).path)
    return paths


def measure_publishes(paths: list[Path], url: str) -> list[tuple[str, float, float, float]]:
    """Per version: (version, publish s, first completion s, total s)."""
    from openai import OpenAI

    from nightshift.publish.publish import publish

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
    return rows


def report(head: list[str], args: argparse.Namespace, url: str, model: Path,
           rows: list[tuple[str, float, float, float]]) -> list[str]:
    engine = "vLLM at " + url if args.vllm_url else "nightshift serve --engine transformers (CPU stand-in)"
    med = statistics.median(r[3] for r in rows)
    return [
        *head,
        f"server: {engine}; base: {model}",
        *harness.table([(v, f"{a:.2f}", f"{b:.2f}", f"{c:.2f}") for v, a, b, c in rows],
                       header=("version", "publish s", "1st completion s", "total s")),
        f"  median checkpoint -> first completion by the new adapter: {med:.2f} s ({T_PUBLISH.check(med)})",
        "  publish = adapter checks, load, GET /v1/models, a verifying completion, registry, unloads beyond keep=2",
    ]


def main() -> int:
    args = parse_args()
    head = harness.header("nightshift publishing benchmark", args)  # before anything runs: how busy the machine was
    from nightshift.trainer.tiny import save_tiny

    with harness.temp_dir("nightshift-bench-publish-") as root:
        model = Path(args.model_dir) if args.model_dir else save_tiny(root / "tiny")
        with server(args, model) as url:
            paths = train_versions(root, model, args)
            rows = measure_publishes(paths, url)
        print("\n".join(report(head, args, url, model, rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
