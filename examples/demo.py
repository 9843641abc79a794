"""`make demo`: the whole promise on a laptop, no GPU. An unmodified agent runs, its
spans flow in through one environment variable, rewards arrive (some on the
spans, some later as feedback), a nightly cycle builds, trains, gates and
publishes, and the same agent, on fresh tasks, gets better.

    1. the behaviour policy: a tiny model taught the agent world (examples/agent_world)
       so that it picks the right tool only part of the time (built once, then cached)
    2. the collector and the model server start
    3. the agent runs episodes through them (OTEL_EXPORTER_OTLP_ENDPOINT, OPENAI_BASE_URL)
    4. feedback for half of them is posted afterwards
    5. nightshift nightly: build -> train -> gate -> publish, and the gate's signals
       (its offline checks, then the world's checker as gate.command: fresh tasks
       against the candidate as the server serves it, beside what serves now)
    6. the agent runs fresh episodes against the published adapter (logged too)
       5-6 again for DEMO_NIGHTS nights (2), each training on all logs so far
    7. success before and after each night, the report and its plot
    8. with DEMO_APO=1: prompt optimization, as for an agent on a hosted model (no
       weight training): the agent reaches a prompt-sensitive policy through
       `nightshift route`; `nightshift nightly` (experiments: prompts) reads its failed
       episodes, asks the STAND-IN proposer (tests/support/proposer_standin.py: it derives
       edits only from what it is sent and knows no task of the world) for an edited
       prompt and tries it on half the conversations; a second night's watch judges it;
       the base prompt, the candidate and a placebo line are scored on the same episodes.
       Off by default: its first run builds a second policy (about 15 minutes on 2 busy
       cores, cached after), and the step adds about 6 minutes with DEMO_EPISODES=40 on
       a busy machine (docs/prompts.md)

Embedded defaults only: local folders under ./nightshift-data, CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "agent_world"))

DATA = Path(os.environ.get("NIGHTSHIFT_DATA", "./nightshift-data")).resolve()
EPISODES = int(os.environ.get("DEMO_EPISODES", "200"))
NIGHTS = int(os.environ.get("DEMO_NIGHTS", "2"))
#: fresh tasks the world's checker plays against each candidate (the gate's `command`); 0 turns it off
CHECK_EPISODES = int(os.environ.get("DEMO_CHECK_EPISODES", "100"))
#: step 8, prompt optimization against the stand-in proposer (1: on)
APO = os.environ.get("DEMO_APO", "0") == "1"
#: what the placebo appends: the stand-in's frame, nothing the world's tasks need
PLACEBO = "Earlier conversations went wrong with: replies that were worded more formally than users like. Make sure " \
          "this does not happen."


def say(step: str) -> None:
    print(f"\n[{time.strftime('%H:%M:%S')}] {step}", flush=True)


SETTINGS = """environment:
  NIGHTSHIFT_DATA       where everything goes (default ./nightshift-data)
  DEMO_EPISODES         episodes per run of the agent (default 200)
  DEMO_NIGHTS           nightly cycles (default 2)
  DEMO_CHECK_EPISODES   fresh tasks the gate's checker plays per candidate (default 100; 0: off)
  DEMO_APO              1: step 8, prompt optimization through nightshift route (default 0)
  DEMO_POLICY_DIR       where the behaviour policy is cached (default <data>/models/world-policy)
  DEMO_AGENT_VENV       the agent's own virtualenv (default .venv-agent), or
  DEMO_AGENT_PYTHON     an interpreter that already has openai + the instrumentation"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Only --help: the demo's knobs are environment variables (as in `make demo`),
    and anything else is refused before a model, a collector or a server starts."""
    doc = (__doc__ or "").strip()
    p = argparse.ArgumentParser(prog="demo.py", description=doc, epilog=SETTINGS,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    return p.parse_args(argv)


def main() -> int:
    parse_args()
    import loop
    import policy

    t0 = time.time()
    logs = DATA / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    say("1/7 the behaviour policy: a tiny model built from a config and taught the agent world by SFT "
        "(cached after the first run)")
    model = policy.build(Path(os.environ.get("DEMO_POLICY_DIR") or DATA / "models" / "world-policy"), progress=True)
    print(f"    {model}")
    say("    the agent's own virtualenv: openai + opentelemetry-instrumentation-openai-v2, nothing of Nightshift")
    python = (Path(os.environ["DEMO_AGENT_PYTHON"]) if os.environ.get("DEMO_AGENT_PYTHON")
              else loop.agent_python(Path(os.environ.get("DEMO_AGENT_VENV", ".venv-agent")).resolve()))
    say("2/7 starting `nightshift collect` and `nightshift serve --engine transformers` (the CPU stand-in for vLLM)")
    collector = loop.start_collector(DATA, logs)
    server = loop.start_server(model, "world-policy", logs)
    print(f"    collector {collector.url}, model server {server.url}/v1")
    after: list[list[dict]] = []
    try:
        say(f"3/7 the agent runs {EPISODES} episodes: opentelemetry-instrument python agent.py "
            f"(OTEL_EXPORTER_OTLP_ENDPOINT={collector.url}, AGENT_MODEL=world-policy)")
        before = loop.run_agent(python, collector, server, "world-policy", EPISODES, seed=1, logs=logs)
        print(f"    success: {loop.success(before):.0%} ({sum(r['success'] for r in before)}/{len(before)})")
        say("4/7 rewards: half were recorded on the agent's spans (episode.reward); the rest arrive now as feedback")
        print(f"    POST /v1/feedback: {loop.post_feedback(collector, before)} labels accepted")
        say("    the collector drains and flushes on SIGTERM (every acknowledged span reaches Parquet)")
        collector.stop()
        cfg = loop.nightly_config(DATA / "demo.yaml", DATA, model, DATA / "checkpoints", server,
                                  nightly={"train_window_days": 3650}, checker_episodes=CHECK_EPISODES)
        for night in range(1, NIGHTS + 1):
            say(f"5/7 night {night}: nightshift nightly --config nightshift-data/demo.yaml: "
                "build -> train (all logs so far) -> gate -> publish")
            rc = subprocess.call([sys.executable, "-m", "nightshift.cli", "nightly", "--config", str(cfg)])
            if rc != 0:
                print(f"nightshift nightly exited {rc}; see above", file=sys.stderr)
                return rc
            state = json.loads((DATA / "checkpoints" / ".nightly" / "state.json").read_text())
            print("\n".join(f"    {line}" for line in state.get("gate_lines") or []))
            serving = (DATA / "checkpoints" / "published.json").exists()
            name = "agent" if serving else "world-policy"
            collector = loop.start_collector(DATA, logs)
            say(f"6/7 night {night}: the same agent, {EPISODES} fresh episodes, AGENT_MODEL={name} "
                f"({'the published adapter' if serving else 'nothing published yet'}); their calls are logged too")
            after.append(loop.run_agent(python, collector, server, name, EPISODES, seed=1 + night, logs=logs))
            print(f"    success: {loop.success(after[-1]):.0%}")
            loop.post_feedback(collector, after[-1])
            collector.stop()
    finally:
        collector.stop()
        server.stop()
    say("7/7 result")
    print(f"    success before: {loop.success(before):.0%}   after one nightly cycle: {loop.success(after[0]):.0%}")
    for night, res in enumerate(after[1:], start=2):
        print(f"    after night {night}: {loop.success(res):.0%}")
    reports = DATA / "checkpoints" / "reports"
    print(f"    report: {reports / 'latest.md'}  plot: {reports / 'latest.png'}")
    if APO:
        rc = prompt_optimization(python, logs)
        if rc:
            return rc
    print(f"    ({time.time() - t0:.0f} s in all; logs under {logs})")
    return 0


def _nightly(cfg: Path) -> dict | None:
    # the settings file names this step's own data folder: NIGHTSHIFT_DATA (the demo's) would override it
    env = {k: v for k, v in os.environ.items() if k != "NIGHTSHIFT_DATA"}
    rc = subprocess.call([sys.executable, "-m", "nightshift.cli", "nightly", "--config", str(cfg), "--quiet"], env=env)
    if rc != 0:
        print(f"nightshift nightly exited {rc}; see above", file=sys.stderr)
        return None
    return json.loads((cfg.parent / "checkpoints" / ".nightly" / "state.json").read_text())


def prompt_optimization(python: Path, logs: Path) -> int:
    """Step 8: two nights of prompt optimization only, on their own data folder."""
    import counterfactual
    import evaluate
    import loop

    sys.path.insert(0, str(HERE.parent / "tests"))
    from support.proposer_standin import Standin

    say("8/8 prompt optimization (DEMO_APO=1), as for an agent on a hosted model: the prompt-sensitive policy "
        "(instruction-tuned on top of the behaviour policy, then taught on counterfactual twins so that "
        "it reads what a prompt says, not how long it is; built once, then cached)")
    spec = counterfactual.PROMPT_SENSITIVE  # reads what a prompt says, not how long it is
    model = counterfactual.build(Path(os.environ.get("DEMO_POLICY_DIR") or DATA / "models" / "world-policy").parent
                                 / f"world-counterfactual-{spec.key()}", spec, progress=True)
    data = DATA / "apo"
    data.mkdir(parents=True, exist_ok=True)
    server = loop.start_server(model, "world-policy", logs)
    route = loop.start_route(server, logs, data / "routes.json")
    try:
        with Standin() as proposer:
            print(f"    nightshift route {route.url} in front of the model server; the STAND-IN proposer {proposer.url}"
                  " (derives edits only from the failures it is sent; knows no task of the world)")
            cfg = loop.nightly_config(data / "demo-apo.yaml", data, model, data / "checkpoints", server,
                                      nightly={"train_window_days": 3650, "experiments": "prompts",
                                               "canary": {"route_url": route.url}, "prompts": {"share": 0.5}},
                                      apo={"base_url": proposer.url, "model": "standin", "candidates": 1})
            for night in (1, 2):
                collector = loop.start_collector(data, logs)
                res = loop.run_agent(python, collector, route, "world-policy", EPISODES, seed=20 + night, logs=logs)
                loop.post_feedback(collector, res)
                collector.stop()
                print(f"    the agent through the route, {EPISODES} episodes: {loop.success(res):.0%}"
                      + (" (half its conversations under the candidate prompt)" if night == 2 else ""))
                say(f"    night {night}: nightshift nightly --config {data / 'demo-apo.yaml'} (experiments: prompts)")
                state = _nightly(cfg)
                if state is None:
                    return 1
                print("\n".join(f"    {x}" for x in [*(state.get("prompt_watch") or []), *(state.get("prompts") or [])]))
        from nightshift.publish import prompt_canary as trials

        started = [e for e in trials.read(str(data / "prompt-candidates")) if e["role"] == "canary"]
        if not started:
            print("    no prompt candidate was started; see the lines above")
            return 0
        system = json.loads((Path(started[0]["path"]) / "manifest.json").read_text())["candidate"]["system"]
        system = system[0] if isinstance(system, list) else system
        print("    the candidate prompt:\n" + "\n".join(f"      {x}" for x in system.splitlines()))
        say(f"    scored in process on the same {EPISODES} fresh episodes: the base prompt, the candidate, and a "
            "placebo (the base prompt plus a line in the proposer's frame that says nothing the tasks need)")
        import world

        for what, text in (("base prompt", None), ("candidate", system), ("placebo", world.SYSTEM + "\n" + PLACEBO)):
            sc = evaluate.score(str(model), None, EPISODES, seed=4242, system=text)
            print(f"    {what:12} {sc.rate:.0%}")
    finally:
        route.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
