"""Attribution measured on real instrumentations (issue 27, item 5): real agent
programs (`tests/instrumentation/agents/`, each in its side virtualenv) call the
model through a real `nightshift route` holding a prompt route, their spans go to a
real collector, `nightshift build` runs, and every call's transition must say which
prompt the model saw: `prompt_seen` is the candidate's version exactly for the calls
whose request reached the upstream with the candidate's text (what the upstream
received is the truth), null for the others. The upstream is the deterministic
OpenAI-compatible stand-in of the live tests (named as such) and, for one run, the
real `nightshift serve` stand-in with a tiny model.

None of these agents is told anything about the route: the mark rides on the
answer's `model`, which each instrumentation records on its own span, so it holds
whether the client sends a `traceparent` (zero-code runs instrument httpx too) or
not (OpenInference's openai instrumentor alone sends none): both are counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import polars as pl
import pytest

from conftest import CollectorProcess
from instrumentation import envs
from instrumentation.stub_openai import StubOpenAI
from nightshift.schemas.prompt_identity import canonical_tools, system_id, version_id
from test_instrumentation_live import AGENTS, PRODUCERS, build
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)

pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

SYSTEM = "You are a helpful assistant. Answer briefly."  # scenarios.SYSTEM: one_call's and tool_loop's prompt
CANDIDATE = "You are a helpful assistant. Answer briefly, and name your source."
WRITER = "You write a short paragraph on the topic you are given."  # three_agents' first agent, not routed
#: openai-v2, OpenInference's openai instrumentor, OpenLLMetry; NIGHTSHIFT_ATTRIBUTION_ALL=1 adds openai-v2's
#: event-only generation (2.3b0) and OpenLLMetry 0.52 (measured: 26 of 26 calls right with all five);
#: NIGHTSHIFT_ATTRIBUTION_PRODUCERS=a,b measures others (docs/prompts.md: which record no response model)
MEASURED = tuple(filter(None, os.environ.get("NIGHTSHIFT_ATTRIBUTION_PRODUCERS", "").split(","))) or (
    ("otel_v2_4_span", "openinference_openai", "traceloop_0_62") + (
        ("otel_v2_3", "traceloop_0_52") if os.environ.get("NIGHTSHIFT_ATTRIBUTION_ALL") else ()))


def _run(producer: str, python, scenario: str, endpoint: str, base_url: str, service: str, model: str = "gpt-4o-mini"):
    p = PRODUCERS[producer]
    drop = ("OTEL_", "OPENAI_", "TRACELOOP_", "LOGFIRE_", "OPENINFERENCE_", "PYTHON", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": service,
                "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_BLRP_SCHEDULE_DELAY": "100", "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": "sk-live-agent-key", "AGENT_MODEL": model, **p.env_vars})
    cmd = [str(python), str(AGENTS / f"{p.program}.py"), scenario]
    if p.zero_code:
        cmd = [str(python.parent / p.launcher), *cmd]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(AGENTS))
    assert done.returncode == 0, f"{producer} {scenario}: {done.stdout}\n{done.stderr}"


def _expected(requests: list[dict]) -> Counter:
    """What each call's transition must carry: the candidate's version when the upstream
    received its text, else nothing."""
    out = Counter()
    for req in requests:
        system = [m["content"] for m in req["messages"] if m.get("role") == "system"][:1]
        out[version_id([CANDIDATE], canonical_tools(req.get("tools"))) if system == [CANDIDATE] else None] += 1
    return out


def test_every_call_carries_the_prompt_the_model_saw_across_instrumentations(tmp_path, route_factory,  # noqa: F811
                                                                            serve_factory):
    pythons = envs.ensure_all(sorted({PRODUCERS[p].env for p in MEASURED} | {PRODUCERS["otel_v2_4_span"].env}))
    collector = CollectorProcess(data=tmp_path / "data", wal=tmp_path / "wal", log_path=tmp_path / "collector.log").start()
    stub = StubOpenAI().start()
    serve = serve_factory().start()
    routes = {"stub": route_factory(stub.base_url[:-3]).start(),
              "serve": route_factory(serve.url, state=tmp_path / "serve-routes.json").start()}
    for r in routes.values():
        r.put(f"prompt:{system_id([SYSTEM])}", kind="prompt", candidate=system_id([CANDIDATE]), system=CANDIDATE,
              share=1.0, agent="assistant", model="gpt-4o-mini")
    expected: dict[str, Counter] = {}
    try:
        for producer in MEASURED:
            for scenario in ("tool_loop", "three_agents"):
                service = f"{producer}-{scenario}"
                before = len(stub.calls)
                _run(producer, pythons[PRODUCERS[producer].env], scenario, collector.http_url,
                     routes["stub"].url + "/v1", service)
                expected[service] = _expected([c["request"] for c in stub.calls[before:]])
        # the real serving stand-in, with openai-v2: its answer's model marked as the stub's was
        _run("otel_v2_4_span", pythons[PRODUCERS["otel_v2_4_span"].env], "one_call", collector.http_url,
             routes["serve"].url + "/v1", "serve-one_call", model="tiny")
        expected["serve-one_call"] = Counter({version_id([CANDIDATE], []): 1})
        assert collector.stop() == 0
    finally:
        stub.stop()
    rows = build(collector.data)
    report = {}
    for service, want in expected.items():
        got = Counter(rows.filter(pl.col("service_name") == service)["prompt_seen"].to_list())
        report[service] = (dict(want), dict(got))
        assert got == want, f"{service}: expected {want}, the build says {got}"
    rewritten = sum(n for w in expected.values() for v, n in w.items() if v)
    assert rewritten >= 2 * len(MEASURED) and sum(n for w in expected.values() for v, n in w.items() if v is None) >= 3 * len(MEASURED)
    # the marks came off the names: the served model reads as it was asked
    assert not rows.filter(pl.col("response_model").str.contains(r"\+p:", literal=True)).height
    keys = Counter()
    for r in routes.values():
        for kind in ("trace", "conversation"):
            keys[kind] += r.metric("nightshift_route_prompt_decisions_total", key=kind)
    if not os.environ.get("NIGHTSHIFT_ATTRIBUTION_PRODUCERS"):  # the default set has both kinds of client
        assert keys["trace"] > 0 and keys["conversation"] > 0, keys  # with and without a traceparent
    print(json.dumps({"calls_by_service": {s: [sum(w.values())] for s, (w, _) in report.items()},
                      "rewritten": rewritten, "sticky_keys": dict(keys)}), file=sys.stderr)
