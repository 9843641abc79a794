"""Recorded runs of real agent frameworks, built as users build them.

Each folder under `fixtures/frameworks/<framework>/<instrumentation>/<scenario>/`
is one real run, recorded on 2026-11-25: the framework's agent program
(`instrumentation/agents/<framework>_app.py`) in its side virtualenv
(`instrumentation/requirements/<framework>_*.txt`), instrumented by the released
packages, talking to the deterministic stub, its spans received by a real
`nightshift collect` (the Parquet files kept here as they were written), with
what the stub received and answered (`stub_calls.json`) and the agent of each
call as the program named it (`program.json`). Nothing in them is hand-made.

The build must give one row per request the stub received, whichever spans
recorded it, each with the agent the program named, the messages as sent and
the answer as given. What an instrumentation does not record at all is listed
in GAPS with the reason, and the test fails once it stops being a gap.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from nightshift.transform.build import build
from nightshift.transform.config import TransformConfig
from test_instrumentation_live import PLAIN_AGENTS, Producer, check_rows

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"
CASES = sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.glob("*/*/*") if (p / "stub_calls.json").exists())

#: (framework/instrumentation) -> what the spans carry about each call
CONVENTION = {"openllmetry": "otel_genai", "builtin": "otel_genai", "logfire": "otel_genai", "zero": "otel_genai"}
#: case, or a prefix ending in "/" -> {checked field: why it cannot be right from these spans}
GAPS: dict[str, dict[str, str]] = {
    "autogen/openinference/": {
        "input_name": "OpenInference's AutoGen instrumentor drops each message's source (the wire's `name`)",
        "provider": "OpenInference's AutoGen spans name no provider",
        "request_model": "llm.model_name is AutoGen's own lookup of the requested model, neither the request's nor the response's",
        "response_model": "as request_model",
    },
    "autogen/openinference/assistant": {
        "tools": "OpenInference's AutoGen instrumentor records tools only for Tool objects, not the schemas AssistantAgent passes",
    },
    "autogen/openinference_gpt4o/": {
        "input_name": "as autogen/openinference", "tools": "as autogen/openinference/assistant",
        "provider": "as autogen/openinference", "request_model": "as autogen/openinference",
        "response_model": "as autogen/openinference",
        "model": "llm.model_name is AutoGen's lookup (gpt-4o-2024-08-06), not what answered (gpt-4o-2024-07-18)",
    },
    "autogen/genai_openai/roundrobin": {
        "trajectories": "without a span around team.run(), AutoGen starts a trace per runtime message, joined only by "
                        "span links: `transform.trajectory: linked` follows them (tested below)",
        "trace": "as trajectories", "steps": "as trajectories", "num_steps": "as trajectories",
    },
    "autogen/genai_openai_noruntime/": {
        "trajectories": "with runtime tracing off, each agent turn is a trace of its own, with no link between them",
        "trace": "as trajectories", "steps": "as trajectories", "num_steps": "as trajectories",
    },
    "llamaindex/openinference/": {
        "agent_name": "LlamaIndex records the agent's name only as text (current_agent_name='...') in the parent "
                      "span's input.value, in no attribute: left null",
        "model": "OpenInference's LlamaIndex spans record only the requested model", "response_model": "as model",
    },
    "llamaindex/openinference/function_agent": {
        "input_tokens": "a streamed answer's token counts are not recorded by OpenInference's LlamaIndex spans",
        "output_tokens": "as input_tokens",
    },
    "openlit/zero_code/tool_loop": {
        "flags": "OpenLIT leaves the assistant's tool-call turn out of the next call's history: rebuilt, flagged history_rebuilt",
    },
    "crewai/openllmetry/tool": {"input_name": "OpenLLMetry's tool_call_response parts have no place for the tool's name"},
}


def _producer(case: str, program: dict, calls: list[dict]) -> Producer:
    fw, combo, scenario = case.split("/")
    convention = CONVENTION.get(combo.split("_")[0], "openinference")
    agents = program["result"]["agents"]  # the frameworks' programs say; the plain client ones run the live scenarios
    return Producer(program["env"], f"{fw}_app", False, convention, (scenario,),
                    agents={scenario: agents if agents is not None else PLAIN_AGENTS[scenario]})


def _tools(df: pl.DataFrame, calls: list[dict]) -> list[str]:
    """The tools offered, by name, as the request offered them."""
    bad = []
    for i, (row, call) in enumerate(zip(df.sort("step").iter_rows(named=True), calls)):
        want = [t["function"]["name"] for t in call["request"].get("tools") or []]
        got = [(t.get("function") or t).get("name") for t in json.loads(row["tools"] or "[]")]
        if got != want:
            bad.append(f"call {i}: tools: got {got}, want {want}")
    return bad


def _input_names(df: pl.DataFrame, calls: list[dict]) -> list[str]:
    """Each message `name` on the wire (AutoGen's group chat says who spoke) must survive."""
    bad = []
    for i, (row, call) in enumerate(zip(df.sort("step").iter_rows(named=True), calls)):
        for j, (g, w) in enumerate(zip(row["input_messages"] or [], call["request"]["messages"])):
            if w.get("name") != g["name"]:
                bad.append(f"call {i}: msg {j} ({w['role']}): name got {g['name']!r}, want {w.get('name')!r}")
    return bad


@pytest.mark.parametrize("case", CASES)
def test_a_recorded_framework_run_builds_one_exact_row_per_request(case, tmp_path):
    src = FIXTURES / case
    calls = json.loads((src / "stub_calls.json").read_text())
    program = json.loads((src / "program.json").read_text())
    data = tmp_path / "data"
    for part in ("spans", "logs"):
        if (src / part).exists():
            shutil.copytree(src / part, data / part)
    summary = build(TransformConfig(data=str(data), settle=0))
    df = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"), hive_partitioning=True)
    # every call the spans recorded, duplicates and detached copies included, was read
    assert not any(v[1] for v in summary.by_instrumentation.values()), summary.by_instrumentation
    checks = check_rows(df, calls, _producer(case, program, calls), case.split("/")[2], df["service_name"][0])
    checks.failures.pop("tools", None)  # the live suite's tool is get_weather; here each request says
    if df.height == len(calls):
        for what, found in (("input_name", _input_names(df, calls)), ("tools", _tools(df, calls))):
            if found:
                checks.failures[what] = found
    gaps = {k: v for key, g in GAPS.items() if case == key or (key.endswith("/") and case.startswith(key))
            for k, v in g.items()}
    unexpected = {k: v for k, v in checks.failures.items() if k not in gaps}
    assert not unexpected, "\n".join(m for msgs in unexpected.values() for m in msgs)
    fixed = [k for k in gaps if k not in checks.failures]
    assert not fixed, f"known gaps of {case} now pass: remove them from GAPS: {fixed}"


def test_an_autogen_team_run_is_one_trajectory_when_traces_are_joined_by_their_links(tmp_path):
    """Without a span around `team.run()`, AutoGen's runtime starts a trace per message
    and links it to the span that sent it: `trajectory: linked` follows the links."""
    src = FIXTURES / "autogen" / "genai_openai" / "roundrobin"
    calls = json.loads((src / "stub_calls.json").read_text())
    program = json.loads((src / "program.json").read_text())
    shutil.copytree(src / "spans", tmp_path / "data" / "spans")
    build(TransformConfig(data=str(tmp_path / "data"), settle=0, trajectory="linked"))
    df = pl.read_parquet(str(tmp_path / "data" / "transitions" / "**" / "*.parquet"), hive_partitioning=True)
    assert df.height == len(calls) == 4 and df["trajectory_id"].n_unique() == 1
    df = df.sort("step")
    assert df["step"].to_list() == [0, 1, 2, 3] and df["agent_name"].to_list() == program["result"]["agents"]
    assert [m["content"] for m in df["output_message"].to_list()] == [
        c["response"]["choices"][0]["message"]["content"] for c in calls]
