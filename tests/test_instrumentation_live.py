"""Live spans from the real instrumentation packages, end to end.

Each case runs a real agent program (`tests/instrumentation/agents/`) in its own
side virtualenv (`tests/instrumentation/envs.py`): the real `openai` client (or
the OpenAI Agents SDK) instrumented by one package, talking to a deterministic
OpenAI-compatible stub on loopback, exporting over OTLP/HTTP, configured only by
OTEL_* variables (plus each package's content switch), to a real collector. All
cases share one collector, as a sidecar serves many agents, and run a few at a time;
each has its own stub and service name. Then `nightshift build` runs once, as users
run it, and each case's transitions are checked against
what the stub really received and answered: one row per LLM call, the convention,
the input messages in order (tool calls and the tool result's call id), the output
(text or tool call), the tools offered, model, tokens, agent, finish reason, and
one trajectory with steps 0..n-1.

A side environment that cannot be installed fails its tests with the installer's
output; nothing here is skipped. Known gaps of the transform on a producer's real
output are listed in KNOWN_GAPS: such a case ends as an explicit xfail naming the
gap (and fails once the gap is closed, so the entry gets removed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pytest

from conftest import CollectorProcess, read_logs, read_spans
from instrumentation import envs
from instrumentation.stub_openai import TOOL_ARGUMENTS, StubOpenAI

# The first test waits for the side environments (about a minute from nothing) and every run.
pytestmark = [pytest.mark.live, pytest.mark.timeout(900)]

AGENTS = Path(__file__).parent / "instrumentation" / "agents"
ROOT = Path(__file__).parent.parent
TOOL_NAME = "get_weather"


@dataclass(frozen=True)
class Producer:
    env: str  # side virtualenv (requirements/<env>.txt)
    program: str  # agents/<program>.py
    zero_code: bool  # run under `opentelemetry-instrument` (or `launcher`)
    convention: str  # expected `convention` column
    scenarios: tuple[str, ...]
    env_vars: dict[str, str] = field(default_factory=dict)
    records_tools: bool = True  # the package records the tools offered
    model_from: str = "response"  # which model name the package records: response, request, none (neither)
    agents: dict[str, list[str | None]] = field(default_factory=dict)  # scenario -> agent per call
    flags: tuple[str, ...] = ()  # flags every row of this producer must carry
    launcher: str = "opentelemetry-instrument"  # the zero-code wrapper


ALL = ("one_call", "tool_loop", "three_agents")
PLAIN_AGENTS = {"one_call": [None], "tool_loop": ["weather_agent"] * 2, "three_agents": ["writer", "checker", "rewriter"]}
SDK_AGENTS = {"one_call": ["greeter"], "tool_loop": ["weather_agent"] * 2, "three_agents": ["writer", "checker", "rewriter"]}

PRODUCERS: dict[str, Producer] = {
    # opentelemetry-instrumentation-openai-v2 2.3b0: content only in per-message OTLP log events.
    "otel_v2_3": Producer("otel_v2_3", "plain_openai", True, "otel_genai_events_legacy", ALL,
                          {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "true"},
                          records_tools=False, agents=PLAIN_AGENTS),
    # 2.4b0 + util-genai 1.1b0: GenAI JSON attributes on the span.
    "otel_v2_4_span": Producer("otel_v2_4", "plain_openai", True, "otel_genai", ALL,
                               {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "SPAN_ONLY"},
                               records_tools=False, agents=PLAIN_AGENTS),
    # ... or only in the `gen_ai.client.inference.operation.details` log event.
    "otel_v2_4_event": Producer("otel_v2_4", "plain_openai", True, "otel_genai_event", ("tool_loop",),
                                {"OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT": "EVENT_ONLY"},
                                records_tools=False, agents=PLAIN_AGENTS),
    "openinference_openai": Producer("openinference_openai", "openinference_openai", False, "openinference", ALL,
                                     agents=PLAIN_AGENTS),
    "traceloop_0_62": Producer("traceloop_0_62", "plain_openai", True, "otel_genai", ALL, agents=PLAIN_AGENTS),
    "traceloop_0_52": Producer("traceloop_0_52", "plain_openai", True, "openllmetry_legacy", ("one_call", "tool_loop"),
                               agents=PLAIN_AGENTS),
    "logfire": Producer("logfire", "logfire_openai", False, "otel_genai", ("tool_loop", "three_agents"),
                        agents=PLAIN_AGENTS),
    # OpenInference's Agents-SDK bridge: `generation` spans record neither the tools
    # offered nor the response model.
    "openai_agents": Producer("openai_agents_openinference", "openai_agents_app", False, "openinference", ALL,
                              records_tools=False, model_from="request", agents=SDK_AGENTS,
                              flags=("finish_reason_inferred",)),
    # The same with the openai client instrumented too: every call recorded twice, a
    # `ChatCompletion` span inside each `generation` span; the inner one must win.
    # --- agent frameworks (issue 15): each call's agent is the name the program gave it ---
    # OpenInference's AutoGen instrumentor alone records AutoGen's objects, not the request (gaps below).
    "autogen_oi": Producer("autogen_openinference", "autogen_app", False, "openinference", ("assistant", "roundrobin"),
                           {"AUTOGEN_INSTRUMENT": "autogen"}, records_tools=False, model_from="none"),
    # ... with the openai client instrumented too: each call twice, nested; the client span wins.
    "autogen_oi_openai": Producer("autogen_openinference_openai", "autogen_app", False, "openinference",
                                  ("assistant", "roundrobin"), {"AUTOGEN_INSTRUMENT": "autogen,openai"}),
    # AutoGen's own GenAI agent spans, the calls from the openai instrumentor.
    "autogen_genai": Producer("autogen_genai_openai", "autogen_app", False, "openinference", ("assistant", "roundrobin"),
                              {"AUTOGEN_INSTRUMENT": "openai"}),
    "crewai_oi": Producer("crewai_openinference", "crewai_app", False, "openinference", ("crew", "tool"),
                          {"CREWAI_INSTRUMENT": "openinference"}),
    # OpenInference's event-listener mode: the client span is the root of a trace of its own.
    "crewai_oi_events": Producer("crewai_openinference", "crewai_app", False, "openinference", ("crew", "tool"),
                                 {"CREWAI_INSTRUMENT": "openinference", "CREWAI_OI_EVENT_LISTENER": "1"}),
    "crewai_openllmetry": Producer("crewai_openllmetry", "crewai_app", False, "otel_genai", ("crew", "tool"),
                                   {"CREWAI_INSTRUMENT": "openllmetry"}),
    # LangGraph on langchain-openai, zero-code (`opentelemetry-instrument` loads the `langchain` entry point,
    # and the `openai` one where installed): each call's agent is the graph node, or create_react_agent's name.
    "langgraph_oi": Producer("langgraph_openinference", "langgraph_app", True, "openinference",
                             ("graph", "react", "react_unnamed", "create_agent")),
    "langgraph_oi_openai": Producer("langgraph_openinference_openai", "langgraph_app", True, "openinference",
                                    ("graph", "react")),
    "langgraph_openllmetry": Producer("langgraph_openllmetry", "langgraph_app", True, "otel_genai",
                                      ("graph", "react", "react_unnamed", "create_agent")),
    "langgraph_openllmetry_openai": Producer("langgraph_openllmetry_openai", "langgraph_app", True, "otel_genai",
                                             ("graph", "react")),
    # pydantic-ai's own instrumentation (`Agent.instrument_all()`), and through logfire.
    "pydantic_ai": Producer("pydantic_ai", "pydantic_ai_app", False, "otel_genai", ("tool", "three_agents"),
                            {"PYDANTIC_AI_INSTRUMENT": "builtin"}),
    "pydantic_ai_logfire": Producer("pydantic_ai_logfire", "pydantic_ai_app", False, "otel_genai", ("tool", "three_agents"),
                                    {"PYDANTIC_AI_INSTRUMENT": "logfire"}),
    # LlamaIndex FunctionAgents (streamed and not) with OpenInference's instrumentor, which
    # records only the requested model.
    "llamaindex": Producer("llamaindex_openinference", "llamaindex_app", False, "openinference",
                           ("function_agent", "function_agent_nostream"), model_from="request"),
    # OpenLIT's zero-code launcher on the plain client.
    "openlit": Producer("openlit", "plain_openai", True, "otel_genai", ALL, agents=PLAIN_AGENTS,
                        launcher="openlit-instrument"),
    # The Agents SDK through OpenTelemetry's own openai-agents-v2 bridge, span-only content.
    # Its chat spans record neither the response's model, nor finish reasons, nor the tools offered.
    "openai_agents_otel": Producer("openai_agents_otel_v2", "openai_agents_otel_app", False, "otel_genai", ALL,
                                   records_tools=False, model_from="request", agents=SDK_AGENTS,
                                   flags=("finish_reason_inferred",)),
    "openai_agents_double": Producer("openai_agents_openinference", "openai_agents_app", False, "openinference",
                                     ("tool_loop", "three_agents"), {"ALSO_INSTRUMENT_OPENAI": "1"},
                                     agents=SDK_AGENTS),
}

#: (producer, scenario or "*") -> {checked field: why the transform gets it wrong}.
#: Empty: the openai-agents `generation` spans' missing finish reason is now inferred
#: from the output message (and flagged `finish_reason_inferred`).
KNOWN_GAPS: dict[tuple[str, str], dict[str, str]] = {
    ("autogen_oi", "*"): {
        "provider": "OpenInference's AutoGen spans name no provider",
        "request_model": "llm.model_name is AutoGen's own lookup of the requested model (gpt-4o -> gpt-4o-2024-08-06), "
                         "neither the request's nor the response's: left null",
    },
    ("llamaindex", "*"): {
        "agent_name": "LlamaIndex records the agent's name only as text (current_agent_name='...') in a parent "
                      "span's input.value, in no attribute: left null",
    },
    ("llamaindex", "function_agent"): {
        "input_tokens": "a streamed answer carries no usage unless the client asks (stream_options.include_usage); "
                        "LlamaIndex does not",
        "output_tokens": "as input_tokens",
    },
    ("openlit", "tool_loop"): {
        "flags": "OpenLIT leaves the assistant's tool-call turn out of the next call's history: rebuilt, flagged "
                 "history_rebuilt",
    },
    ("autogen_genai", "roundrobin"): {
        "trajectories": "without a span around team.run(), AutoGen starts a trace per runtime message; "
                        "`transform.trajectory: linked` joins them (tests/test_framework_recordings.py)",
        "trace": "as trajectories", "steps": "as trajectories", "num_steps": "as trajectories",
    },
}

CASES = [(p, s) for p, prod in PRODUCERS.items() for s in prod.scenarios]


def _text(content) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _json(text):
    return json.loads(text) if isinstance(text, str) else text


def run_agent(producer: Producer, python: Path, scenario: str, endpoint: str, stub: StubOpenAI,
              service: str) -> subprocess.CompletedProcess:
    drop = ("OTEL_", "OPENAI_", "TRACELOOP_", "LOGFIRE_", "OPENINFERENCE_", "PYTHON", "VIRTUAL_ENV", "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({
        "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": service,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_BLRP_SCHEDULE_DELAY": "100",
        "OPENAI_BASE_URL": stub.base_url,
        "OPENAI_API_KEY": "sk-live-test",
        **producer.env_vars,
    })
    cmd = [str(python), str(AGENTS / f"{producer.program}.py"), scenario]
    if producer.zero_code:
        cmd = [str(python.parent / producer.launcher), *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=str(AGENTS))


def build(data: Path) -> pl.DataFrame:
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(data), "--settle", "0", "--quiet"],
                       capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert p.returncode == 0, f"nightshift build failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    files = list((data / "transitions").glob("**/*.parquet"))
    assert files, f"nightshift build wrote no transitions:\n{p.stdout}\n{p.stderr}"
    return pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"), hive_partitioning=True)


def dump(data: Path, service: str) -> str:
    """One case's spans (attributes, events) and log records, for the failure report."""
    from nightshift.transform.attrs import to_dicts

    lines = []
    spans = read_spans(data)
    if spans.height:
        spans = spans.filter(pl.col("service_name") == service).sort("start_time")
        for row, attrs in zip(spans.iter_rows(named=True), to_dicts(spans["attributes"].to_arrow())):
            lines.append(f"SPAN {row['name']!r} kind={row['kind']} id={row['span_id']} parent={row['parent_span_id']} "
                         f"scope={row['scope_name']} dropped_attrs={row['dropped_attributes_count']}")
            lines += [f"    {k} = {v!r}" for k, v in sorted(attrs.items())]
            for ev in row["events"] or []:
                lines.append(f"    EVENT {ev['name']}")
    logs = read_logs(data)
    if logs.height:
        logs = logs.filter(pl.col("service_name") == service).sort("time")
        for row, attrs in zip(logs.iter_rows(named=True), to_dicts(logs["attributes"].to_arrow())):
            body = row["body"] or {}
            lines.append(f"LOG {row['event_name']} span={row['span_id']} body={body.get('json_value') or body.get('string_value')!r} attrs={attrs}")
    return "\n".join(lines)


class Checks:
    """Collects failed checks by field, so one run reports every mismatch and known
    gaps can be told apart from new failures."""

    def __init__(self):
        self.failures: dict[str, list[str]] = {}

    def eq(self, what: str, got, want, where: str = "") -> None:
        if got != want:
            self.failures.setdefault(what, []).append(f"{where}{what}: got {got!r}, want {want!r}")

    def true(self, what: str, ok: bool, msg: str) -> None:
        if not ok:
            self.failures.setdefault(what, []).append(msg)


def check_rows(df: pl.DataFrame, calls: list[dict], producer: Producer, scenario: str, service: str,
               agents: list[str | None] | None = None) -> Checks:
    """`agents`: the agent of each call as the program named it (framework programs
    report it), when the producer does not list it."""
    c = Checks()
    c.eq("rows", df.height, len(calls))
    if df.height != len(calls):
        return c
    df = df.sort("step")
    c.eq("trajectories", df["trajectory_id"].n_unique(), 1)
    c.eq("trace", df["trace_id"].n_unique(), 1)
    c.eq("steps", df["step"].to_list(), list(range(len(calls))))
    c.eq("num_steps", df["num_steps"].to_list(), [len(calls)] * len(calls))
    c.eq("agent_name", df["agent_name"].to_list(), producer.agents[scenario] if scenario in producer.agents else agents)
    for i, (row, call) in enumerate(zip(df.iter_rows(named=True), calls)):
        at = f"call {i}: "
        req, resp = call["request"], call["response"]
        choice = resp["choices"][0]
        c.eq("convention", row["convention"], producer.convention, at)
        c.eq("service_name", row["service_name"], service, at)
        c.eq("provider", row["provider"], "openai", at)
        if producer.model_from != "none":
            c.eq("model", row["model"], resp["model"] if producer.model_from == "response" else req["model"], at)
        c.eq("request_model", row["request_model"], req["model"], at)
        c.eq("response_model", row["response_model"], resp["model"] if producer.model_from == "response" else None, at)
        c.eq("input_tokens", row["input_tokens"], resp["usage"]["prompt_tokens"], at)
        c.eq("output_tokens", row["output_tokens"], resp["usage"]["completion_tokens"], at)
        c.eq("finish_reason", row["finish_reason"], {"tool_calls": "tool_call"}.get(choice["finish_reason"], choice["finish_reason"]), at)
        c.eq("flags", row["flags"], list(producer.flags), at)
        c.eq("truncated", row["truncated"], False, at)

        # State: the messages sent, in order, with their tool calls and tool-call ids.
        got_in = row["input_messages"] or []
        c.eq("input_roles", [m["role"] for m in got_in], [m["role"] for m in req["messages"]], at)
        for j, (g, w) in enumerate(zip(got_in, req["messages"])):
            mat = f"{at}input {j} ({w['role']}): "
            if w.get("content") is not None:
                c.eq("input_content", g["content"], _text(w["content"]), mat)
            want_calls = [(t["id"], t["function"]["name"], _json(t["function"]["arguments"])) for t in w.get("tool_calls") or []]
            got_calls = [(t["id"], t["name"], _json(t["arguments"])) for t in g["tool_calls"] or []]
            c.eq("input_tool_calls", got_calls, want_calls, mat)
            if w["role"] == "tool":
                c.eq("tool_call_id", g["tool_call_id"], w["tool_call_id"], mat)
        if i > 0 and scenario == "tool_loop":
            prev = calls[i - 1]["response"]["choices"][0]["message"]["tool_calls"][0]["id"]
            tool_msgs = [m for m in got_in if m["role"] == "tool"]
            c.true("tool_call_id", bool(tool_msgs) and tool_msgs[-1]["tool_call_id"] == prev,
                   f"{at}the tool result answers {tool_msgs[-1]['tool_call_id'] if tool_msgs else None!r}, "
                   f"the previous call issued {prev!r}")

        # Action: the answer, text or tool call.
        out = row["output_message"]
        if out is None:
            c.true("output", False, f"{at}no output message")
        else:
            c.eq("output_role", out["role"], "assistant", at)
            if choice["message"].get("tool_calls"):
                want = [(t["id"], t["function"]["name"], TOOL_ARGUMENTS) for t in choice["message"]["tool_calls"]]
                got = [(t["id"], t["name"], _json(t["arguments"])) for t in out["tool_calls"] or []]
                c.eq("output_tool_calls", got, want, at)
                c.true("output_content", not out["content"], f"{at}tool-call turn with text {out['content']!r}")
            else:
                c.eq("output_content", out["content"], choice["message"]["content"], at)
                c.eq("output_tool_calls", out["tool_calls"] or [], [], at)

        # The tools offered.
        if req.get("tools") and producer.records_tools:
            names = []
            try:
                for t in json.loads(row["tools"] or "[]"):
                    names.append((t.get("function") or t).get("name"))
            except (json.JSONDecodeError, AttributeError) as e:
                names = [f"unreadable tools {row['tools']!r}: {e}"]
            c.eq("tools", names, [t["function"]["name"] for t in req["tools"]], at)
        elif not req.get("tools"):
            c.eq("tools", row["tools"], None, at)
    return c


@dataclass
class CaseRun:
    service: str
    proc: subprocess.CompletedProcess | None = None
    error: str | None = None  # the side environment could not be built, or the program hung
    calls: list[dict] = field(default_factory=list)  # what the stub received and answered
    stub_errors: list[str] = field(default_factory=list)


@dataclass
class LiveRun:
    data: Path
    cases: dict[tuple[str, str], CaseRun]
    traces_of: dict[str, list[str]] = field(default_factory=dict)  # service name (from the spans) -> trace ids
    transitions: pl.DataFrame | None = None
    build_error: str | None = None
    collector_log: str = ""
    collector_log_path: Path | None = None


def _run_case(producer_name: str, scenario: str, python: Path | envs.EnvError, endpoint: str) -> CaseRun:
    producer = PRODUCERS[producer_name]
    run = CaseRun(service=f"live-{producer_name}-{scenario}")
    if isinstance(python, envs.EnvError):
        run.error = f"side environment {producer.env!r} could not be installed:\n{python}"
        return run
    with StubOpenAI() as stub:
        try:
            run.proc = run_agent(producer, python, scenario, endpoint, stub, run.service)
        except subprocess.TimeoutExpired as e:
            run.error = f"agent program timed out:\n{e.stdout}\n{e.stderr}"
        run.calls, run.stub_errors = list(stub.calls), list(stub.errors)
    return run


def _selected_cases(request) -> list[tuple[str, str]]:
    """The cases of this module that this session will run (-k, node ids)."""
    out = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec and "producer_name" in spec.params:
            out.append((spec.params["producer_name"], spec.params["scenario"]))
    return out


@pytest.fixture(scope="module")
def live(request, tmp_path_factory) -> LiveRun:
    """Every selected case, run once: the side environments built (or reused) in
    parallel, one collector for all (as a sidecar serves many agents), the agent
    programs run a few at a time (each with its own stub and service name), the
    collector stopped (SIGTERM drains and flushes), then one `nightshift build`."""
    cases = _selected_cases(request)
    pythons = envs.ensure_all(sorted({PRODUCERS[p].env for p, _ in cases}))
    tmp = tmp_path_factory.mktemp("live")
    collector = CollectorProcess(data=tmp / "data", wal=tmp / "wal", log_path=tmp / "collector.log").start()
    try:
        workers = int(os.environ.get("NIGHTSHIFT_LIVE_WORKERS") or 3)
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(cases)))) as pool:
            futures = {c: pool.submit(_run_case, c[0], c[1], pythons[PRODUCERS[c[0]].env], collector.http_url)
                       for c in cases}
            runs = {c: f.result() for c, f in futures.items()}
        rc = collector.stop()
        assert rc == 0, f"collector exited {rc}:\n{collector.log_tail()}"
    finally:
        if collector.proc and collector.proc.poll() is None:
            collector.proc.kill()
            collector.proc.wait(10)
    live = LiveRun(data=collector.data, cases=runs, collector_log=collector.log_tail(),
                   collector_log_path=collector.log_path)
    spans = read_spans(collector.data)
    if spans.height:
        for (service,), part in spans.group_by("service_name"):
            live.traces_of[service] = part["trace_id"].unique().to_list()
    try:
        live.transitions = build(collector.data)
    except AssertionError as e:
        live.build_error = str(e)
    return live


@pytest.mark.parametrize("producer_name,scenario", CASES, ids=[f"{p}-{s}" for p, s in CASES])
def test_live_instrumentation(producer_name, scenario, live):
    producer = PRODUCERS[producer_name]
    run = live.cases[(producer_name, scenario)]
    if run.error:
        pytest.fail(run.error, pytrace=False)
    proc = run.proc
    assert proc.returncode == 0, f"agent program failed:\n{proc.stdout}\n{proc.stderr}"
    assert not run.stub_errors, run.stub_errors
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(run.calls) == result["calls"], (result, run.calls)
    for noise in ("Failed to export", "Exception while exporting", "Traceback"):
        assert noise not in proc.stderr, proc.stderr
    if live.build_error:
        pytest.fail(live.build_error, pytrace=False)

    # This case's rows: those of its traces (told apart by the spans' resource, not by
    # the transform's service_name column, which is checked).
    df = live.transitions.filter(pl.col("trace_id").is_in(live.traces_of.get(run.service, [])))
    checks = check_rows(df, run.calls, producer, scenario, run.service, result.get("agents"))
    gaps = {**KNOWN_GAPS.get((producer_name, "*"), {}), **KNOWN_GAPS.get((producer_name, scenario), {})}
    unexpected = {k: v for k, v in checks.failures.items() if k not in gaps}
    fixed = [k for k in gaps if k not in checks.failures]
    if unexpected or fixed:
        report = "\n".join(m for msgs in unexpected.values() for m in msgs)
        if fixed:
            report += f"\nknown gaps now passing (remove them from KNOWN_GAPS): {fixed}"
        print("transitions:", df.sort("step").drop("prompt_token_ids", "completion_token_ids", "completion_logprobs").to_dicts())
        print(dump(live.data, run.service))
        print("agent stderr:", proc.stderr[-4000:])
        print(f"collector log ({live.collector_log_path}):", live.collector_log[-3000:])
        pytest.fail(report, pytrace=False)
    if gaps:
        pytest.xfail("; ".join(f"{k}: {gaps[k]} ({checks.failures[k][0]})" for k in gaps))
