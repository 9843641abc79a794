#!/bin/sh
# Build Nightshift's two images from the repository, tagged with pyproject.toml's version:
#   $REGISTRY/nightshift-collector:<version>   the sidecar (no torch)
#   $REGISTRY/nightshift-trainer:<version>     the nightly job (torch, transformers, TRL, PEFT)
# REGISTRY defaults to ghcr.io/nightshift, the name recipes/k8s/ uses. Needs BuildKit
# (docker >= 23, or `docker buildx build`), which reads the *.dockerignore files here.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/pyproject.toml")
registry=${REGISTRY:-ghcr.io/nightshift}
builder=${BUILDER:-docker}
"$builder" build -f "$root/recipes/docker/collector.Dockerfile" -t "$registry/nightshift-collector:$version" "$root"
"$builder" build -f "$root/recipes/docker/trainer.Dockerfile" -t "$registry/nightshift-trainer:$version" "$root"
