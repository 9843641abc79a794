"""Logs as JSON lines (issue 26): one setting (--log-format, NIGHTSHIFT_LOG_FORMAT,
top-level `log_format:`) makes every server write one JSON object per stderr line,
its child processes included, so a cluster's log pipeline reads each line whole.
The servers are real processes; every line they write is parsed."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from helpers import make_request, post
from nightshift.settings import SettingsError

KEYS = {"time", "level", "logger", "message"}


def _records(text: str, what: str) -> list[dict]:
    """Every line of `text` as a JSON object with the four fields, or a failure that
    shows the line that is not."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"{what} line {n} is not JSON: {line[:300]!r}")
        assert isinstance(rec, dict) and KEYS <= set(rec), (what, line)
        assert rec["time"].endswith("Z")
        assert dt.datetime.fromisoformat(rec["time"].replace("Z", "+00:00")).utcoffset() == dt.timedelta(0)
        out.append(rec)
    assert out, f"{what} wrote nothing"
    return out


def test_the_collector_and_its_flusher_write_only_json_lines(collector_factory):
    c = collector_factory(extra_args=["--log-format", "json"])
    c.start()
    body = make_request(3)[0].SerializeToString()
    assert post(c.http_port, "/v1/traces", body)[0] == 200
    assert post(c.http_port, "/v1/traces", b"\x00not protobuf")[0] == 400  # a refusal, logged
    deadline = time.time() + 30
    while not list((c.data / "spans").rglob("*.parquet")) and time.time() < deadline:
        time.sleep(0.2)
    assert c.stop() == 0
    recs = _records(c.log_path.read_text(), "collect")
    pids = {r["pid"] for r in recs}
    flushed = [r for r in recs if r["logger"] == "nightshift.collector.flusher"]
    assert flushed and any("flushed" in r["message"] for r in flushed)
    assert len(pids) == 2 and flushed[0]["pid"] != c.proc.pid  # the spawned flusher set its own log up alike
    assert any("collector ready" in r["message"] for r in recs)


def test_the_route_proxy_writes_json_lines_from_the_yaml_setting(tmp_path):
    """The top-level `log_format: json` of the settings file, through `nightshift
    route` as deployed: a refused upstream, a malformed request and SIGTERM."""
    port, dead = free_port(), free_port()
    conf = tmp_path / "nightshift.yaml"
    conf.write_text(f"log_format: json\nroute:\n  listen: 127.0.0.1:{port}\n  upstream: http://127.0.0.1:{dead}\n"
                    f"  state: {tmp_path / 'routes.json'}\n  drain_timeout: 2\n")
    log = tmp_path / "route.log"
    env = {k: v for k, v in os.environ.items() if k != "NIGHTSHIFT_LOG_FORMAT"}
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "nightshift.cli", "route", "--config", str(conf)],
                                stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        deadline = time.time() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                assert time.time() < deadline, log.read_text()
                time.sleep(0.1)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST",
                                     data=b'{"model": "m", "messages": []}', headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 502
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"NOT A REQUEST\r\n\r\n")
            s.recv(1024)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    assert rc == 0
    recs = _records(log.read_text(), "route")
    assert any(r["level"] == "WARNING" and "routing proxy on" in r["message"] for r in recs)
    assert any("unreachable" in r["message"] for r in recs)


def test_the_model_server_stand_in_writes_json_lines_without_progress_bars(serve_factory):
    s = serve_factory(extra_args=["--log-format", "json"], env={"NIGHTSHIFT_LOG_FORMAT": ""}).start()
    urllib.request.urlopen(f"{s.url}/v1/models", timeout=10).read()
    s.stop()
    recs = _records(s.log_path.read_text(), "serve")
    assert any("stand-in for vLLM" in r["message"] for r in recs)


def test_a_refusal_before_the_log_is_set_up_is_a_json_line_too(tmp_path):
    """What a command says when it cannot start is a record like the log's, with the
    format taken from the environment (the settings file may be what is broken)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("collector: [not, a, mapping\n")
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "collect", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "NIGHTSHIFT_LOG_FORMAT": "json"})
    assert p.returncode == 2
    (rec,) = _records(p.stderr, "collect")
    assert rec["level"] == "ERROR" and "is not valid YAML" in rec["message"]


def test_log_format_comes_from_the_flag_then_the_environment_then_the_file(tmp_path):
    from nightshift.settings import log_format

    conf = tmp_path / "n.yaml"
    conf.write_text("log_format: json\n")
    assert log_format(str(conf), None, {}) == "json"
    assert log_format(str(conf), None, {"NIGHTSHIFT_LOG_FORMAT": "text"}) == "text"
    assert log_format(str(conf), "text", {"NIGHTSHIFT_LOG_FORMAT": "json"}) == "text"
    assert log_format(None, None, {}) == "text"
    with pytest.raises(SettingsError, match=r"^NIGHTSHIFT_LOG_FORMAT \(log_format\): must be one of text, json, "
                                            r"got 'xml'$"):
        log_format(str(conf), None, {"NIGHTSHIFT_LOG_FORMAT": "xml"})
    conf.write_text("log_format: yaml\n")
    with pytest.raises(SettingsError, match=r"n\.yaml \(log_format\): must be one of text, json, got 'yaml'$"):
        log_format(str(conf), None, {})


def test_an_exception_and_extra_fields_stay_inside_one_line():
    from nightshift.settings.logs import JsonFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("nightshift.test_json_logs")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise ValueError("two\nlines")
        except ValueError:
            log.error("flush of %s failed", "seg-1", exc_info=True, extra={"segment": "seg-1", "bytes": 12})
    finally:
        log.removeHandler(handler)
        log.propagate = True
    (rec,) = _records(out.getvalue(), "formatter")
    assert rec["message"] == "flush of seg-1 failed" and rec["segment"] == "seg-1" and rec["bytes"] == 12
    assert rec["exception"]["type"] == "ValueError" and "Traceback" in rec["exception"]["traceback"]


def test_vllm_is_given_a_logging_config_that_writes_our_json_lines(capsys):
    """`nightshift serve --engine vllm --log-format json` hands vLLM a dictConfig
    (VLLM_LOGGING_CONFIG_PATH): applied, vLLM's and uvicorn's loggers write our lines.
    (vLLM itself needs a GPU; the config is what it would load.)"""
    import logging.config

    from nightshift.cli.serve_cmd import vllm_json_logging

    env = vllm_json_logging("info")
    assert env["VLLM_CONFIGURE_LOGGING"] == "1"
    path = Path(env["VLLM_LOGGING_CONFIG_PATH"])
    try:
        logging.config.dictConfig(json.loads(path.read_text()))
        logging.getLogger("vllm.engine").info("loaded %s", "agent@v0001")
        logging.getLogger("uvicorn.access").info("GET /v1/models 200")
    finally:
        path.unlink()
        for name in ("vllm", "uvicorn", "uvicorn.access", "uvicorn.error"):
            logging.getLogger(name).handlers.clear()
            logging.getLogger(name).propagate = True
    recs = _records(capsys.readouterr().err, "vllm")
    assert [r["message"] for r in recs] == ["loaded agent@v0001", "GET /v1/models 200"]
