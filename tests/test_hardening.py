"""Short versions of the hardening campaigns (tests/hardening/: the long ones write
docs/RELIABILITY.md): fuzzing in process and over the wire, fault injection under
load (a full disk, the flusher killed between Parquet and the log trim, an object
store that refuses, hangs and cuts uploads), and the security checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "hardening"))

import cases  # noqa: E402
import faults  # noqa: E402
import fuzz  # noqa: E402
import security  # noqa: E402
import wire  # noqa: E402


def test_fuzz_short_campaign_meets_the_spec_on_every_case():
    s = fuzz.campaign(3000, seed=7, jobs=1, chunk=1500, flush_every=500, progress=False)
    assert fuzz.ok(s), fuzz.report(s)
    assert s["cases"] == 3000 and s["grpc_cases"] > 500
    # the campaign reached every kind of answer, so "no failure" means something
    assert {"200", "400", "404", "413", "415"} <= set(s["by_code"])
    assert {"grpc:OK", "grpc:INVALID_ARGUMENT"} <= set(s["by_code"])
    assert s["acknowledged"] > 1000 and s["lost"] == 0


@pytest.mark.parametrize("body,code", [
    # found by the campaign: JSON escapes of lone surrogates used to answer 500
    (b'{"trace_id":"5b8efff798038103d269b633813fc60c","value":1,"comment":"a\\ud800b"}', 400),
    (b'{"conversation_id":"\\udfff","value":1}', 400),
    (b'{"trace_id":"5b8efff798038103d269b633813fc60c","value":1,"\\ud800":2}', 400),
])
def test_feedback_with_lone_surrogates_is_refused_not_a_crash(tmp_path, body, code):
    t = fuzz.Target(tmp_path)
    r = t.post("/v1/feedback", {"content-type": "application/json"}, lambda: body, "test")
    t.close()
    assert r.code == code, r.body
    assert b"surrogate" in r.body or b"unknown field" in r.body


def test_otlp_json_key_with_a_lone_surrogate_is_ignored_as_unknown(tmp_path):
    body = (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"5b8efff798038103d269b633813fc60c",'
            b'"spanId":"5b8efff798038103","name":"x","\\ud800":"y"}]}]}]}')
    t = fuzz.Target(tmp_path)
    r = t.post("/v1/traces", {"content-type": "application/json"}, lambda: body, "test")
    assert r.code == 200 and b"rejected" not in r.body, r.body
    assert t.flush() == (1, "")
    t.close()


@pytest.mark.parametrize("path,headers,body,code,rejected", [
    # found by the million-case campaign: json_format let an Infinity through as an OverflowError (500)
    ("/v1/logs", {"content-type": "application/json"},
     b'{"resourceLogs":[{"scopeLogs":[{"logRecords":[{"severityNumber": Infinity, "body": {"boolValue": true}}]}]}]}',
     200, 1),
    ("/v1/traces", {"content-type": "application/json"},
     b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"5b8efff798038103d269b633813fc60c",'
     b'"spanId":"5b8efff798038103","kind": -Infinity}]}]}]}', 200, 1),
    # ...and an empty body said to be zstd was read as an empty request (200), unlike gzip's and deflate's 400
    ("/v1/traces", {"content-type": "application/x-protobuf", "content-encoding": "zstd"}, b"", 400, None),
    ("/v1/traces", {"content-type": "application/x-protobuf", "content-encoding": "gzip"}, b"", 400, None),
])
def test_campaign_findings_stay_fixed(tmp_path, path, headers, body, code, rejected):
    t = fuzz.Target(tmp_path)
    r = t.post(path, headers, lambda: body, "test")
    t.close()
    assert r.code == code, r.body
    if rejected is not None:
        assert fuzz._rejected_in(r.body, r.content_type, path) == rejected


def test_every_generator_yields_cases_its_oracle_describes():
    import random

    for name, (gen, _) in cases.GENERATORS.items():
        rng = random.Random(name)
        for _ in range(20):
            c = gen(rng, fuzz.LIMIT) if name == "compressed" else gen(rng)
            assert c.expect and all(code in (200, 400, 404, 413, 415) for code in c.expect), (name, c.expect)
            assert c.rejected is None or 200 in c.expect


@pytest.mark.slow
def test_wire_campaign_against_a_real_collector():
    w = wire.campaign(250, seed=5)
    assert wire.ok(w), wire.report(w)
    assert w["framing"] > 10 and w["grpc_cases"] > 30
    assert any(k.startswith("http-raw:4") for k in w["by_code"])  # malformed framing answered, not dropped


# --- fault injection ---------------------------------------------------------------------

@pytest.mark.slow
def test_full_disk_answers_retryable_then_recovers_by_itself(tmp_path):
    r = faults.disk_full(senders=2, root=tmp_path)
    assert faults.ok("disk-full", r), faults.report("disk-full", r)
    assert r["refused_while_full"] > 0 and r["retryable_without_retry_after"] == 0
    assert r["healthy_while_full"]
    assert r["acknowledged"] > 0


@pytest.mark.slow
def test_flusher_killed_between_parquet_and_trim_adds_no_duplicates(tmp_path):
    r = faults.flusher_kill(times=2, senders=2, root=tmp_path)
    assert faults.ok("flusher-kill", r), faults.report("flusher-kill", r)
    assert r["times"] == 2 and r["flusher_restarts"] == 2  # it really died there, twice
    assert r["acknowledged"] > 0


@pytest.mark.slow
def test_object_store_that_refuses_hangs_and_cuts_uploads_loses_nothing(tmp_path):
    r = faults.object_store(senders=2, phase_s=2.5, flush_timeout=4.0, root=tmp_path)
    assert faults.ok("object-store", r), faults.report("object-store", r)
    assert r["phases"]["stall"]["flusher_restarts_stuck"] >= 1  # the watchdog ended the hang
    assert sum(p["acks_during"] for p in r["phases"].values()) > 0  # acks went on while the store was down
    assert r["files"] > 0


# --- security ------------------------------------------------------------------------------

def test_bearer_token_guards_every_write_path_on_both_transports(tmp_path):
    r = security.tokens(tmp_path)
    assert security.ok("tokens", r), r
    assert r["checks"] == 25 and r["refused_metric"] == 18


def test_hostile_names_never_become_paths(tmp_path):
    r = security.paths(tmp_path)
    assert security.ok("paths", r), r
    assert r["traces_status"] == 200 and r["feedback_status"] == 200 and r["files_written"] >= 2


@pytest.mark.slow
def test_a_noisy_client_cannot_starve_a_quiet_one(tmp_path):
    r = security.fairness(seconds=4.0, root=tmp_path)
    on, off = r["limits_on"], r["limits_off"]
    assert security.ok("fairness", r), json.dumps(r, indent=1)
    # the same load without per-client limits does starve it: the comparison means something
    assert off["quiet_accepted_first_try_pct"] < on["quiet_accepted_first_try_pct"]
    assert on["retryable_without_retry_after"] == 0
