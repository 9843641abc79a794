"""Held-out evaluation of a policy on transitions it was not trained on (split by
trajectory): how likely it finds the logged completions (NLL per token), whether
it moved toward the better ones (advantage-weighted log-likelihood: up is
better), and how far it drifted from the reference (exact KL per token, from
the full next-token distributions). The eval gate compares checkpoints with it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .loop import LOGPROB_CHUNK, collate, completion_logprobs


def _kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Σ_tokens KL(π‖ref) over next-token distributions, chunked over tokens."""
    total = logits.new_zeros((), dtype=torch.float32)
    for i in range(0, logits.shape[0], LOGPROB_CHUNK):
        p = torch.log_softmax(logits[i : i + LOGPROB_CHUNK].float(), -1)
        q = torch.log_softmax(ref_logits[i : i + LOGPROB_CHUNK].float(), -1)
        total += (p.exp() * (p - q)).sum()
    return total


@torch.no_grad()
def evaluate(model, features: list[dict], pad_id: int, batch_size: int = 8, packed: bool = True,
             ref: Callable | None = None) -> dict[str, float]:
    """Metrics of `model` on pg-shaped `features` (see `examples.pg_features`; rows
    without an advantage carry None and are left out of that metric only)."""
    if not features:
        return {}
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = rows = 0
    nll = kl = 0.0
    adv_num = adv_den = 0.0
    try:
        for i in range(0, len(features), batch_size):
            chunk = features[i : i + batch_size]
            batch = {k: v.to(device) for k, v in collate(chunk, pad_id, packed).items()}
            logp, logits = completion_logprobs(model, batch, with_logits=True)
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
            if ref is not None:
                _, ref_logits = ref(batch)
                kl += _kl(logits, ref_logits).item()
    finally:
        model.train(was_training)
    out = {"rows": rows, "tokens": tokens, "nll": nll / max(tokens, 1)}
    if adv_den > 0:
        out["adv_weighted_logp"] = adv_num / adv_den
    if ref is not None:
        out["kl_to_reference"] = kl / max(tokens, 1)
    return out
