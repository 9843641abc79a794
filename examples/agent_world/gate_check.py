"""The agent world's own evaluation, run by the nightly gate as `gate.command`:
fresh tasks played against the candidate *as it will be served* (loaded on the
model server under a name of its own, asked through /v1/chat/completions, the
same calls vLLM answers) beside what serves now, on the same tasks, scored by
the world's checker. This is the check a team runs with its own agent: the
gate's offline signals guard against what logs can show; this one measures the
thing users care about.

    NIGHTSHIFT_CANDIDATE=<version folder> NIGHTSHIFT_PUBLISHED=<version folder, or empty>
    python gate_check.py --server http://127.0.0.1:8000 --serving agent --base world-policy --episodes 100

Exit 0 when the candidate's success is at least what serves minus --margin,
1 when it is not, 2 when the check could not run; the last stdout line is one
JSON object (the gate keeps it in gate-log.jsonl). The candidate's name is
unloaded afterwards, whatever happened, so the server serves exactly what it
served before.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import world  # noqa: E402


def _post(url: str, body: dict, timeout: float = 120.0) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def http_chat(server: str, model: str, temperature: float = 1.0):
    """The agent's chat call, over HTTP (the agent program uses the openai client;
    this is the same request without it)."""

    def chat(messages: list[dict]) -> dict:
        r = json.loads(_post(f"{server}/v1/chat/completions", {
            "model": model, "messages": messages, "tools": world.TOOLS, "temperature": temperature,
            "max_tokens": 48}))
        m = r["choices"][0]["message"]
        return {"content": m.get("content"), "tool_calls": [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in m.get("tool_calls") or []]}

    return chat


def play(server: str, model: str, tasks: list[world.Task]) -> list[bool]:
    chat = http_chat(server, model)
    return [world.run_episode(t, chat).success for t in tasks]


def main() -> int:
    ap = argparse.ArgumentParser(description="Score a nightly candidate on fresh agent-world tasks through the model "
                                             "server, against what serves now; exit 0 if it is no worse.")
    ap.add_argument("--server", required=True, help="the model server (the stand-in, or vLLM), e.g. http://127.0.0.1:8000")
    ap.add_argument("--serving", required=True, help="the stable name agents call once something is published")
    ap.add_argument("--base", required=True, help="the base model's served name (what serves before any publish)")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--margin", type=float, default=0.0, help="how far below what serves the candidate may score")
    args = ap.parse_args()
    if args.episodes < 1:
        ap.error("--episodes must be at least 1")
    server = args.server.rstrip("/")
    candidate = os.environ.get("NIGHTSHIFT_CANDIDATE", "")
    if not candidate or not Path(candidate, "adapter_config.json").exists():
        print(json.dumps({"error": f"NIGHTSHIFT_CANDIDATE={candidate!r} is not an adapter folder"}))
        return 2
    serving = args.serving if os.environ.get("NIGHTSHIFT_PUBLISHED") else args.base
    # fresh tasks: a seed of the candidate's own, so no night re-uses another's tasks
    seed = int.from_bytes(hashlib.blake2b(os.path.abspath(candidate).encode(), digest_size=4).digest(), "big")
    rng = random.Random(seed)
    tasks = [world.make_task(rng) for _ in range(args.episodes)]
    name = f"gate-check-{Path(candidate).name}"
    t0 = time.time()
    try:
        _post(f"{server}/v1/load_lora_adapter", {"lora_name": name, "lora_path": os.path.abspath(candidate)})
        cand = play(server, name, tasks)
        base = play(server, serving, tasks)
    except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 2
    finally:
        try:
            _post(f"{server}/v1/unload_lora_adapter", {"lora_name": name})
        except (urllib.error.URLError, OSError):
            pass
    c, s = sum(cand) / len(tasks), sum(base) / len(tasks)
    passed = c >= s - args.margin
    print(json.dumps({"candidate_success": round(c, 4), "serving_success": round(s, 4), "serving": serving,
                      "episodes": len(tasks), "margin": args.margin, "passed": passed,
                      "seconds": round(time.time() - t0, 1)}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
