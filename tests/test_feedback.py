"""Delayed feedback: POST /v1/feedback on a real collector (durable like spans,
refused whole and loudly when wrong) and `nightshift feedback FILE`."""

from __future__ import annotations

import gzip
import json
import os
import signal
import time
import urllib.request
from datetime import datetime, timezone

import polars as pl
import pytest
import zstandard

from conftest import read_dataset
from helpers import post
from nightshift.cli.main import main as cli
from nightshift.collector import feedback

TRACE = "5B8EFFF798038103D269B633813FC60C"
TRACE2 = "0af7651916cd43dd8448eb211c80319c"
SPAN = "EEE19B7EC3C1B174"
JSON = "application/json"


def send(port: int, doc, **kw) -> tuple[int, dict, dict]:
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    status, headers, out = post(port, "/v1/feedback", body, kw.pop("content_type", JSON), **kw)
    return status, headers, json.loads(out) if out else {}


def read_feedback(data):
    return read_dataset(data, "feedback")


def wait_rows(data, n: int, timeout: float = 20.0) -> pl.DataFrame:
    deadline = time.time() + timeout
    while time.time() < deadline:
        df = read_feedback(data)
        if df.height >= n:
            return df
        time.sleep(0.1)
    pytest.fail(f"fewer than {n} feedback rows after {timeout}s")


# --- the rules, without a process -------------------------------------------------------


def test_normalize_rules():
    r = feedback.normalize({"trace_id": TRACE, "span_id": SPAN, "value": False, "time": "2025-11-22t10:15:00.5z"})
    assert (r["trace_id"], r["span_id"], r["value"], r["name"]) == (TRACE.lower(), SPAN.lower(), 0.0, "feedback")
    assert r["time"] == int(datetime(2025, 11, 22, 10, 15, tzinfo=timezone.utc).timestamp()) * 10**9 + 500_000_000
    assert feedback.normalize({"conversation_id": "c", "value": 1, "time": 1763800000.25})["time"] == 1_763_800_000_250_000_000
    assert feedback.normalize({"conversation_id": "c", "value": 2, "time": "2025-11-22T12:15:00+02:00"})["time"] == r["time"] - 500_000_000
    # The content hash is the same for the same label however it was written, and is the id.
    a = feedback.normalize({"trace_id": TRACE, "value": 1})
    b = feedback.normalize({"trace_id": TRACE.lower(), "value": 1.0, "comment": None})
    assert a["feedback_id"] == b["feedback_id"] and len(a["feedback_id"]) == 32
    assert feedback.normalize({"trace_id": TRACE, "value": 1, "id": "k1"})["feedback_id"] == "k1"
    for item, field, why in [
        ({"trace_id": TRACE, "value": 1, "time": "2025-11-22 10:15:00"}, "time", "no UTC offset"),
        ({"trace_id": TRACE, "value": 1, "time": 1763800000000}, "time", "milliseconds"),
        ({"trace_id": TRACE, "value": 10**400}, "value", "finite number"),
        ({"trace_id": TRACE, "value": None}, "value", "got null"),
        ({"trace_id": TRACE, "value": 1, "name": ""}, "name", "must not be empty"),
        ({"trace_id": TRACE, "value": 1, "id": 7}, "id", "must be a string"),
        ({"trace_id": "0" * 32, "value": 1}, "trace_id", "all zeros"),
        ({"conversation_id": "", "value": 1}, "conversation_id", "must not be empty"),
        ({"traceId": TRACE, "value": 1}, "traceId", "did you mean 'trace_id'"),
    ]:
        with pytest.raises(feedback.FieldError) as e:
            feedback.normalize(item)
        assert e.value.field == field and why in e.value.why, (item, str(e.value))


def test_label_ids_are_kept_past_the_dedup_window(tmp_path):
    """Spans' keys are forgotten after the window (exporters resend within seconds);
    a label's id is an idempotency key a client may resend at any time."""
    from nightshift.collector.datasets import DatasetStore
    from nightshift.collector.feedback_table import write_feedback

    store = DatasetStore(str(tmp_path), window_s=0.0)
    records = feedback.normalize_all([{"trace_id": TRACE, "value": 1}, {"conversation_id": "c", "value": 2, "id": "k"}])
    now = time.time_ns()
    assert write_feedback(store, "1", records, now, "http").rows == 2
    again = write_feedback(store, "2", records, now, "http")
    assert (again.rows, again.duplicates) == (0, 2)


# --- POST /v1/feedback ------------------------------------------------------------------


def test_single_list_and_wrapped_bodies_reach_the_dataset(collector):
    port = collector.http_port
    before = time.time_ns()
    one = {"trace_id": TRACE, "span_id": SPAN, "name": "user_rating", "value": True,
           "comment": "great, thanks", "time": "2025-11-22T10:15:00Z"}
    status, headers, answer = send(port, one)
    assert (status, answer) == (200, {"accepted": 1}) and headers["content-type"] == JSON
    listed = [{"conversation_id": "conv-1", "name": "task_success", "value": 0, "time": 1763800000},
              {"trace_id": TRACE2, "value": -0.5, "comment": "key sk-proj-abcdefghijklmnopqrstuvwx leaked"}]
    assert send(port, listed, gz=True)[:3:2] == (200, {"accepted": 2})
    wrapped = zstandard.ZstdCompressor().compress(json.dumps({"feedback": [{"trace_id": TRACE2, "value": 3, "id": "review-17"}]}).encode())
    assert send(port, wrapped, headers={"Content-Encoding": "zstd"})[:3:2] == (200, {"accepted": 1})
    assert send(port, [])[:3:2] == (200, {"accepted": 0})
    metrics = urllib.request.urlopen(f"{collector.http_url}/metrics").read().decode()
    assert 'nightshift_accepted_total{signal="feedback"} 4.0' in metrics

    df = wait_rows(collector.data, 4)
    assert collector.stop() == 0
    assert read_feedback(collector.data).height == 4
    rows = {r["feedback_id"]: r for r in df.to_dicts()}
    r = rows["review-17"]
    assert (r["trace_id"], r["value"], r["name"], r["conversation_id"]) == (TRACE2, 3.0, "feedback", None)
    r = next(r for r in rows.values() if r["name"] == "user_rating")
    assert (r["trace_id"], r["span_id"], r["value"], r["comment"]) == (TRACE.lower(), SPAN.lower(), 1.0, "great, thanks")
    assert r["time"] == datetime(2025, 11, 22, 10, 15, tzinfo=timezone.utc)
    assert len(r["feedback_id"]) == 32 and int(r["feedback_id"], 16) >= 0
    r = next(r for r in rows.values() if r["name"] == "task_success")
    assert (r["conversation_id"], r["trace_id"], r["value"]) == ("conv-1", None, 0.0)
    assert r["time"] == datetime.fromtimestamp(1763800000, timezone.utc)
    assert df.filter(pl.col("value") == -0.5)["comment"].to_list() == ["key [REDACTED:api_key] leaked"]  # before the disk
    assert set(df["source"]) == {"http"}
    for r in rows.values():  # partitioned by the UTC date of arrival
        received = r["received_time"]
        assert received.timestamp() * 1e9 >= before - 1e9
        assert str(r["date"]) == received.astimezone(timezone.utc).strftime("%Y-%m-%d")


def test_a_resent_label_is_stored_once(collector):
    port = collector.http_port
    label = {"trace_id": TRACE, "name": "thumbs", "value": 1}
    keyed = {"conversation_id": "c9", "value": 0.25, "id": "k-1"}
    for _ in range(2):  # a client resending after a slow ack: same WAL segment
        assert send(port, [label, keyed])[0] == 200
    wait_rows(collector.data, 2)
    # ... and after the first copy is already in Parquet; a keyed label resent with
    # changed content is still the same label.
    assert send(port, [label, {**keyed, "value": 0.75}])[0] == 200
    assert collector.stop() == 0
    df = read_feedback(collector.data)
    assert df.height == 2
    assert df.filter(pl.col("feedback_id") == "k-1")["value"].to_list() == [0.25]


def test_bad_labels_are_refused_whole_with_every_problem_named(collector):
    port = collector.http_port
    good = {"trace_id": TRACE, "value": 1}
    cases = [
        (b'{"trace_id": "%s", "value": NaN}' % TRACE.encode(), "feedback[0].value: must be a finite number, got NaN"),
        (b'[{"trace_id": "%s", "value": 1}, {"conversation_id": "c", "value": -Infinity}]' % TRACE.encode(),
         "feedback[1].value: must be a finite number, got -Infinity"),
        ([good, good, {"comment": "no ids", "value": 1}], "feedback[2].trace_id: trace_id or conversation_id is required"),
        ([{"trace_id": "xyz", "value": 1}], "feedback[0].trace_id: must be 32 hex digits, got string 'xyz'"),
        ([{"trace_id": TRACE, "span_id": "abc", "value": 1}], "feedback[0].span_id: must be 16 hex digits"),
        ([{"trace_id": TRACE, "reward": 1}], "feedback[0].reward: unknown field; did you mean 'value'?"),
        ([{"trace_id": TRACE, "value": "0.5"}], "feedback[0].value: must be a finite number, got string '0.5'"),
        ([{"trace_id": TRACE, "value": None}], "feedback[0].value: must be a finite number, got null"),
        ({"feedback": [good], "extra": 1}, "unknown field(s) beside `feedback`: extra"),
        (b"{not json", "body is not valid JSON"),
        (b'"just a string"', "body must be a JSON object"),
    ]
    for body, expected in cases:
        status, headers, answer = send(port, body)
        assert status == 400 and headers["content-type"] == JSON, (body, answer)
        assert answer["code"] == 3 and expected in answer["message"], (expected, answer)
    # Every problem of a request is listed in the details, not only the first.
    status, _, answer = send(port, [{"trace_id": TRACE, "value": float("nan")}, good, {"trace_id": "zz", "value": 1}])
    assert status == 400
    violations = answer["details"][0]["fieldViolations"]
    assert answer["details"][0]["@type"] == "type.googleapis.com/google.rpc.BadRequest"
    assert [v["field"] for v in violations] == ["feedback[0].value", "feedback[2].trace_id"]
    # Wrong content type: 415 before the body is looked at; a gzip body still decoded.
    assert send(port, json.dumps(good).encode(), content_type="text/csv")[0] == 415
    assert send(port, json.dumps(good).encode(), content_type="application/x-protobuf")[0] == 415
    status, _, answer = send(port, b'{"trace_id": "%s", "value": Infinity}' % TRACE.encode(), gz=True)
    assert status == 400 and "got Infinity" in answer["message"]
    metrics = urllib.request.urlopen(f"{collector.http_url}/metrics").read().decode()
    assert 'nightshift_refused_requests_total{reason="bad_request",signal="feedback"} 13.0' in metrics
    assert 'nightshift_rejected_total{signal="feedback"} 11.0' in metrics
    assert collector.stop() == 0
    assert read_feedback(collector.data).height == 0  # nothing of any refused request, good items included


def test_bearer_token_and_body_limit(collector_factory):
    c = collector_factory(extra_args=["--token", "s3cret"], env={"NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES": "64KiB"}).start()
    label = {"trace_id": TRACE, "value": 1}
    assert send(c.http_port, label)[0] == 401
    assert send(c.http_port, label, headers={"Authorization": "Bearer wrong"})[0] == 401
    auth = {"Authorization": "Bearer s3cret"}
    bomb = gzip.compress(json.dumps([{**label, "comment": "x" * 1000}] * 200).encode())
    assert len(bomb) < 64 << 10
    assert send(c.http_port, bomb, headers={**auth, "Content-Encoding": "gzip"})[0] == 413
    assert send(c.http_port, label, headers=auth)[:3:2] == (200, {"accepted": 1})
    assert c.stop() == 0
    assert read_feedback(c.data).height == 1


def test_full_wal_answers_503_with_retry_after(collector_factory):
    c = collector_factory(env={"NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES": "100KiB"}).start()
    flusher = c.health()["flusher_pid"]
    os.kill(flusher, signal.SIGSTOP)
    try:
        for i in range(100):
            status, headers, answer = send(c.http_port, {"trace_id": TRACE, "value": i, "comment": "z" * 20_000})
            if status != 200:
                break
        assert status == 503 and int(headers["retry-after"]) >= 1, answer
        assert answer["code"] == 14
    finally:
        os.kill(flusher, signal.SIGCONT)
    assert c.stop() == 0
    assert read_feedback(c.data).height == i  # every acknowledged label, nothing else


def test_acknowledged_feedback_survives_kill9_once(collector_factory):
    c = collector_factory().start()
    flusher = c.health()["flusher_pid"]
    os.kill(flusher, signal.SIGSTOP)  # the labels are in the WAL only
    labels = [{"trace_id": TRACE, "name": "rating", "value": 4}, {"conversation_id": "conv-7", "value": True, "id": "r-7"}]
    assert send(c.http_port, labels)[:3:2] == (200, {"accepted": 2})
    c.kill9()  # the machine goes down: receiver and flusher with it
    os.kill(flusher, signal.SIGKILL)
    assert read_feedback(c.data).height == 0
    c = collector_factory(grpc_port=c.grpc_port, http_port=c.http_port).start()
    assert send(c.http_port, labels)[0] == 200  # the client never saw the ack, and resends
    assert c.stop() == 0
    df = read_feedback(c.data)
    assert df.height == 2 and df["feedback_id"].n_unique() == 2
    assert sorted(df["value"].to_list()) == [1.0, 4.0]
    assert not list(c.wal.glob("*.sealed"))


# --- nightshift feedback FILE -----------------------------------------------------------


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli(["feedback", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


CSV = f"""trace_id,conversation_id,name,value,comment,time
{TRACE},,,0.5,"fine, mostly",2025-11-22T10:15:00Z
,conv-1,task_success,true,"two
lines",1763800000
{TRACE2},,,-1,,
"""


def test_csv_loads_once(tmp_path, capsys):
    data = tmp_path / "data"
    f = tmp_path / "labels.csv"
    f.write_text(CSV)
    rc, out, err = run_cli(capsys, f, "--data", data, "--name", "review")
    assert rc == 0, err
    assert "3 rows written, 0 duplicates, 0 skipped" in out
    df = read_feedback(data).sort("value")
    assert df["value"].to_list() == [-1.0, 0.5, 1.0]
    assert df["name"].to_list() == ["review", "review", "task_success"]
    assert df["trace_id"].to_list() == [TRACE2, TRACE.lower(), None]
    assert df["comment"].to_list() == [None, "fine, mostly", "two\nlines"]
    assert set(df["source"]) == {"file:labels.csv"}
    assert df["time"][1] == datetime(2025, 11, 22, 10, 15, tzinfo=timezone.utc)
    files = sorted((data / "feedback").rglob("*.parquet"))
    rc, out, _ = run_cli(capsys, f, "--data", data, "--name", "review")
    assert rc == 0 and "0 rows written, 3 duplicates" in out
    assert sorted((data / "feedback").rglob("*.parquet")) == files and read_feedback(data).height == 3
    # The same labels in another file are not stored again either.
    copy = tmp_path / "copy.csv"
    copy.write_text(CSV + f"{TRACE2},,,7,,\n")
    rc, out, _ = run_cli(capsys, copy, "--data", data, "--name", "review")
    assert rc == 0 and "1 rows written, 3 duplicates" in out


def test_parquet_and_jsonl(tmp_path, capsys):
    data = tmp_path / "data"
    pq_file = tmp_path / "labels.parquet"
    pl.DataFrame({
        "trace_id": [TRACE, None], "conversation_id": [None, "conv-2"], "value": [1, 0],
        "time": [datetime(2025, 11, 22, 10, 15), None], "id": ["a", "b"],
    }).write_parquet(pq_file)
    jl = tmp_path / "labels.jsonl"
    jl.write_text(json.dumps({"trace_id": TRACE2, "value": 0.1, "span_id": SPAN}) + "\n\n"
                  + json.dumps({"conversation_id": "conv-3", "value": False}) + "\n")
    rc, out, err = run_cli(capsys, pq_file, jl, "--data", data)
    assert rc == 0, err
    assert "2 file(s)" in out and "4 rows written" in out
    df = read_feedback(data)
    a = df.filter(pl.col("feedback_id") == "a").row(0, named=True)
    assert a["time"] == datetime(2025, 11, 22, 10, 15, tzinfo=timezone.utc)  # a zone-less timestamp is UTC
    assert (a["value"], a["name"], a["source"]) == (1.0, "feedback", "file:labels.parquet")
    assert df.filter(pl.col("source") == "file:labels.jsonl")["span_id"].drop_nulls().to_list() == [SPAN.lower()]


def test_missing_or_unknown_columns_write_nothing(tmp_path, capsys):
    data = tmp_path / "data"
    good = tmp_path / "good.csv"
    good.write_text(CSV)
    bad = tmp_path / "bad.csv"
    bad.write_text(f"trace_id,reward\n{TRACE},1\n")
    rc, _, err = run_cli(capsys, good, bad, "--data", data)
    assert rc == 2
    assert "missing required column(s): value" in err and "unknown column(s): reward" in err
    assert "columns found: trace_id, reward" in err and "nothing written" in err
    no_ids = tmp_path / "no_ids.csv"
    no_ids.write_text("value,comment\n1,x\n")
    rc, _, err = run_cli(capsys, no_ids, "--data", data)
    assert rc == 2 and "missing required column(s): trace_id or conversation_id" in err
    assert read_feedback(data).height == 0


def test_bad_rows_are_listed_and_skip_bad_writes_the_rest(tmp_path, capsys):
    data = tmp_path / "data"
    f = tmp_path / "labels.csv"
    f.write_text(
        "trace_id,value,comment\n"
        f"{TRACE},1,\"a\nmultiline comment\"\n"  # lines 2-3
        f"{TRACE},nan,\n"  # line 4
        "not-hex,1,\n"  # line 5
        f"{TRACE2},0,\n"  # line 6
        f"{TRACE2},,\n"  # line 7
    )
    rc, out, err = run_cli(capsys, f, "--data", data)
    assert rc == 1 and out == ""
    assert f"{f}: line 4: value: must be a finite number, got NaN" in err
    assert f"{f}: line 5: trace_id: must be 32 hex digits, got string 'not-hex'" in err
    assert f"{f}: line 7: value: required" in err
    assert "3 bad row(s); nothing written" in err
    assert read_feedback(data).height == 0
    rc, out, err = run_cli(capsys, f, "--data", data, "--skip-bad")
    assert rc == 0 and "2 rows written, 0 duplicates, 3 skipped" in out
    assert "line 4" in err
    assert sorted(read_feedback(data)["value"].to_list()) == [0.0, 1.0]
