#!/usr/bin/env bash
# The vLLM server Nightshift publishes to: LoRA on, adapters loadable at run time, a
# tool-call parser for the model's format, its own OpenTelemetry spans optional.
# `nightshift serve --engine vllm --model ... --dry-run` prints the same line.
set -euo pipefail
export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
exec vllm serve Qwen/Qwen2.5-1.5B-Instruct \
  --host 0.0.0.0 --port 8000 \
  --enable-lora --max-lora-rank 16 --max-loras 4 --max-cpu-loras 8 \
  --enable-auto-tool-choice --tool-call-parser hermes \
  --api-key "${VLLM_API_KEY:?set VLLM_API_KEY}"
# Full-weight publishing (`nightshift publish --mode full`) also needs VLLM_SERVER_DEV_MODE=1, whose
# /collective_rpc and /reset_prefix_cache routes are NOT behind --api-key: keep them on a private network.
# The production-safe alternative is blue-green: start a second server on the merged folder, switch traffic.
