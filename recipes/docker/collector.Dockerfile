# syntax=docker/dockerfile:1
# The collector sidecar: `nightshift collect` (and ingest, feedback, show, build, doctor,
# export, which need nothing more). Nightshift's base install only: no torch, no
# transformers (those are the `train` extra, in trainer.Dockerfile).
#
#   recipes/docker/build.sh      (from anywhere; tags both images with pyproject's version)
#   docker build -f recipes/docker/collector.Dockerfile -t ghcr.io/nightshift/nightshift-collector:0.1.0 .
#
# Runs as an unprivileged user; the write-ahead log goes to /var/lib/nightshift/wal
# (mount a volume there so acknowledged spans survive a restart).
FROM python:3.11.14-slim-bookworm

LABEL org.opencontainers.image.title="nightshift-collector" \
      org.opencontainers.image.description="Nightshift's OTLP collector: LLM agents' spans to Parquet" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NIGHTSHIFT_DATA=/var/lib/nightshift/data \
    NIGHTSHIFT_COLLECTOR_WAL=/var/lib/nightshift/wal

WORKDIR /opt/nightshift
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
RUN pip install . \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/nightshift --create-home nightshift \
    && mkdir -p /var/lib/nightshift/data /var/lib/nightshift/wal \
    && chown -R nightshift:nightshift /var/lib/nightshift

USER 10001
WORKDIR /var/lib/nightshift
EXPOSE 4317 4318
ENTRYPOINT ["nightshift"]
CMD ["collect", "--grpc", "0.0.0.0:4317", "--http", "0.0.0.0:4318"]
