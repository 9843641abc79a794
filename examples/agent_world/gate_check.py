"""The agent world's own evaluation, run by the nightly gate as `gate.command`:
fresh tasks played against the candidate *as it will be served* (loaded on the
model server under a name of its own, asked through /v1/chat/completions, the
same calls vLLM answers) beside what serves now, scored by the world's checker.
This is the check a team runs with its own agent: the gate's offline signals
guard against what logs can show; this one measures the thing users care about.

    NIGHTSHIFT_CANDIDATE=<version folder> NIGHTSHIFT_PUBLISHED=<version folder, or empty>
    python gate_check.py --server http://127.0.0.1:8000 --serving agent --base world-policy --episodes 100

It honours the gate command's statistical contract (judge/gate.py): the tasks
come from NIGHTSHIFT_GATE_SEED, and candidate and serving play the SAME tasks
with the same sampling seed for each call (common random numbers: two close
models then agree on most tasks, and the difference is measured on the few where
they do not); the verdict is a one-sided lower bound at NIGHTSHIFT_GATE_CONFIDENCE
on the paired difference in success (paired.py), which must be above
NIGHTSHIFT_GATE_MIN_EFFECT. Exit 0 passes, 1 says no, 2 when the check could not
run; the last stdout line is one JSON object with the estimate, the bound and n
(the gate keeps it in gate-log.jsonl). The candidate's name is unloaded
afterwards, whatever happened, so the server serves exactly what it served before.
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

import paired  # noqa: E402
import world  # noqa: E402


def _post(url: str, body: dict, timeout: float = 120.0) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def http_chat(server: str, model: str, seed: int, temperature: float = 1.0, system: str | None = None):
    """The agent's chat call, over HTTP (the agent program uses the openai client;
    this is the same request without it), for one episode: its k-th call samples
    with seed `seed + k`, so another model playing the same episode draws the same
    random numbers call for call. `system` replaces the system prompt the agent
    sends (what `nightshift route` does for a prompt candidate)."""
    calls = [0]

    def chat(messages: list[dict]) -> dict:
        calls[0] += 1
        if system is not None:
            messages = world.with_system(messages, system)
        r = json.loads(_post(f"{server}/v1/chat/completions", {
            "model": model, "messages": messages, "tools": world.TOOLS, "temperature": temperature,
            "max_tokens": 48, "seed": seed + calls[0]}))
        m = r["choices"][0]["message"]
        return {"content": m.get("content"), "tool_calls": [
            {"id": c["id"], "type": "function", "function": c["function"]} for c in m.get("tool_calls") or []]}

    return chat


def episode_seed(seed: int, i: int) -> int:
    """Task i's sampling seeds start here (world.MAX_CALLS apart, so no two calls share one)."""
    return (seed * 1_000_003 + i * (world.MAX_CALLS + 1)) % 2**31


def play(server: str, model: str, tasks: list[world.Task], seed: int, system: str | None = None) -> list[bool]:
    return [world.run_episode(t, http_chat(server, model, episode_seed(seed, i), system=system)).success
            for i, t in enumerate(tasks)]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        return float(raw) if raw.strip() else default
    except ValueError:
        raise SystemExit(f"{name}={raw!r} is not a number") from None


def task_seed(candidate: str) -> int:
    """The gate's NIGHTSHIFT_GATE_SEED when it sets one (the contract), else one of
    the candidate's own, so no night re-uses another night's tasks."""
    raw = os.environ.get("NIGHTSHIFT_GATE_SEED", "").strip()
    if raw.isdigit():
        return int(raw)
    return int.from_bytes(hashlib.blake2b(os.path.abspath(candidate).encode(), digest_size=4).digest(), "big")


def judge(candidate: list[bool], serving: list[bool], confidence: float, min_effect: float) -> dict:
    """The contract's answer: the paired estimate, its one-sided lower bound and n,
    and `passed` when the bound is above the minimum effect."""
    b = paired.paired_lower(candidate, serving, confidence)
    return {**b.as_dict(), "min_effect": min_effect, "passed": b.lower > min_effect,
            # the names earlier gate-log readers know
            "candidate_success": round(b.candidate, 4), "serving_success": round(b.serving, 4), "episodes": b.n}


def main() -> int:
    ap = argparse.ArgumentParser(description="Score a nightly candidate on fresh agent-world tasks through the model "
                                             "server, paired with what serves now on the same tasks; exit 0 if the "
                                             "lower confidence bound of the difference clears the minimum effect.")
    ap.add_argument("--server", required=True, help="the model server (the stand-in, or vLLM), e.g. http://127.0.0.1:8000")
    ap.add_argument("--serving", required=True, help="the stable name agents call once something is published")
    ap.add_argument("--base", required=True, help="the base model's served name (what serves before any publish)")
    ap.add_argument("--episodes", type=int, default=100, help="tasks, each played by both (default 100)")
    ap.add_argument("--confidence", type=float, default=None,
                    help="of the one-sided bound (default: NIGHTSHIFT_GATE_CONFIDENCE, else 0.95)")
    ap.add_argument("--min-effect", type=float, default=None,
                    help="the bound on candidate minus serving success must be above this (0.05: five points better; "
                         "-0.02: at most two points worse; default: NIGHTSHIFT_GATE_MIN_EFFECT, else 0)")
    args = ap.parse_args()
    if args.episodes < 1:
        ap.error("--episodes must be at least 1")
    confidence = args.confidence if args.confidence is not None else _env_float("NIGHTSHIFT_GATE_CONFIDENCE", 0.95)
    min_effect = args.min_effect if args.min_effect is not None else _env_float("NIGHTSHIFT_GATE_MIN_EFFECT", 0.0)
    if not 0.5 <= confidence < 1 or not -1 < min_effect < 1:
        ap.error(f"the confidence must be in [0.5, 1) and the minimum effect in (-1, 1): got {confidence}, {min_effect}")
    server = args.server.rstrip("/")
    candidate = os.environ.get("NIGHTSHIFT_CANDIDATE", "")
    if not candidate or not Path(candidate, "adapter_config.json").exists():
        print(json.dumps({"error": f"NIGHTSHIFT_CANDIDATE={candidate!r} is not an adapter folder"}))
        return 2
    serving = args.serving if os.environ.get("NIGHTSHIFT_PUBLISHED") else args.base
    seed = task_seed(candidate)
    rng = random.Random(seed)
    tasks = [world.make_task(rng) for _ in range(args.episodes)]
    name = f"gate-check-{Path(candidate).name}"
    t0 = time.time()
    try:
        _post(f"{server}/v1/load_lora_adapter", {"lora_name": name, "lora_path": os.path.abspath(candidate)})
        cand = play(server, name, tasks, seed)
        base = play(server, serving, tasks, seed)
    except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        return 2
    finally:
        try:
            _post(f"{server}/v1/unload_lora_adapter", {"lora_name": name})
        except (urllib.error.URLError, OSError):
            pass
    said = judge(cand, base, confidence, min_effect)
    print(json.dumps({**said, "seed": seed, "serving": serving, "seconds": round(time.time() - t0, 1)}))
    return 0 if said["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
