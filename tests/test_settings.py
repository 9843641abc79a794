"""Settings: defaults < YAML < NIGHTSHIFT_* environment < flags, and the CLI's use of them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nightshift.settings import SettingsError, load
from nightshift.collector.config import CollectorConfig
from nightshift.collector.redact import DEFAULT_PRESETS


def cfg(tmp_path: Path, yaml_text: str | None = None, env: dict | None = None, flags: dict | None = None):
    path = None
    if yaml_text is not None:
        path = tmp_path / "nightshift.yaml"
        path.write_text(yaml_text)
    return load(CollectorConfig, "collector", str(path) if path else None, flags, env or {})


def test_defaults(tmp_path):
    c = cfg(tmp_path)
    assert c == CollectorConfig()
    assert c.data == "./nightshift-data"
    assert c.redact.presets == list(DEFAULT_PRESETS)
    assert c.wal_dir() == "./nightshift-data/wal"


def test_precedence_defaults_yaml_env_flags(tmp_path):
    yaml_text = """
data: /from/yaml/top
collector:
  grpc: 127.0.0.1:1111
  http: 127.0.0.1:2222
  token: yaml-token
  max_inflight: 10
"""
    only_yaml = cfg(tmp_path, yaml_text)
    assert (only_yaml.data, only_yaml.grpc, only_yaml.http, only_yaml.token) == (
        "/from/yaml/top", "127.0.0.1:1111", "127.0.0.1:2222", "yaml-token")
    assert only_yaml.max_inflight == 10
    assert only_yaml.grpc_workers == CollectorConfig().grpc_workers  # untouched default

    env = {"NIGHTSHIFT_DATA": "/from/env", "NIGHTSHIFT_COLLECTOR_HTTP": "127.0.0.1:3333",
           "NIGHTSHIFT_COLLECTOR_TOKEN": "env-token", "NIGHTSHIFT_COLLECTOR_GRPC_WORKERS": "4"}
    with_env = cfg(tmp_path, yaml_text, env)
    assert (with_env.data, with_env.grpc, with_env.http, with_env.token) == (
        "/from/env", "127.0.0.1:1111", "127.0.0.1:3333", "env-token")
    assert with_env.grpc_workers == 4 and with_env.max_inflight == 10

    flags = {"data": "/from/flag", "token": "flag-token", "http": None, "grpc": None}
    with_flags = cfg(tmp_path, yaml_text, env, flags)
    assert (with_flags.data, with_flags.grpc, with_flags.http, with_flags.token) == (
        "/from/flag", "127.0.0.1:1111", "127.0.0.1:3333", "flag-token")
    assert with_flags.wal_dir() == "/from/flag/wal"


def test_section_data_overrides_top_level_data(tmp_path):
    c = cfg(tmp_path, "data: /top\ncollector:\n  data: /section\n")
    assert c.data == "/section"


def test_other_sections_are_ignored(tmp_path):
    c = cfg(tmp_path, "trainer:\n  epochs: 3\ncollector:\n  token: t\n")
    assert c.token == "t"


def test_nested_redact_settings_from_yaml(tmp_path):
    c = cfg(tmp_path, """
collector:
  redact:
    presets: [email, credit_card]
    drop_keys: [password]
    rules:
      - {name: ticket, pattern: "TICKET-[0-9]+"}
""")
    assert c.redact.presets == ["email", "credit_card"]
    assert c.redact.drop_keys == ["password"]
    assert c.redact.rules == [{"name": "ticket", "pattern": "TICKET-[0-9]+"}]


def test_nested_redact_settings_from_env(tmp_path):
    env = {
        "NIGHTSHIFT_COLLECTOR_REDACT_PRESETS": "email,api_key",
        "NIGHTSHIFT_COLLECTOR_REDACT_DROP_KEYS": " a , b ,",
        "NIGHTSHIFT_COLLECTOR_REDACT_RULES": '[{"name": "x", "pattern": "y+"}]',
    }
    c = cfg(tmp_path, "collector:\n  redact:\n    presets: [bearer]\n", env)
    assert c.redact.presets == ["email", "api_key"]
    assert c.redact.drop_keys == ["a", "b"]
    assert c.redact.rules == [{"name": "x", "pattern": "y+"}]


def test_empty_presets_turn_redaction_off(tmp_path):
    assert cfg(tmp_path, "collector:\n  redact:\n    presets: []\n").redact.presets == []


def test_storage_options_mapping_from_env(tmp_path):
    c = cfg(tmp_path, env={"NIGHTSHIFT_COLLECTOR_STORAGE_OPTIONS": '{"anon": true, "endpoint_url": "http://x"}'})
    assert c.storage_options == {"anon": True, "endpoint_url": "http://x"}


@pytest.mark.parametrize(
    "text,expect",
    [("1MiB", 1 << 20), ("64MiB", 64 << 20), ("2GB", 2 * 10**9), ("2gib", 2 << 30), ("512", 512),
     ("1.5KiB", 1536), ("10 kb", 10_000), ("1_000", 1000)],
)
def test_sizes(tmp_path, text, expect):
    c = cfg(tmp_path, f"collector:\n  max_request_bytes: '{text}'\n", {"NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES": text})
    assert c.max_request_bytes == expect
    assert c.wal_cap_bytes == expect


@pytest.mark.parametrize("text,expect", [("500ms", 0.5), ("10s", 10.0), ("5m", 300.0), ("2h", 7200.0), ("1.5", 1.5),
                                         ("2min", 120.0)])
def test_durations(tmp_path, text, expect):
    c = cfg(tmp_path, f"collector:\n  flush_interval: '{text}'\n", {"NIGHTSHIFT_COLLECTOR_SHUTDOWN_TIMEOUT": text})
    assert c.flush_interval == pytest.approx(expect)
    assert c.shutdown_timeout == pytest.approx(expect)


def test_yaml_numbers_and_booleans(tmp_path):
    c = cfg(tmp_path, "collector:\n  flush_interval: 2\n  fsync: false\n  segment_bytes: 1048576\n")
    assert c.flush_interval == 2.0 and isinstance(c.flush_interval, float)
    assert c.fsync is False
    assert c.segment_bytes == 1 << 20


@pytest.mark.parametrize("text,expect", [("false", False), ("0", False), ("no", False), ("on", True), ("TRUE", True)])
def test_booleans_from_env(tmp_path, text, expect):
    assert cfg(tmp_path, env={"NIGHTSHIFT_COLLECTOR_FSYNC": text}).fsync is expect


def test_listener_off_in_yaml(tmp_path):
    c = cfg(tmp_path, "collector:\n  grpc: off\n  http: off\n")
    assert (c.grpc, c.http) == ("off", "off")


def test_listener_off_from_env_and_quoted_yaml(tmp_path):
    assert cfg(tmp_path, env={"NIGHTSHIFT_COLLECTOR_GRPC": "off"}).grpc == "off"
    assert cfg(tmp_path, "collector:\n  http: 'off'\n").http == "off"


def test_unknown_key_in_yaml_names_it(tmp_path):
    with pytest.raises(SettingsError, match="grcp"):
        cfg(tmp_path, "collector:\n  grcp: 127.0.0.1:4317\n")


def test_unknown_nested_key_names_it(tmp_path):
    with pytest.raises(SettingsError, match=r"redact.*'preset'"):
        cfg(tmp_path, "collector:\n  redact:\n    preset: [email]\n")


def test_nested_group_must_be_a_mapping(tmp_path):
    with pytest.raises(SettingsError, match="redact"):
        cfg(tmp_path, "collector:\n  redact: email\n")


@pytest.mark.parametrize("text", ["collector: [unclosed\n", "collector:\n  grpc: 'x\n", "a: b: c\n"])
def test_invalid_yaml(tmp_path, text):
    with pytest.raises(SettingsError, match="not valid YAML"):
        cfg(tmp_path, text)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n"])
def test_yaml_top_level_must_be_a_mapping(tmp_path, text):
    with pytest.raises(SettingsError):
        cfg(tmp_path, text)


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(SettingsError, match="collector"):
        cfg(tmp_path, "collector: 5\n")


def test_missing_config_file(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        load(CollectorConfig, "collector", str(tmp_path / "absent.yaml"), None, {})


def test_empty_yaml_file_is_defaults(tmp_path):
    assert cfg(tmp_path, "") == CollectorConfig()


@pytest.mark.parametrize(
    "var,value",
    [
        ("NIGHTSHIFT_COLLECTOR_MAX_INFLIGHT", "lots"),
        ("NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES", "12 parsecs"),
        ("NIGHTSHIFT_COLLECTOR_WAL_CAP_BYTES", "1.2.3"),
        ("NIGHTSHIFT_COLLECTOR_FLUSH_INTERVAL", "soon"),
        ("NIGHTSHIFT_COLLECTOR_FSYNC", "maybe"),
        ("NIGHTSHIFT_COLLECTOR_STORAGE_OPTIONS", "{not json"),
        ("NIGHTSHIFT_COLLECTOR_STORAGE_OPTIONS", "[1]"),
        ("NIGHTSHIFT_COLLECTOR_REDACT_RULES", "[broken"),
    ],
)
def test_bad_value_in_env(tmp_path, var, value):
    with pytest.raises(SettingsError, match=var.removeprefix("NIGHTSHIFT_COLLECTOR_").lower().replace("redact_", "redact.")):
        cfg(tmp_path, env={var: value})


def test_bad_value_in_yaml_names_file_and_key(tmp_path):
    with pytest.raises(SettingsError) as exc:
        cfg(tmp_path, "collector:\n  max_inflight: many\n")
    assert "nightshift.yaml" in str(exc.value) and "max_inflight" in str(exc.value)


def test_env_is_read_from_os_environ_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("NIGHTSHIFT_COLLECTOR_TOKEN", "from-os-env")
    assert load(CollectorConfig, "collector").token == "from-os-env"


def test_wal_dir_for_remote_data(tmp_path):
    assert cfg(tmp_path, flags={"data": "s3://bucket/prefix"}).wal_dir() == "./nightshift-wal"
    assert cfg(tmp_path, flags={"data": "file:///srv/data/"}).wal_dir() == "/srv/data/wal"
    assert cfg(tmp_path, flags={"data": "/d", "wal": "/w"}).wal_dir() == "/w"


# --- the command line ---------------------------------------------------------------------------


def _nightshift() -> list[str]:
    script = Path(sys.executable).parent / "nightshift"
    return [str(script)] if script.exists() else [sys.executable, "-m", "nightshift.cli"]


def _run(args: list[str], tmp_path: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, **kw)


def test_help(tmp_path):
    top = _run([*_nightshift(), "--help"], tmp_path)
    assert top.returncode == 0, top.stderr
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in top.stdout
    for cmd in ("collect", "ingest", "show"):
        assert cmd in top.stdout
    collect = _run([sys.executable, "-m", "nightshift.cli", "collect", "--help"], tmp_path)
    assert collect.returncode == 0, collect.stderr
    assert "--data" in collect.stdout and "OTEL_EXPORTER_OTLP_ENDPOINT" in collect.stdout
    assert "--grpc" in collect.stdout and "--wal" in collect.stdout


def test_no_command_prints_help_and_exits_2(tmp_path):
    r = _run([sys.executable, "-m", "nightshift.cli"], tmp_path)
    assert r.returncode == 2
    assert "collect" in r.stdout


def test_collect_with_unknown_key_in_config_exits_2(tmp_path):
    conf = tmp_path / "bad.yaml"
    conf.write_text("collector:\n  listen_everywhere: true\n")
    r = _run([sys.executable, "-m", "nightshift.cli", "collect", "--config", str(conf),
              "--data", str(tmp_path / "data"), "--grpc", "off", "--http", "off"], tmp_path)
    assert r.returncode == 2
    assert "configuration error" in r.stderr
    assert "listen_everywhere" in r.stderr
    assert not (tmp_path / "data").exists()  # refused before touching anything


def test_collect_with_bad_env_value_exits_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTSHIFT_")}
    env["NIGHTSHIFT_COLLECTOR_MAX_INFLIGHT"] = "plenty"
    r = subprocess.run([sys.executable, "-m", "nightshift.cli", "collect", "--data", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert r.returncode == 2
    assert "configuration error" in r.stderr and "max_inflight" in r.stderr


def test_a_bad_value_names_its_setting_its_value_and_where_it_came_from(tmp_path):
    with pytest.raises(SettingsError, match=r"^NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES='lots' \(collector\.max_request_bytes\): "
                                            r"not a size or integer: 'lots'"):
        cfg(tmp_path, env={"NIGHTSHIFT_COLLECTOR_MAX_REQUEST_BYTES": "lots"})
    with pytest.raises(SettingsError, match=r"nightshift\.yaml \(collector\.max_request_bytes\): not a size"):
        cfg(tmp_path, "collector:\n  max_request_bytes: lots\n")
    from nightshift.transform.config import TransformConfig

    with pytest.raises(SettingsError, match=r"^--settle \(transform\.settle\): not a number or duration: 'soon'"):
        load(TransformConfig, "transform", None, {"settle": "soon"}, {})


def test_publish_flags_are_made_from_the_one_declaration_and_read_like_any_setting(tmp_path):
    import argparse
    import dataclasses

    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import PublishSettings
    from nightshift.settings import add_flags, flags_of

    p = argparse.ArgumentParser()
    add_flags(p, PublishSettings, required=("vllm_url",))
    help_text = p.format_help()
    for f in dataclasses.fields(PublishSettings):  # every setting has its flag and its documentation
        assert "--" + f.name.replace("_", "-") in help_text and f.metadata["help"][:20] in " ".join(help_text.split())
    args = p.parse_args(["--vllm-url", "http://h:1", "--keep", "5"])
    s = load(PublishSettings, "publish", None, flags_of(PublishSettings, args), {"NIGHTSHIFT_PUBLISH_NAME": "agent"})
    assert (s.vllm_url, s.keep, s.name, s.mode) == ("http://h:1", 5, "agent", "lora")
    with pytest.raises(SettingsError, match=r"^--keep \(publish\.keep\): not a size or integer: 'many'"):
        load(PublishSettings, "publish", None, flags_of(PublishSettings, p.parse_args(["--vllm-url", "u", "--keep", "many"])), {})
    # the nightly job's YAML takes the same publishing keys, declared nowhere else
    assert {f.name for f in dataclasses.fields(PublishSettings)} <= {f.name for f in dataclasses.fields(NightlyConfig)}
    with pytest.raises(SettingsError, match=r"^NIGHTSHIFT_NIGHTLY_MODE='fast' \(nightly\.mode\): must be one of lora, full, "
                                            r"got 'fast'"):
        load(NightlyConfig, "nightly", None, None, {"NIGHTSHIFT_NIGHTLY_MODE": "fast"})


# --- one declaration per setting, for every stage ----------------------------------------------------


def _every_config():
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import PublishSettings
    from nightshift.route.config import RouteConfig
    from nightshift.serve.config import ServeConfig
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig

    return [(CollectorConfig, "collector"), (TransformConfig, "transform"), (TrainConfig, "train"),
            (NightlyConfig, "nightly"), (PublishSettings, "publish"), (ServeConfig, "serve"), (RouteConfig, "route")]


def test_every_setting_of_every_stage_is_declared_with_its_documentation():
    import dataclasses
    import typing

    def fields(cls, path):
        for f in dataclasses.fields(cls):
            yield f"{path}.{f.name}", f
            nested = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(nested):
                yield from fields(nested, f"{path}.{f.name}")

    import typing

    undocumented = [path for cls, section in _every_config() for path, f in fields(cls, section)
                    if len((f.metadata or {}).get("help", "")) < 3]
    assert undocumented == []


def test_collect_build_train_and_serve_flags_are_made_from_the_declarations_and_keep_their_old_names(tmp_path):
    from nightshift.cli.main import build_parser
    from nightshift.settings import flag_names
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    old = {"collect": ["--data", "--grpc", "--http", "--wal", "--token", "--tls-cert", "--tls-key", "--log-level", "--config"],
           "build": ["--data", "--since", "--until", "--settle", "--credit", "--incremental", "--quiet", "--config"],
           "train": ["--data", "--base-model", "--output", "--algorithm", "--served-model-name", "--init-adapter",
                     "--since", "--until", "--agents", "--epochs", "--max-steps", "--learning-rate", "--batch-size",
                     "--full", "--chat-template", "--quiet", "--config"]}
    from nightshift.serve.config import ServeConfig

    old["serve"] = ["--engine", "--model", "--served-model-name", "--host", "--port", "--api-key", "--max-lora-rank",
                    "--max-loras", "--tool-call-parser", "--dtype", "--dry-run", "--log-level"]
    for cmd, cls in (("collect", CollectorConfig), ("build", TransformConfig), ("train", TrainConfig),
                     ("serve", ServeConfig)):
        options = {o for a in sub[cmd]._actions for o in a.option_strings}
        assert set(old[cmd]) <= options, set(old[cmd]) - options
        assert set(flag_names(cls).values()) <= options  # every declared setting has its flag
        help_text = " ".join(sub[cmd].format_help().split())
        for path in flag_names(cls):  # ... and its documentation
            _, f, _ = _declared_field(cls, path)
            assert " ".join(f.metadata["help"].split())[:25] in help_text, (cmd, path)
    assert {o for a in sub["ingest"]._actions for o in a.option_strings} >= {"--data", "--log-level", "--config", "--quiet"}
    assert "--grpc" not in {o for a in sub["ingest"]._actions for o in a.option_strings}


def _declared_field(cls, path):
    from nightshift.settings import _field  # noqa: PLC2701 - the declaration a flag was made from

    return _field(cls, path)


def test_nested_and_renamed_flags_reach_their_settings():
    from nightshift.cli.main import build_parser
    from nightshift.settings import flags_of
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig

    p = build_parser()
    a = p.parse_args(["train", "--base-model", "/m", "--pg-kl-coef", "0.05", "--since", "2025-11-01", "--agents",
                      "writer,rewriter", "--no-select-require-reward", "--full", "--epochs", "2"])
    t = load(TrainConfig, "train", None, flags_of(TrainConfig, a), {})
    assert (t.base_model, t.pg.kl_coef, t.select.since, t.select.agents, t.select.require_reward, t.full_finetune,
            t.epochs) == ("/m", 0.05, "2025-11-01", "writer,rewriter", False, True, 2.0)
    a = p.parse_args(["build", "--credit", "discounted", "--credit-gamma", "0.5", "--reward-keys", "app.r,app.s",
                      "--incremental"])
    b = load(TransformConfig, "transform", None, flags_of(TransformConfig, a), {})
    assert (b.credit.strategy, b.credit.gamma, b.reward.keys, b.incremental) == ("discounted", 0.5, ["app.r", "app.s"], True)
    untouched = load(TransformConfig, "transform", None, flags_of(TransformConfig, p.parse_args(["build"])), {})
    assert untouched == TransformConfig()


@pytest.mark.parametrize("source,expect", [
    ("flag", r"^--credit-gamma \(transform\.credit\.gamma\): must be in \[0, 1\], got 1\.5$"),
    ("env", r"^NIGHTSHIFT_TRANSFORM_CREDIT_GAMMA='1.5' \(transform\.credit\.gamma\): must be in \[0, 1\], got 1\.5$"),
    ("yaml", r"^.*nightshift\.yaml \(transform\.credit\.gamma\): must be in \[0, 1\], got 1\.5$"),
])
def test_a_value_out_of_its_declared_range_names_setting_value_and_source(tmp_path, source, expect):
    from nightshift.transform.config import TransformConfig

    f = tmp_path / "nightshift.yaml"
    f.write_text("transform:\n  credit: {gamma: 1.5}\n")
    with pytest.raises(SettingsError, match=expect):
        load(TransformConfig, "transform", str(f) if source == "yaml" else None,
             {"credit": {"gamma": "1.5"}} if source == "flag" else None,
             {"NIGHTSHIFT_TRANSFORM_CREDIT_GAMMA": "1.5"} if source == "env" else {})


@pytest.mark.parametrize("section,env,expect", [
    ("train", {"NIGHTSHIFT_TRAIN_LEARNING_RATE": "nan"}, r"train\.learning_rate\): must be in \(0, inf\), got nan"),
    ("train", {"NIGHTSHIFT_TRAIN_PG_CLIP": "ppo2"}, r"train\.pg\.clip\): must be one of topr, ppo, truncate, none"),
    ("train", {"NIGHTSHIFT_TRAIN_SELECT_SINCE": "2025/11/01"}, r"train\.select\.since\): '2025/11/01' is not of the form YYYY-MM-DD"),
    ("train", {"NIGHTSHIFT_TRAIN_SELECT_AGENTS": "writer("}, r"train\.select\.agents\): not a valid regex"),
    ("train", {"NIGHTSHIFT_TRAIN_LORA_R": "1024"}, r"train\.lora\.r\): must be in \[1, 512\], got 1024"),
    ("transform", {"NIGHTSHIFT_TRANSFORM_REWARD_PREFER": "feedback,vibes"}, r"must be one of feedback, function, span, got 'vibes'"),
    ("transform", {"NIGHTSHIFT_TRANSFORM_REWARD_DEFAULT": "nan"}, r"transform\.reward\.default\): 'nan' is not of the form NUMBER"),
    ("collector", {"NIGHTSHIFT_COLLECTOR_GRPC": "everywhere"}, r"collector\.grpc\): 'everywhere' is not of the form HOST:PORT\|off"),
    ("collector", {"NIGHTSHIFT_COLLECTOR_REDACT_PRESETS": "api_key,phone"}, r"collector\.redact\.presets\): unknown preset\(s\) 'phone'"),
    ("collector", {"NIGHTSHIFT_COLLECTOR_TLS_CERT": "/c.pem"}, r"collector\.tls_cert\): tls_cert and tls_key go together"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_GATE_RANKING_CONFIDENCE": "1"}, r"nightly\.gate\.ranking_confidence\): must be in \[0\.5, 1\)"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_KEEP": "0"}, r"nightly\.keep\): must be in \[1, inf\), got 0"),
    ("serve", {"NIGHTSHIFT_SERVE_MODEL": "/m", "NIGHTSHIFT_SERVE_MAX_LORA_RANK": "24"},
     r"serve\.max_lora_rank\): must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512, got 24"),
    ("serve", {}, r"^serve\.model: required"),
    ("route", {"NIGHTSHIFT_ROUTE_UPSTREAM": "vllm:8000"}, r"route\.upstream\): 'vllm:8000' is not of the form http\(s\)://HOST:PORT"),
    ("route", {"NIGHTSHIFT_ROUTE_MISSING_TTL": "-1"}, r"route\.missing_ttl\): not a number or duration: '-1'|must be in"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_CANARY_SHARE": "0.2"}, r"^nightly\.canary\.route_url: canary\.share > 0 needs"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_CANARY_SHARE": "0.2", "NIGHTSHIFT_NIGHTLY_CANARY_ROUTE_URL": "http://r:8100",
                 "NIGHTSHIFT_NIGHTLY_STABLE_NAME": "agent", "NIGHTSHIFT_NIGHTLY_MODE": "full"},
     r"NIGHTSHIFT_NIGHTLY_MODE='full' \(nightly\.mode\): a canary is an adapter loaded beside"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_CANARY_SHARE": "1"}, r"nightly\.canary\.share\): must be in \[0, 1\), got 1\.0"),
    ("nightly", {"NIGHTSHIFT_NIGHTLY_WATCH_ALPHA": "0"}, r"nightly\.watch\.alpha\): must be in \(0, 1\), got 0\.0"),
])
def test_every_stage_checks_its_values_one_way(section, env, expect):
    cls = dict((s, c) for c, s in _every_config())[section]
    env = {"NIGHTSHIFT_TRAIN_BASE_MODEL": "/m", **env}
    with pytest.raises(SettingsError, match=expect):
        load(cls, section, None, None, env)


def test_rules_between_settings_name_the_setting_and_where_it_was_set(tmp_path):
    from nightshift.trainer.config import TrainConfig
    from nightshift.transform.config import TransformConfig

    with pytest.raises(SettingsError, match=r"^train\.base_model: required: the model to train"):
        load(TrainConfig, "train", None, None, {})
    with pytest.raises(SettingsError, match=r"^NIGHTSHIFT_TRAIN_INIT_ADAPTER='/a' \(train\.init_adapter\): init_adapter "
                                            r"continues a LoRA adapter"):
        load(TrainConfig, "train", None, {"full_finetune": True}, {"NIGHTSHIFT_TRAIN_BASE_MODEL": "/m",
                                                                    "NIGHTSHIFT_TRAIN_INIT_ADAPTER": "/a"})
    with pytest.raises(SettingsError, match=r"^--incremental \(transform\.incremental\): incremental builds find their own"):
        load(TransformConfig, "transform", None, {"incremental": True, "since": "2025-11-01"}, {})
    cfg = load(TrainConfig, "train", None, None, {"NIGHTSHIFT_TRAIN_BASE_MODEL": "/m"})
    cfg.algorithm = "grpo"  # a value set in code is checked the same way
    with pytest.raises(SettingsError, match=r"^train\.algorithm: must be one of pg, awr, sft, kto, dpo, got 'grpo'"):
        cfg.check()


def test_build_with_a_bad_flag_exits_2_and_says_which(tmp_path):
    r = _run([sys.executable, "-m", "nightshift.cli", "build", "--data", str(tmp_path / "d"), "--credit-gamma", "2"], tmp_path)
    assert r.returncode == 2
    assert "--credit-gamma (transform.credit.gamma): must be in [0, 1], got 2.0" in r.stderr
    r = _run([sys.executable, "-m", "nightshift.cli", "train", "--help"], tmp_path)
    assert r.returncode == 0 and "--pg-kl-coef" in r.stdout and "train.pg (YAML train: pg:, env NIGHTSHIFT_TRAIN_PG_*)" in r.stdout


# --- issue 24: one sentence for every bad setting ----------------------------------------------------


def _main(capsys, *argv) -> tuple[int, str]:
    """`nightshift ...` in this process (it stops at the settings, before starting anything)."""
    from nightshift.cli.main import main

    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def _unstartable(tmp_path: Path) -> list:
    """Flags with which `collect` could not start even if its settings were let
    through (a WAL folder under a file): a missed check fails the test at once
    instead of running a collector in the test's process."""
    (tmp_path / "a-file").write_text("")
    return ["--data", tmp_path / "data", "--wal", tmp_path / "a-file" / "wal"]


def test_a_config_file_that_is_not_utf8_is_one_sentence_naming_it(tmp_path, capsys):
    conf = tmp_path / "latin1.yaml"
    conf.write_bytes("collector:\n  token: café\n".encode("latin-1"))
    with pytest.raises(SettingsError, match=r"latin1\.yaml is not UTF-8 text \(byte 0xe9 on line 2\): save it as UTF-8$"):
        load(CollectorConfig, "collector", str(conf), None, {})
    rc, err = _main(capsys, "collect", "--config", conf, *_unstartable(tmp_path))
    assert rc == 2 and "latin1.yaml is not UTF-8 text" in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("yaml_value,expect", [
    ("30.9", r"collector\.max_inflight\): not a whole number: 30\.9$"),
    ("'30.9'", r"collector\.max_inflight\): not a whole number: '30\.9'$"),
    ("true", r"collector\.max_inflight\): expected a number, got the boolean true$"),
    ("'0.5b'", r"collector\.max_inflight\): not a whole number: '0\.5b'$"),
])
def test_an_integer_setting_takes_only_a_whole_number(tmp_path, yaml_value, expect):
    with pytest.raises(SettingsError, match=expect):
        cfg(tmp_path, f"collector:\n  max_inflight: {yaml_value}\n")


def test_a_float_setting_refuses_a_boolean_and_sizes_stay_exact(tmp_path):
    with pytest.raises(SettingsError, match=r"collector\.flush_interval\): expected a number, got the boolean false$"):
        cfg(tmp_path, "collector:\n  flush_interval: false\n")
    c = cfg(tmp_path, "collector:\n  max_inflight: 30\n  wal_cap_bytes: 9007199254740993\n  max_request_bytes: 1.5KiB\n")
    assert (c.max_inflight, c.wal_cap_bytes, c.max_request_bytes) == (30, 9007199254740993, 1536)


def test_an_unknown_section_is_refused_with_the_closest_known_one(tmp_path, capsys):
    from nightshift.cli.main import SECTIONS
    from nightshift.settings import check_sections

    conf = tmp_path / "nightshift.yaml"
    conf.write_text("collector:\n  token: t\nrout:\n  listen: 127.0.0.1:8100\n")
    with pytest.raises(SettingsError, match=r"nightshift\.yaml: unknown section 'rout' \(did you mean 'route'\?\)$"):
        check_sections(str(conf), SECTIONS)
    rc, err = _main(capsys, "collect", "--config", conf, *_unstartable(tmp_path))
    assert rc == 2 and "unknown section 'rout' (did you mean 'route'?)" in err
    assert not (tmp_path / "data").exists()
    conf.write_text("schedule: nightly\n")
    with pytest.raises(SettingsError, match=r"unknown section 'schedule' \(known: apo, collector, compaction, data, log_format, nightly, publish, "
                                            r"retention, route, serve, "
                                            r"train, transform\)$"):
        check_sections(str(conf), SECTIONS)


def test_an_unknown_setting_inside_a_section_names_the_closest_known_one(tmp_path):
    with pytest.raises(SettingsError, match=r"\(collector\.grcp\): unknown setting 'grcp' \(did you mean 'grpc'\?\)$"):
        cfg(tmp_path, "collector:\n  grcp: 127.0.0.1:4317\n")


def test_the_known_sections_are_every_section_a_command_reads_from_the_file():
    """SECTIONS is kept by hand in cli/main.py (settings/ imports no stage): every
    `load(Config, "<section>", <config file>, ...)` of the commands must be in it,
    or its section would be refused; and the recipe's file must pass."""
    import ast

    from nightshift.cli.main import SECTIONS
    from nightshift.settings import check_sections

    root = Path(__file__).resolve().parent.parent
    read = set()
    for path in (root / "cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "load" and len(node.args) >= 3
                    and isinstance(node.args[1], ast.Constant)
                    and not (isinstance(node.args[2], ast.Constant) and node.args[2].value is None)):
                read.add(node.args[1].value)
    assert read and read <= set(SECTIONS), read - set(SECTIONS)
    assert set(SECTIONS) - read == {"data", "log_format"}  # nothing known that no command reads (both top-level)
    check_sections(str(root / "recipes" / "nightshift.yaml"), SECTIONS)


@pytest.mark.parametrize("section,flags,expect", [
    ("collector", {"grpc": "127.0.0.1:99999"}, r"^--grpc \(collector\.grpc\): port must be in 1\.\.65535, got 99999$"),
    ("collector", {"http": "127.0.0.1:0"}, r"^--http \(collector\.http\): port must be in 1\.\.65535, got 0$"),
    ("collector", {"http": "::1:4318"}, r"^--http \(collector\.http\): '::1:4318': an IPv6 host goes in brackets"),
    ("collector", {"grpc": "my host:4317"}, r"^--grpc \(collector\.grpc\): 'my host' is not a host name or an IP address$"),
    ("collector", {"grpc": "256.0.0.1:4317"}, r"^--grpc \(collector\.grpc\): '256\.0\.0\.1' is not an IPv4 address$"),
    ("collector", {"grpc": ":4317"}, r"^--grpc \(collector\.grpc\): the host is missing"),
    ("route", {"listen": "127.0.0.1:99999"}, r"^--listen \(route\.listen\): port must be in 1\.\.65535, got 99999$"),
    ("route", {"listen": "[::1:8100"}, r"^--listen \(route\.listen\): '\[::1:8100' is not of the form HOST:PORT$"),
    ("serve", {"model": "/m", "host": "300.1.1.1"}, r"^--host \(serve\.host\): '300\.1\.1\.1' is not an IPv4 address$"),
    ("serve", {"model": "/m", "port": "0"}, r"^--port \(serve\.port\): must be in \[1, 65535\], got 0$"),
])
def test_every_listen_address_is_checked_once_the_same_way(section, flags, expect):
    cls = dict((s, c) for c, s in _every_config())[section]
    with pytest.raises(SettingsError, match=expect):
        load(cls, section, None, flags, {})


@pytest.mark.parametrize("address", ["127.0.0.1:1", "0.0.0.0:65535", "[::1]:4317", "[::]:4317", "localhost:4317",
                                     "collector.internal:4317", "off"])
def test_listen_addresses_that_are_fine(address):
    c = load(CollectorConfig, "collector", None, {"grpc": address, "http": address}, {})
    assert c.grpc == address


def test_a_port_out_of_range_stops_collect_and_route_before_they_start(tmp_path, capsys):
    rc, err = _main(capsys, "collect", *_unstartable(tmp_path), "--grpc", "127.0.0.1:99999")
    assert rc == 2 and err.strip() == ("nightshift: configuration error: --grpc (collector.grpc): port must be in "
                                       "1..65535, got 99999")
    assert not (tmp_path / "data").exists()
    rc, err = _main(capsys, "route", "--data", tmp_path / "data", "--listen", "127.0.0.1:99999")
    assert rc == 2 and "--listen (route.listen): port must be in 1..65535, got 99999" in err and "Traceback" not in err
