# syntax=docker/dockerfile:1
# The nightly job on a GPU node: `nightshift nightly` (build -> train -> gate -> publish),
# and `nightshift train` alone. Nightshift with the `train` extra (torch, transformers,
# TRL, PEFT); torch's Linux wheels bring their own CUDA libraries, so the base is plain
# Python and the node needs only the NVIDIA driver (and the container toolkit).
#
#   recipes/docker/build.sh      (from anywhere; tags both images with pyproject's version)
#   docker build -f recipes/docker/trainer.Dockerfile -t ghcr.io/nightshift/nightshift-trainer:0.1.0 .
FROM python:3.11.14-slim-bookworm

LABEL org.opencontainers.image.title="nightshift-trainer" \
      org.opencontainers.image.description="Nightshift's nightly job: transitions, offline RL/SFT, gate, publish" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1
# HF_HUB_OFFLINE: base models come from a mounted folder (train.base_model: /models/...),
# never from a download in the middle of a nightly run; unset it to allow hub ids.

WORKDIR /opt/nightshift
# torch first, pinned to the build the project tests (the Makefile's): its own layer,
# reused while Nightshift's code changes.
RUN pip install torch==2.13.0
COPY pyproject.toml README.md LICENSE ./
COPY schemas/ schemas/
COPY settings/ settings/
COPY storage/ storage/
COPY collector/ collector/
COPY transform/ transform/
COPY trainer/ trainer/
COPY publish/ publish/
COPY judge/ judge/
COPY serve/ serve/
COPY route/ route/
COPY nightly/ nightly/
COPY prompts/ prompts/
COPY cli/ cli/
# hadolint ignore=DL3013
RUN pip install ".[train]" \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/nightshift --create-home nightshift

USER 10001
WORKDIR /var/lib/nightshift
ENTRYPOINT ["nightshift"]
CMD ["nightly", "--help"]
