"""Trainer: transitions to a better policy (`nightshift train`).

select (transitions, lazily, filtered and counted) -> render (chat template,
logged-token drift) -> examples (token features, split) -> algorithms/<name>
(its settings, rows, trainer and loss: sft, awr, pg on the shared loop in
`loop`; kto, dpo on TRL) -> plan (device, precision, attention, packing, worked
out once) -> model (policy, reference) -> evaluate (held-out split by
trajectory) -> checkpoint (versioned, atomic, manifest) -> merge (full
weights). Settings: `config`; the whole path top to bottom: `run.train`.
"""
