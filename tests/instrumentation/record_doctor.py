"""Record the runs `nightshift doctor` is tested on (tests/fixtures/doctor/<case>/).

Each case is a real agent program (`agents/`) in its side virtualenv
(`requirements/`), instrumented by a released package and configured only by
environment variables, with one first-hour mistake in them (content capture off,
no agent span, a reward the build is not told about, no LLM instrumentation
loaded, ...). It talks to the deterministic stub and exports to a real
`nightshift collect`, stopped with SIGTERM so everything is flushed; the spans/
and logs/ Parquet files are kept as the collector wrote them, with `case.json`
(what ran, with which variables, and when). Nothing in them is hand-made.

    .venv/bin/python tests/instrumentation/record_doctor.py [CASE ...]
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from conftest import CollectorProcess  # noqa: E402
from instrumentation import envs  # noqa: E402
from instrumentation.stub_openai import StubOpenAI  # noqa: E402
from test_instrumentation_live import Producer, run_agent  # noqa: E402

OUT = HERE.parent / "fixtures" / "doctor"


@dataclass(frozen=True)
class Case:
    env: str  # side virtualenv
    program: str  # agents/<program>.py
    zero_code: bool
    scenarios: tuple[str, ...]
    env_vars: dict[str, str] = field(default_factory=dict)
    mistake: str = ""


CASES: dict[str, Case] = {
    # opentelemetry-instrumentation-openai-v2 as its README installs it, the content switch never set.
    "capture_off": Case("otel_v2_4", "plain_openai", True, ("tool_loop", "tool_loop"),
                        mistake="OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT not set"),
    # Content on, but a bare call with no agent span around it, and nobody rates it.
    "no_agent": Case("otel_v2_4", "plain_openai", True, ("one_call", "one_call"),
                     {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
                     mistake="no agent span, no reward"),
    # Content on, agents named, the outcome on the root span as `episode.reward`.
    "episode_reward": Case("otel_v2_4", "episode_app", True, ("tool_loop", "three_agents"),
                           {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
                           mistake="a reward attribute the build is not told about"),
    # opentelemetry-instrument with the openai instrumentation not loaded: the agent spans
    # arrive, the LLM calls do not (what a missing instrumentation package looks like).
    "no_llm_spans": Case("otel_v2_4", "plain_openai", True, ("tool_loop",),
                         {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY",
                          "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "openai"},
                         mistake="no LLM-call instrumentation loaded"),
    # OpenInference with its privacy switches on.
    "openinference_hidden": Case("openinference_openai", "openinference_openai", False, ("tool_loop",),
                                 {"OPENINFERENCE_HIDE_INPUTS": "true", "OPENINFERENCE_HIDE_OUTPUTS": "true"},
                                 mistake="OPENINFERENCE_HIDE_INPUTS/OUTPUTS=true"),
    # OpenLLMetry (traceloop) with its content switch off.
    "traceloop_content_off": Case("traceloop_0_62", "plain_openai", True, ("tool_loop",),
                                  {"TRACELOOP_TRACE_CONTENT": "false"}, mistake="TRACELOOP_TRACE_CONTENT=false"),
    # The SDK's attribute limit (128 by default) lowered so one span overflows it, as a long
    # OpenInference conversation does: the span keeps the first attributes, drops the rest.
    "attribute_limit": Case("otel_v2_4", "plain_openai", True, ("tool_loop",),
                            {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY",
                             "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT": "6"},
                            mistake="span attributes over the SDK's limit"),
}


def record(name: str, case: Case) -> None:
    python = envs.ensure(case.env)
    producer = Producer(case.env, case.program, case.zero_code, "", case.scenarios, dict(case.env_vars))
    service = f"doctor-{name.replace('_', '-')}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        collector = CollectorProcess(data=tmp / "data", wal=tmp / "wal", log_path=tmp / "collector.log").start()
        results = []
        try:
            for scenario in case.scenarios:
                with StubOpenAI() as stub:
                    p = run_agent(producer, python, scenario, collector.http_url, stub, service)
                if p.returncode != 0:
                    raise SystemExit(f"{name}/{scenario}: agent failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
                results.append({"scenario": scenario, "result": json.loads(p.stdout.strip().splitlines()[-1]),
                                "stub_calls": len(stub.calls)})
        finally:
            rc = collector.stop()
        if rc != 0:
            raise SystemExit(f"{name}: collector exited {rc}:\n{collector.log_tail()}")
        dest = OUT / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for dataset in ("spans", "logs"):
            if (tmp / "data" / dataset).exists():
                shutil.copytree(tmp / "data" / dataset, dest / dataset)
        (dest / "case.json").write_text(json.dumps({
            **asdict(case), "service": service, "runs": results, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "pins": f"tests/instrumentation/requirements/{case.env}.txt",
        }, indent=1) + "\n")
        print(f"{name}: {sum(r['stub_calls'] for r in results)} calls -> {dest}")


if __name__ == "__main__":
    for n in sys.argv[1:] or CASES:
        record(n, CASES[n])
