"""One name for one thing on every command, one settings file for every command,
and `--help` that says true things and ends the same way (issue 26). In-process:
the parser, the settings and the commands' refusals, no server needed."""

from __future__ import annotations

import argparse
import json
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from nightshift.cli.main import SECTIONS, build_parser, main
from nightshift.settings import check_sections, flags_of, load


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    out = dict(sub)
    acts = next(a for a in sub["route"]._actions if a.dest == "route_action").choices
    out.update({f"route {k}": v for k, v in acts.items()})
    return out


def _options(p: argparse.ArgumentParser) -> set[str]:
    return {o for a in p._actions for o in a.option_strings}


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_checkpoints_folder_is_dash_dash_checkpoints_on_every_command_that_takes_it():
    cmds = _commands()
    for name in ("train", "checkpoints", "merge", "publish", "rollback", "watch", "versions"):
        assert "--checkpoints" in _options(cmds[name]), name
    # train's flag sets the YAML key it always had, and its help says which
    a = build_parser().parse_args(["train", "--base-model", "/m", "--checkpoints", "/ck"])
    from nightshift.trainer.config import TrainConfig

    assert load(TrainConfig, "train", None, flags_of(TrainConfig, a), {}).output == "/ck"
    assert "[YAML train.output]" in " ".join(cmds["train"].format_help().split())


def test_output_still_works_and_says_once_that_it_is_deprecated(tmp_path, capsys):
    from nightshift.settings import notes
    from nightshift.trainer.config import TrainConfig

    a = build_parser().parse_args(["train", "--base-model", "/m", "--output", "/old", "--output", "/ck"])
    assert load(TrainConfig, "train", None, flags_of(TrainConfig, a), {}).output == "/ck"
    assert notes(a) == ["--output is deprecated: use --checkpoints (the same setting; --output still works for now)"]
    (tmp_path / "v0001").mkdir()
    (tmp_path / "v0001" / "manifest.json").write_text(json.dumps({"version": "v0001", "algorithm": "sft"}))
    code, out, err = _run(capsys, "checkpoints", "--output", tmp_path, "--output", tmp_path, "--json")
    assert code == 0 and json.loads(out)["version"] == "v0001"
    assert err.count("--output is deprecated: use --checkpoints") == 1


def test_publish_rollback_merge_and_checkpoints_read_the_nightly_jobs_settings_file(tmp_path, capsys, monkeypatch):
    """The file `nightshift nightly --config` reads: `publish:` for the server and the
    names, `train.output` for the checkpoints folder, `train.base_model` for merging."""
    for var in ("NIGHTSHIFT_NIGHTLY_VLLM_URL", "NIGHTSHIFT_PUBLISH_VLLM_URL"):
        monkeypatch.delenv(var, raising=False)
    ck = tmp_path / "ck"
    (ck / "v0002").mkdir(parents=True)
    (ck / "v0002" / "manifest.json").write_text(json.dumps({"version": "v0002", "algorithm": "sft"}))
    conf = tmp_path / "nightshift.yaml"
    conf.write_text(f"data: {tmp_path / 'data'}\ntrain:\n  base_model: {tmp_path / 'no-base'}\n  output: {ck}\n"
                    "publish:\n  vllm_url: http://127.0.0.1:9\n  name: agent\n")
    for name in ("publish", "rollback", "merge", "checkpoints"):
        assert "--config" in _options(_commands()[name]), name

    code, out, _ = _run(capsys, "checkpoints", "--config", conf)
    assert code == 0 and out.startswith("v0002")
    code, _, err = _run(capsys, "rollback", "--config", conf)
    assert code == 1 and f"nothing has been published to http://127.0.0.1:9 as 'agent' (see {ck}/published.json)" in err
    code, _, err = _run(capsys, "publish", "--config", conf, "--checkpoint", "v0009")
    assert code == 1 and f"{ck}/v0009 is not a checkpoint version" in err
    code, _, err = _run(capsys, "merge", "--config", conf, "v0002", tmp_path / "merged")
    assert code == 1 and f"{ck}/v0002 is not a checkpoint: no adapter_config.json" in err


def test_publish_names_its_server_somewhere_or_refuses(tmp_path, capsys, monkeypatch):
    for var in ("NIGHTSHIFT_NIGHTLY_VLLM_URL", "NIGHTSHIFT_PUBLISH_VLLM_URL"):
        monkeypatch.delenv(var, raising=False)
    code, _, err = _run(capsys, "publish", "--checkpoint", tmp_path)
    assert code == 2 and "say which server: --vllm-url URL, publish.vllm_url in --config, or " \
                          "NIGHTSHIFT_PUBLISH_VLLM_URL" in err
    monkeypatch.setenv("NIGHTSHIFT_PUBLISH_VLLM_URL", "http://127.0.0.1:9")
    code, _, err = _run(capsys, "publish", "--checkpoint", tmp_path)
    assert code == 1 and "is not a checkpoint version" in err  # past the settings: the variable named the server


def test_every_commands_help_ends_with_its_yaml_section_its_variables_and_its_exit_codes():
    for name, p in _commands().items():
        assert {"--config", "--log-format"} <= _options(p), name
        last = p.format_help().rstrip().split("\n\n")[-1]
        starts = [line.split(":")[0] for line in last.splitlines() if not line.startswith(" ")]
        assert starts == ["YAML (--config FILE)", "Environment", "Exit codes"], (name, last)
        assert "NIGHTSHIFT_" in last and " 0 " in last.replace("\n", " "), (name, last)


def test_publish_help_says_the_stable_name_moves_by_unload_and_load():
    """vLLM's load_inplace is never used (it re-reads the adapter every step): the
    stable name is unloaded and loaded, and absent for that moment."""
    text = " ".join(_commands()["publish"].format_help().split())
    assert "reloaded in place" not in text
    assert "--stable-name, moved to it by unload + load" in text
    assert "moved to each new version by unload + load" in text


def test_the_nightly_help_example_is_a_settings_file_the_job_accepts_with_the_default_algorithm(tmp_path):
    from nightshift.cli.publish_cmd import NIGHTLY_EPILOG
    from nightshift.nightly.run import NightlyConfig
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig

    example = NIGHTLY_EPILOG.split("\n\n")[1]  # the YAML block between the heading and cron
    f = tmp_path / "example.yaml"
    f.write_text(textwrap.dedent(example))
    check_sections(str(f), SECTIONS)
    load(TransformConfig, "transform", str(f), env={})
    from nightshift.publish.publish import MOVED

    said: list[str] = []
    night = load(NightlyConfig, "nightly", str(f), env={}, moved=MOVED, notes=said)
    train = load(TrainConfig, "train", str(f), env={}, check=False)
    assert yaml.safe_load(f.read_text())["train"]["algorithm"] == train.algorithm == TrainConfig().algorithm
    assert night.gate.command == "python eval.py"
    assert night.vllm_url == "http://vllm:8000" and said == []  # the publishing keys in their own section


class _NotFound(BaseHTTPRequestHandler):
    hits = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        type(self).hits += 1
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error": {"message": "The model `agent` does not exist.", "type": "NotFoundError", "code": 404}}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_404_while_the_stable_name_moves_is_not_retried_by_an_openai_client_and_the_docstring_says_so():
    """What vLLM answers for a name being reloaded is a 404; the openai client
    retries 408, 409, 429 and 5xx, so the agent's call fails: the docstring of the
    step that opens that window must not promise a retry."""
    import openai

    from nightshift.publish.change import load_fresh

    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="x", max_retries=2)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()
    assert _NotFound.hits == 1
    doc = " ".join(load_fresh.__doc__.split())
    assert "an OpenAI client does not retry" in doc and "an OpenAI client retries." not in doc


def test_commands_given_no_checkpoints_folder_use_the_one_train_writes(tmp_path, capsys, monkeypatch):
    """train writes to ./nightshift-checkpoints by default; rollback used to demand
    --checkpoints: every command now finds the same default."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NIGHTSHIFT_TRAIN_OUTPUT", raising=False)
    code, _, err = _run(capsys, "rollback", "--vllm-url", "http://127.0.0.1:9")
    assert code == 1 and "(see ./nightshift-checkpoints/published.json)" in err
    monkeypatch.setenv("NIGHTSHIFT_TRAIN_OUTPUT", str(tmp_path / "elsewhere"))
    code, _, err = _run(capsys, "checkpoints")
    assert code == 1 and f"no checkpoints under {tmp_path / 'elsewhere'}" in err
