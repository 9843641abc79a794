"""Live instrumentation tests: real instrumentation packages around the real
`openai` client (and `openai-agents`), each in its own virtualenv, exporting over
OTLP to a real collector. See `envs.py`, `stub_openai.py` and `agents/`."""
