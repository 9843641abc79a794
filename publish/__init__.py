"""Publish: a checkpoint to a running vLLM endpoint (`nightshift publish`, `rollback`).

gate (held-out scoring of a candidate against what is served: may it go out?) ->
publish (merge or adapter, load under a versioned name, point the stable name at
it, roll back on failure) through vllm_client (vLLM's adapter and model APIs) ->
registry (which version each agent is served, append-only, for rollbacks).
"""
