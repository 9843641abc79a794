"""Serve: an OpenAI-compatible stand-in for vLLM (`nightshift serve`), named as such.

engine (transformers generation with LoRA adapters loaded and swapped the way
vLLM's runtime LoRA API does, sampled-token logprobs) -> http (the
/v1/chat/completions, /v1/load_lora_adapter, /health and /metrics routes). Runs
where vLLM cannot (no GPU); the contract is vLLM's, so publish cannot tell them apart.
"""
