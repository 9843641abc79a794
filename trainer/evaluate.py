"""Held-out evaluation of a policy on transitions it was not trained on (split by
trajectory): how likely it finds the logged completions (NLL per token), whether
it moved toward the better ones (advantage-weighted log-likelihood: up is
better), and how far it drifted from the reference (exact KL per token, from
the full next-token distributions, a chunk of tokens at a time: no one's
vocabulary-wide logits are kept). The eval gate compares checkpoints with it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .logprobs import completion_logprobs, completion_logprobs_and_kl
from .loop import collate, to_device, token_batches


@torch.no_grad()
def evaluate(model, features: list[dict], pad_id: int, micro_batch_tokens: int, packed: bool = True,
             ref: Callable | None = None, boundaries: bool = False) -> dict[str, float]:
    """Metrics of `model` on pg-shaped `features` (see `examples.pg_features`; rows
    without an advantage carry None and are left out of that metric only), in
    batches of at most `micro_batch_tokens`. `ref`: the reference's states of a
    batch (`model.Reference.states`), for the KL."""
    if not features:
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = rows = 0
    nll = kl = 0.0
    adv_num = adv_den = 0.0
    try:
        for chunk in token_batches(features, micro_batch_tokens, packed):
            batch = to_device(collate(chunk, pad_id, packed, boundaries), device)
            if ref is not None:
                logp, kls = completion_logprobs_and_kl(model, batch, ref)
                kl += kls.sum().item()
            else:
                logp = completion_logprobs(model, batch)
            seq = batch["tok_seq"]
            n = torch.zeros(len(chunk), device=device).index_add(0, seq, torch.ones_like(logp))
            mean_logp = torch.zeros(len(chunk), device=device).index_add(0, seq, logp) / n.clamp(min=1)
            for f, m in zip(chunk, mean_logp.tolist()):
                if f.get("advantage") is not None:
                    adv_num += f["weight"] * f["advantage"] * m
                    adv_den += f["weight"]
            nll -= logp.sum().item()
            tokens += logp.numel()
            rows += len(chunk)
    finally:
        model.train(was_training)
    out = {"rows": rows, "tokens": tokens, "nll": nll / max(tokens, 1)}
    if adv_den > 0:
        out["adv_weighted_logp"] = adv_num / adv_den
    if ref is not None:
        out["kl_to_reference"] = kl / max(tokens, 1)
    return out
