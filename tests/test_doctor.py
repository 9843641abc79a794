"""`nightshift doctor` on recorded runs of real instrumentation packages, each with
one first-hour mistake (tests/fixtures/doctor/<case>/, made by
tests/instrumentation/record_doctor.py: a real agent program, a released
instrumentation configured by environment variables only, a real collector).

Each mistake must come back as a finding whose fix is the exact variable, flag or
setting that repairs it, and the doctor's counts must be what `nightshift build`
writes from the same spans (it uses the build's own decisions)."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import polars as pl
import pytest

from nightshift.cli.main import main
from nightshift.transform import doctor, recent
from nightshift.transform.build import build
from nightshift.transform.config import RewardConfig, TransformConfig
from test_fileingest import traces

FIXTURES = Path(__file__).parent / "fixtures"
DOCTOR = FIXTURES / "doctor"


def copy(case: str, tmp_path: Path) -> Path:
    src = DOCTOR / case if (DOCTOR / case).exists() else FIXTURES / "frameworks" / case
    data = tmp_path / "data"
    shutil.copytree(src / "spans", data / "spans")
    if (src / "logs").exists():
        shutil.copytree(src / "logs", data / "logs")
    return data


def last_received(data: Path) -> int:
    return int(pl.read_parquet(str(data / "spans" / "**" / "*.parquet"))["received_time"].cast(pl.Int64).max())


def diagnose(data: Path, now_ns: int | None = None, **cfg) -> doctor.Report:
    """The report at a clock an hour after the recording (every trajectory settled), unless given."""
    now_ns = now_ns or last_received(data) + 3600 * 10**9
    w = recent.read(str(data), 0, now_ns)
    return doctor.diagnose(w.spans, w.logs, w.feedback, TransformConfig(data=str(data), **cfg), now_ns)


def only(report: doctor.Report, words: str) -> doctor.Finding:
    found = [f for f in report.findings if words in f.what]
    assert len(found) == 1, f"{words!r} in {[f.what for f in report.findings]}"
    return found[0]


@pytest.mark.parametrize("case,package,switch", [
    # openai-v2 2.4b0 as its README installs it: the variable never set
    ("capture_off", "opentelemetry-util-genai 1.1b0", "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY"),
    ("openinference_hidden", "openinference-instrumentation-openai 0.1.66", "OPENINFERENCE_HIDE_INPUTS"),
    # OpenLLMetry writes the GenAI attributes too: the convention's hint would name the wrong variable
    ("traceloop_content_off", "OpenLLMetry opentelemetry-instrumentation-openai 0.62.4", "TRACELOOP_TRACE_CONTENT=true"),
])
def test_content_capture_off_names_the_packages_own_switch(tmp_path, case, package, switch):
    r = diagnose(copy(case, tmp_path))
    f = only(r, "recorded without their messages")
    assert f.severity == "error" and package in f.scope
    assert f.fix.startswith(switch), f.fix
    if case == "traceloop_content_off":
        assert "OTEL_INSTRUMENTATION_GENAI" not in f.fix
    (g,) = r.groups
    assert (g.agent, g.with_content, g.ready) == ("weather_agent", 0, 0) and g.calls == g.rows > 0
    assert not r.ok


def test_no_agent_span_and_no_reward(tmp_path):
    r = diagnose(copy("no_agent", tmp_path))
    named = only(r, "have no agent name")
    assert named.severity == "warning" and named.count == 2 and "gen_ai.agent.name=NAME" in named.fix
    unrated = only(r, "would have no reward")
    assert unrated.severity == "error" and "nightshift feedback" in unrated.fix and "--reward-keys" in unrated.fix
    (g,) = r.groups
    assert (g.agent, g.calls, g.with_content, g.rows, g.rewarded) == (None, 2, 2, 2, 0)
    assert not r.ok


def test_a_reward_attribute_the_build_is_not_told_about(tmp_path):
    data = copy("episode_reward", tmp_path)
    r = diagnose(data)
    f = only(r, "would have no reward")
    assert f.fix.startswith("--reward-keys episode.reward "), f.fix
    assert "on 2 spans of 2 traces" in f.fix
    assert not r.ok
    fixed = diagnose(data, reward=RewardConfig(keys=["episode.reward"]))
    assert fixed.ok and not [x for x in fixed.findings if x.severity != "info"], fixed.findings
    assert {g.agent: (g.calls, g.ready) for g in fixed.groups} == {
        "weather_agent": (2, 2), "writer": (1, 1), "checker": (1, 1), "rewriter": (1, 1)}


def test_no_llm_instrumentation_loaded(tmp_path):
    r = diagnose(copy("no_llm_spans", tmp_path))
    f = only(r, "but no LLM call among them")
    assert f.severity == "error" and "opentelemetry-instrumentation-openai-v2" in f.fix
    assert "nightshift.live.app" in f.what and r.groups == [] and not r.ok


def test_attributes_over_the_sdk_limit(tmp_path):
    """With the limit hit, the SDK dropped gen_ai.operation.name from the chat spans:
    the calls are not seen at all. The doctor names the limit, not only the symptom."""
    r = diagnose(copy("attribute_limit", tmp_path))
    f = only(r, "lost attributes to the SDK's limit")
    assert f.severity == "error" and f.count == 2 and f.fix.startswith("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT=1024")
    assert "attributes that mark them were dropped" in only(r, "no LLM call").why


def test_trajectories_still_settling(tmp_path):
    data = copy("episode_reward", tmp_path)
    keys = RewardConfig(keys=["episode.reward"])
    r = diagnose(data, now_ns=last_received(data) + 10**9, reward=keys)  # one second after the last span
    f = only(r, "still settling")
    assert f.severity == "warning" and f.count == 5 and "in 2 trajectories" in f.what
    assert "--settle 0" in f.fix and "NIGHTSHIFT_TRANSFORM_SETTLE=0" in f.fix and "10m" in f.fix
    assert sum(g.waiting for g in r.groups) == 5 and not r.ok
    assert diagnose(data, now_ns=last_received(data) + 10**9, reward=keys, settle=0).ok
    assert diagnose(data, now_ns=last_received(data) + 601 * 10**9, reward=keys).ok


def test_feedback_rates_a_trajectory_and_a_label_with_a_wrong_id_is_named(tmp_path, capsys):
    data = copy("no_agent", tmp_path)
    trace = pl.read_parquet(str(data / "spans" / "**" / "*.parquet"))["trace_id"].sort()[0]
    labels = tmp_path / "labels.csv"
    labels.write_text(f"trace_id,value\n{trace},1\n{'0' * 31 + '7'},0\n")
    assert main(["feedback", "--data", str(data), str(labels)]) == 0
    capsys.readouterr()
    r = diagnose(data)
    (g,) = r.groups
    assert (g.rows, g.rewarded, g.ready) == (2, 1, 1) and r.ok
    assert only(r, "would have no reward").severity == "warning"  # some rows are rated
    lost = only(r, "feedback labels name no trace")
    assert lost.count == 1 and "0" * 31 + "7" in lost.what


def test_agent_selection_that_matches_nothing(tmp_path):
    r = diagnose(copy("episode_reward", tmp_path), agents_include="^planner$", reward=RewardConfig(keys=["episode.reward"]))
    f = only(r, "left out by the agent selection")
    assert f.severity == "error" and "checker" in f.why and "weather_agent" in f.why
    assert not r.ok


@pytest.mark.parametrize("case", ["capture_off", "no_agent", "episode_reward", "openinference_hidden",
                                  # double instrumentation, in one trace and in a detached one
                                  "autogen/openinference_openai/roundrobin", "crewai/openinference_events/crew",
                                  "pydantic_ai/builtin/three_agents"])
def test_counts_are_what_the_build_writes(tmp_path, case):
    data = copy(case, tmp_path)
    now = last_received(data) + 3600 * 10**9
    cfg = dict(settle=600.0, reward=RewardConfig(keys=["episode.reward"]))
    r = diagnose(data, now_ns=now, **cfg)
    summary = build(TransformConfig(data=str(data), **cfg), now_ns=now)
    rows = pl.read_parquet(str(data / "transitions" / "**" / "*.parquet"))
    assert sum(g.rows for g in r.groups) == summary.transitions == rows.height
    assert {g.agent: g.rows for g in r.groups} == dict(rows.group_by("agent_name").len().iter_rows())
    assert sum(g.rewarded for g in r.groups) == rows["reward"].is_not_null().sum()
    assert sum(g.rows - g.with_content for g in r.groups) == sum(summary.content_missing.values())
    assert sum(s.duplicates for s in r.services) == summary.duplicates


def test_cli_report_json_and_exit_codes(tmp_path, capsys):
    data = copy("episode_reward", tmp_path)
    base = ["doctor", "--data", str(data), "--hours", "0", "--settle", "1s"]
    assert main(base) == 1
    out = capsys.readouterr().out
    assert "agent weather_agent: 2 call(s) -> 2 row(s) now, 0 trainable" in out
    assert "fix: --reward-keys episode.reward" in out and out.rstrip().endswith("fix the errors above")
    assert main([*base, "--reward-keys", "episode.reward", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and sum(g["ready"] for g in report["groups"]) == 5
    assert report["services"][0]["service"] == "doctor-episode-reward"


def test_cli_on_nothing_and_on_an_unreadable_file(tmp_path, capsys):
    assert main(["doctor", "--data", str(tmp_path / "empty")]) == 1
    out = capsys.readouterr().out
    assert "ERROR data: no spans in the window" in out and "OTEL_EXPORTER_OTLP_ENDPOINT" in out
    data = copy("no_agent", tmp_path)
    bad = next((data / "spans").glob("date=*")) / "part-torn.parquet"
    bad.write_bytes(b"PAR1 not really")
    assert main(["doctor", "--data", str(data), "--hours", "0"]) == 1
    out = capsys.readouterr().out
    assert "unreadable, left out:" in out and "part-torn.parquet" in out
    assert "agent (no name): 2 call(s)" in out  # the rest was read


def test_cli_reads_a_running_collectors_backlog_and_refusals(collector_factory, tmp_path, capsys):
    """A collector that has not flushed yet (a long flush interval) and that refused
    an agent without its token: the doctor says both, with the fixes."""
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL": "3600", "NIGHTSHIFT_COLLECTOR_TOKEN": "s3cret"})
    c.start()
    body = traces(1, 3).SerializeToString()

    def post(headers: dict) -> int:
        req = urllib.request.Request(f"{c.http_url}/v1/traces", data=body, method="POST",
                                     headers={"Content-Type": "application/x-protobuf", **headers})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as e:
            return e.code

    assert post({"Authorization": "Bearer s3cret"}) == 200
    assert post({}) == 401
    deadline = time.time() + 10
    while time.time() < deadline and not c.metrics().get("nightshift_wal_bytes"):
        time.sleep(0.05)
    assert main(["doctor", "--data", str(c.data), "--collector", c.http_url]) == 1
    out = capsys.readouterr().out
    assert "not in Parquet yet" in out and "SIGTERM flushes everything" in out
    assert "1 requests refused whole (unauthenticated)" in out
    assert "OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>" in out
    assert main(["doctor", "--data", str(c.data), "--collector", "http://127.0.0.1:9"]) == 1
    assert "cannot read http://127.0.0.1:9/metrics" in capsys.readouterr().out


def test_a_large_window_is_sampled_and_says_so(tmp_path, capsys):
    data = copy("capture_off", tmp_path)
    now = last_received(data) + 3600 * 10**9
    a, b = (recent.read(str(data), 0, now, max_traces=1) for _ in range(2))
    assert a.traces == 2 and a.spans["trace_id"].n_unique() == 1 and a.spans.height == 4  # one whole trace
    assert a.spans.equals(b.spans)  # the same sample for the same data
    assert main(["doctor", "--data", str(data), "--hours", "0", "--max-traces", "1"]) == 1
    assert "a random sample of 1 of its 2 traces" in capsys.readouterr().out


def test_a_reward_attribute_is_suggested_only_for_the_service_that_records_it(tmp_path):
    data = copy("episode_reward", tmp_path)
    for f in (DOCTOR / "no_agent" / "spans").rglob("*.parquet"):
        dest = data / "spans" / f.parent.name / f.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    r = diagnose(data)
    fixes = {f.scope: f.fix for f in r.findings if "would have no reward" in f.what}
    assert fixes["service doctor-episode-reward"].startswith("--reward-keys episode.reward")
    assert "episode.reward" not in fixes["service doctor-no-agent"], fixes


def test_an_idle_collector_that_flushed_everything_reports_no_backlog(collector_factory, capsys):
    """Its write-ahead log holds only the active segment's 8-byte header: the doctor
    used to report '8 bytes of spans and logs in its write-ahead log' to every new user."""
    c = collector_factory()
    c.start()
    assert c.metrics().get("nightshift_wal_bytes") == 8.0
    main(["doctor", "--data", str(c.data), "--collector", c.http_url])
    out = capsys.readouterr().out
    assert "write-ahead log" not in out, out
    assert "fix the errors above" in out  # no spans at all is an error, and it says so


def test_the_verdict_names_errors_only_when_there_are_some(tmp_path):
    report = diagnose(copy("episode_reward", tmp_path))
    assert not report.ok and report.findings  # unrated: nothing trainable, and it says why
    report.findings = [f for f in report.findings if f.severity != "error"]
    assert "fix the errors above" not in report.lines()[-1]
    report.add("error", "data", "something", "why", "fix")
    assert report.lines()[-1].endswith("fix the errors above")
