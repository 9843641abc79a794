"""Trainer: transitions to a better policy (`nightshift train`).

select (transitions, lazily, filtered and counted) -> render (chat template,
logged-token drift) -> examples (per algorithm) -> model (policy, reference) ->
trainers (pg: PGTrainer, a custom loss on transformers' Trainer; sft/kto/dpo:
TRL) -> evaluate (held-out split by trajectory) -> checkpoint (versioned,
atomic, manifest) -> merge (full weights). Settings: `config`; the whole path
top to bottom: `run.train`.
"""
