"""`pg`: policy gradient on logged calls, as a custom loss on transformers'
`Trainer` (its loop, optimizer, accumulation, checkpoints, resumption, DDP/FSDP
under `accelerate launch` or `torchrun`); `awr` shares it.

Every row is one LLM call with a credit-assigned advantage A, produced by some
earlier policy μ (the base model, or an older published adapter). The default
(`clip: topr`, Tapered Off-Policy REINFORCE, arXiv 2503.14286) is what works on
such data: positive rows get the plain A·∇log π, with no importance ratio, so
nothing caps how far a good action may rise; negative rows get the ratio
truncated to clip(π/μ, 0, 1), so an action the policy already left behind is
not pushed further down (the push that squeezes mass into malformed output).
Negatives whose μ is unknown get `unknown_mu_negatives` as their ratio (0: left
out). `ppo`, `truncate` and `none` are the classic surrogates against μ. Token
losses are averaged within a sequence, then sequences are weighted by the
transition's `weight` (1/calls of its trajectory) so a long trajectory does not
outvote a short one. `awr` (advantage-weighted regression) is the same loop with
non-negative weights exp(A/β) in place of A and no ratio at all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
from transformers import Trainer

from .config import PGSettings

#: Completion tokens whose log-softmax is computed at once: bounds the float32
#: copy of the logits (tokens x vocabulary) a large vocabulary would need.
LOGPROB_CHUNK = 1024


def pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    tok_seq: torch.Tensor,
    seq_weight: torch.Tensor,
    *,
    clip: str = "topr",
    epsilon: float = 0.2,
    truncate_max: float = 2.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    unknown_mu_negatives: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss of a batch, and what a person watching it wants to see.

    logp: [K] log π of the completion tokens of every sequence, concatenated.
    old_logp: [K] logged log μ of the same tokens, NaN where unknown (ratio 1).
    adv: [B] advantage of each sequence. tok_seq: [K] the sequence of each token.
    seq_weight: [B] weight of each sequence. ref_logp: [K] reference log-probs,
    for the k3 estimate of KL(π‖ref) (non-negative, unbiased) times `kl_coef`.
    """
    b = adv.shape[0]
    logged = ~torch.isnan(old_logp)
    old = torch.where(logged, old_logp, logp.detach())
    ratio = torch.exp(logp - old)
    a = adv[tok_seq].to(logp.dtype)
    if clip == "topr":
        # positives: ratio 1 (plain A·∇log π); negatives: clip(π/μ, 0, 1) as a fixed
        # weight where μ is known, `unknown_mu_negatives` where it is not
        neg = a < 0
        w = torch.where(logged, ratio.detach().clamp(max=1.0), torch.full_like(ratio, unknown_mu_negatives))
        w = torch.where(neg, w, torch.ones_like(w))
        obj = w * logp * a
        clip_frac = (neg & logged & (ratio.detach() > 1.0)).float()
    elif clip == "ppo":
        clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon)
        obj = torch.minimum(ratio * a, clipped * a)
        clip_frac = ((ratio * a) > (clipped * a)).float()
    elif clip == "truncate":
        w = ratio.detach().clamp(max=truncate_max)
        obj = w * logp * a  # its gradient is min(r, c)·A·∇log π
        clip_frac = (ratio.detach() > truncate_max).float()
    else:
        obj = ratio * a
        clip_frac = torch.zeros_like(ratio)
    tok_loss = -obj
    kl = None
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        tok_loss = tok_loss + kl_coef * kl
    ones = torch.ones_like(tok_loss)
    n_tok = torch.zeros(b, dtype=tok_loss.dtype, device=tok_loss.device).index_add(0, tok_seq, ones)
    seq_loss = torch.zeros(b, dtype=tok_loss.dtype, device=tok_loss.device).index_add(0, tok_seq, tok_loss)
    seq_loss = seq_loss / n_tok.clamp(min=1.0)
    loss = (seq_loss * seq_weight.to(seq_loss.dtype)).sum() / b
    with torch.no_grad():
        stats = {
            "pg/ratio_mean": ratio.mean().item(),
            "pg/ratio_max": ratio.max().item() if ratio.numel() else 1.0,
            "pg/clip_frac": clip_frac.mean().item() if clip_frac.numel() else 0.0,
            "pg/logged_frac": logged.float().mean().item() if logged.numel() else 0.0,
            "pg/logp_mean": logp.mean().item() if logp.numel() else 0.0,
            "pg/adv_mean": adv.float().mean().item(),
        }
        if clip == "topr":
            stats["pg/neg_weight_mean"] = w[a < 0].mean().item() if bool((a < 0).any()) else 1.0
        if kl is not None:
            stats["pg/kl"] = kl.mean().item()
    return loss, stats


def completion_logprobs(model, batch: dict[str, torch.Tensor], *, with_logits: bool = False,
                        temperature: float = 1.0):
    """log π of every completion token in the batch, [K], computing the LM head only
    at the positions that predict them (prompts in agent traces are long; their
    logits are never needed). `temperature`: the distribution a server sampled
    from, log softmax(logits / T) (μ of a call made at T). With `with_logits`,
    also the raw logits [K, V]."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        position_ids=batch.get("position_ids"),
        logits_to_keep=batch["logit_index"],
        use_cache=False,
    )
    logits = out.logits[batch["tok_row"], batch["tok_col"]]  # [K, V]
    targets = batch["targets"]
    parts = []
    for i in range(0, logits.shape[0], LOGPROB_CHUNK):
        chunk = logits[i : i + LOGPROB_CHUNK].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        tgt = targets[i : i + LOGPROB_CHUNK]
        parts.append(chunk.gather(-1, tgt[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    logp = torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)
    return (logp, logits) if with_logits else logp


def collate(features: list[dict[str, Any]], pad_id: int, packed: bool = True) -> dict[str, torch.Tensor]:
    """A batch of rendered transitions.

    packed: one row, sequences concatenated, `position_ids` restarting at 0 for each
    (transformers then keeps attention inside each sequence: flash-attention's
    varlen path on GPU, a block-diagonal mask with sdpa/eager); no padding at all.
    Otherwise: right-padded rows with an attention mask.
    Tokens are flattened to K completion tokens: `targets`, their sequence
    `tok_seq`, where their logits are (`logit_index` into the sequence dimension,
    then `tok_row`/`tok_col` into the kept logits), and per-token `old_logprobs`
    (NaN where not logged) and `ref_logprobs` (when the features carry them).
    """
    seqs = [f["input_ids"] for f in features]
    starts = [f["completion_start"] for f in features]
    if any(s < 1 for s in starts):
        raise ValueError("a rendered prompt is empty: the first completion token has nothing to be predicted from")
    tok_seq, targets, old, ref = [], [], [], []
    has_ref = all(f.get("ref_logprobs") is not None for f in features)
    for i, f in enumerate(features):
        n = len(f["input_ids"]) - f["completion_start"]
        tok_seq += [i] * n
        targets += f["input_ids"][f["completion_start"]:]
        old += f["old_logprobs"] if f.get("old_logprobs") is not None else [math.nan] * n
        if has_ref:
            ref += f["ref_logprobs"]
    batch: dict[str, torch.Tensor] = {}
    if packed:
        ids = [t for s in seqs for t in s]
        pos = [p for s in seqs for p in range(len(s))]
        offsets, o = [], 0
        for s in seqs:
            offsets.append(o)
            o += len(s)
        logit_index = [offsets[i] + p - 1 for i, s in enumerate(seqs) for p in range(starts[i], len(s))]
        batch["input_ids"] = torch.tensor([ids], dtype=torch.long)
        batch["position_ids"] = torch.tensor([pos], dtype=torch.long)
        batch["logit_index"] = torch.tensor(logit_index, dtype=torch.long)
        batch["tok_row"] = torch.zeros(len(logit_index), dtype=torch.long)
        batch["tok_col"] = torch.arange(len(logit_index), dtype=torch.long)
    else:
        width = max(len(s) for s in seqs)
        first = min(starts) - 1
        batch["input_ids"] = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
        batch["attention_mask"] = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
        batch["logit_index"] = torch.arange(first, width - 1, dtype=torch.long)
        rows, cols = [], []
        for i, s in enumerate(seqs):
            for p in range(starts[i], len(s)):
                rows.append(i)
                cols.append(p - 1 - first)
        batch["tok_row"] = torch.tensor(rows, dtype=torch.long)
        batch["tok_col"] = torch.tensor(cols, dtype=torch.long)
    batch["targets"] = torch.tensor(targets, dtype=torch.long)
    batch["tok_seq"] = torch.tensor(tok_seq, dtype=torch.long)
    batch["old_logprobs"] = torch.tensor(old, dtype=torch.float32)
    batch["advantage"] = torch.tensor([float(f["advantage"]) for f in features], dtype=torch.float32)
    batch["weight"] = torch.tensor([float(f["weight"]) for f in features], dtype=torch.float32)
    if has_ref:
        batch["ref_logprobs"] = torch.tensor(ref, dtype=torch.float32)
    return batch


class PGCollator:
    """`collate` with the tokenizer's pad id bound (picklable for DataLoader workers)."""

    def __init__(self, pad_id: int, packed: bool = True):
        self.pad_id, self.packed = pad_id, packed

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate(features, self.pad_id, self.packed)


class PGTrainer(Trainer):
    """transformers' Trainer with the policy-gradient (or AWR) loss; everything else (loop,
    optimizer, schedule, accumulation, logging, checkpoints) is the Trainer's."""

    def __init__(self, *args, pg: PGSettings, awr: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.pg, self.awr = pg, awr
        self.model_accepts_loss_kwargs = False  # scale by accumulation steps, not token counts
        self._stats: dict[str, list[float]] = defaultdict(list)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logp = completion_logprobs(model, inputs)
        old = inputs["old_logprobs"]
        if self.awr:  # weights already in `advantage`, no ratio: weighted log-likelihood
            old = torch.full_like(old, math.nan)
        loss, stats = pg_loss(
            logp, old, inputs["advantage"], inputs["tok_seq"], inputs["weight"],
            clip="none" if self.awr else self.pg.clip, epsilon=self.pg.epsilon, truncate_max=self.pg.truncate_max,
            ref_logp=inputs.get("ref_logprobs"), kl_coef=self.pg.kl_coef,
            unknown_mu_negatives=self.pg.unknown_mu_negatives,
        )
        if model.training:
            for k, v in stats.items():
                self._stats[k].append(v)
            self._stats["pg/completion_tokens"].append(float(logp.numel()))
        return (loss, {"logp": logp}) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._stats:
            for k, v in self._stats.items():
                logs[k] = sum(v) if k == "pg/completion_tokens" else sum(v) / len(v)
            self._stats.clear()
        super().log(logs, *args, **kwargs)
