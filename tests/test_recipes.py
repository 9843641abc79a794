"""Every deployment recipe parses, and says what Nightshift needs: the settings file
loads into every stage's settings, the manifests are well-formed Kubernetes objects
with the fields that matter, the OpenTelemetry Collector routes by trace id, the
vLLM line has the LoRA flags."""

from __future__ import annotations

import configparser
import subprocess
from pathlib import Path

import yaml

from nightshift.settings import load

R = Path(__file__).resolve().parent.parent / "recipes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((R / name).read_text()) if d]


def test_settings_file_loads_into_every_stage():
    from nightshift.collector.config import CollectorConfig
    from nightshift.trainer.config import TrainConfig
    from nightshift.nightly.run import NightlyConfig
    from nightshift.publish.publish import MOVED
    from nightshift.transform.config import TransformConfig

    f = str(R / "nightshift.yaml")
    col = load(CollectorConfig, "collector", f, env={})
    tr = load(TransformConfig, "transform", f, env={})
    train = load(TrainConfig, "train", f, env={})
    said: list[str] = []
    night = load(NightlyConfig, "nightly", f, env={}, moved=MOVED, notes=said)
    tr.check()
    train.check()
    night.check()
    assert col.data == tr.data == train.data == "/var/lib/nightshift/data"
    assert train.served_model_name == "Qwen/Qwen2.5-1.5B-Instruct" and night.max_lora_rank >= train.lora.r
    # the ConfigMap carries a file the same loaders accept
    cm = _docs("k8s/config.yaml")[0]
    inner = yaml.safe_load(cm["data"]["nightshift.yaml"])
    assert set(inner) == {"data", "collector", "transform", "train", "publish"}
    assert not said  # the recipe gives the publishing keys in their own section, not the deprecated one


def test_kubernetes_manifests():
    agent = _docs("k8s/agent-with-collector.yaml")[0]
    assert agent["kind"] == "Deployment"
    spec = agent["spec"]["template"]["spec"]
    sidecar = spec["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always" and sidecar["args"][0] == "collect"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/healthz"
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317"
    cron = _docs("k8s/nightly-cronjob.yaml")[0]
    assert cron["kind"] == "CronJob" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert len(cron["spec"]["schedule"].split()) == 5
    job = cron["spec"]["jobTemplate"]["spec"]
    rules = {r["action"]: r["onExitCodes"]["values"] for r in job["podFailurePolicy"]["rules"]}
    assert rules == {"Ignore": [75], "FailJob": [2]}
    container = job["template"]["spec"]["containers"][0]
    assert container["args"][:1] == ["nightly"] and "nvidia.com/gpu" in container["resources"]["limits"]
    deploy, svc = _docs("k8s/vllm.yaml")
    vargs = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-lora" in vargs and vargs[vargs.index("--max-lora-rank") + 1] == "16"
    venv = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert venv["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and svc["kind"] == "Service"
    for doc in (agent, cron, deploy, svc):
        assert doc["metadata"]["namespace"] == "agents" and doc["apiVersion"]


def test_otel_collector_routes_by_trace_id():
    conf = _docs("otelcol-loadbalancing.yaml")[0]
    lb = conf["exporters"]["loadbalancing"]
    assert lb["routing_key"] == "traceID" and "otlp" in lb["protocol"]
    assert lb["resolver"]["dns"]["port"] == 4317
    pipes = conf["service"]["pipelines"]
    assert pipes["traces"]["exporters"] == ["loadbalancing"] and pipes["logs"]["exporters"] == ["loadbalancing"]


def test_cron_systemd_and_the_vllm_line():
    line = next(ln for ln in (R / "cron").read_text().splitlines() if ln and not ln.startswith("#") and "=" not in ln)
    fields = line.split()
    assert len(fields[:5]) == 5 and fields[5:8] == ["nightshift", "nightly", "--config"]
    for name in ("nightshift-collector.service", "nightshift-nightly.service", "nightshift-nightly.timer"):
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.read_string((R / "systemd" / name).read_text())
        assert cp.sections()
    night = configparser.ConfigParser(interpolation=None)
    night.read_string((R / "systemd" / "nightshift-nightly.service").read_text())
    assert night["Service"]["Type"] == "oneshot" and night["Service"]["SuccessExitStatus"] == "75"
    timer = configparser.ConfigParser(interpolation=None)
    timer.read_string((R / "systemd" / "nightshift-nightly.timer").read_text())
    assert timer["Timer"]["Persistent"] == "true"
    sh = (R / "vllm-serve.sh").read_text()
    assert subprocess.run(["bash", "-n", str(R / "vllm-serve.sh")]).returncode == 0
    for flag in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True", "--enable-lora", "--max-lora-rank", "--max-loras",
                 "--tool-call-parser"):
        assert flag in sh
