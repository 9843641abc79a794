"""log π of completion tokens without full-vocabulary logits.

A row of agent data is ~6k prompt tokens and ~400 completion tokens; only the
completion's positions need the LM head, and even those need only one number
each (the target's log-probability), not a row of 151,936 logits kept for
backward. So the head runs on completion positions only, a chunk of tokens at a
time, and each chunk's logits are dropped as soon as its log-probabilities are
out: backward recomputes them chunk by chunk (torch.utils.checkpoint) where the
head trains (full fine-tuning). Peak memory is one chunk's logits
(`LOGIT_CHUNK_ELEMENTS`), whatever the vocabulary and the batch; the price is
one more head matmul per completion token.

When the head is frozen (LoRA), not even that: a token's log-probability depends
on its own hidden state only, so its gradient is one vector of the hidden size,
computed with it in the forward (`_FrozenHeadLogprobs`); backward multiplies.
The same head matmuls as the plain path, [K, H] kept instead of [K, V].

How the head is reached matters under DDP: the model's forward must be entered
through the outer module's __call__ so the reducer sees every parameter the loss
uses. The head is therefore swapped, for the duration of one forward, for a
module that calls the original head chunk by chunk from inside the forward
(`_swapped_head`). The original head module is what computes the logits, so a
LoRA on the head, tied embeddings and full fine-tuning all get their gradients.

On CUDA with Triton the head runs as TRL's `ChunkedLogProbFunction`
(trl.kernels, what SFTTrainer's default loss uses; 2.5x ours on the head alone
on an H200, `_fused_logprobs` says why; in a training step not yet measured): it
tiles the vocabulary too and folds tiles with a Triton kernel, accumulating
gradients in fp32. It reads `lm_head.weight` directly, so
it is used only for a plain Linear head nothing hooks into (a LoRA'd head would
get no gradient), called from inside the forward like the rest. Elsewhere (a
CPU, where ours is faster; no Triton; another head) the paths above.

Compared (see benchmarks/gpu_kernels.py for the GPU figures): Liger's fused
linear cross-entropy computes the gradient during the forward (no recompute) but
only for a cross-entropy whose upstream gradient is known then, not for pg's
per-token weights; it is the slowest in TRL's H100
microbenchmark. Apple's Cut Cross-Entropy is the fastest and smallest there but
needs Triton on CUDA and has no CPU path. Checkpointed chunks are plain torch:
the same code on a CPU test and a GPU run, any head module, any loss on top.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from .attention import PACKED_KEYS

#: Logit elements (tokens x vocabulary) one chunk may hold: 2^26 is 256 MiB in
#: fp32, ~440 tokens of a 152k vocabulary; its softmax and gradient are about as
#: much again in backward. Large enough that the head's matmuls stay efficient.
LOGIT_CHUNK_ELEMENTS = 1 << 26


@dataclass
class CompletionStates:
    """The final hidden state at each completion token's predicting position, and
    the head that turns a chunk of them into logits: what an exact KL needs
    without keeping anyone's [K, V] logits."""

    hidden: torch.Tensor  # [K, H]
    head: Callable[[torch.Tensor], torch.Tensor]
    #: The head's weight dtype, what its input must be: a wrapped forward may hand
    #: the states back in another (accelerate's mixed precision returns fp32).
    dtype: torch.dtype | None = None

    def chunk(self, start: int, stop: int, device: torch.device | None = None) -> torch.Tensor:
        """Rows [start, stop) of the states, as the head takes them."""
        h = self.hidden[start:stop]
        return h.to(device=device or h.device, dtype=self.dtype or h.dtype)


def completion_logprobs(model, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                        chunk_tokens: int | None = None, method: str = "auto") -> torch.Tensor:
    """log π of every completion token in `batch` (trainer.pg.collate's dict), [K]
    float32, differentiable. `temperature`: the distribution a server sampled
    from, log softmax(logits / T). `chunk_tokens`: tokens per head chunk (default:
    `LOGIT_CHUNK_ELEMENTS` / vocabulary). `method`: how the head runs, "auto"
    (`head_kind`'s choice) or one of `_chunked_logprobs`' methods."""
    targets = batch["targets"]

    def head_fn(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return _chunked_logprobs(head, hidden, targets.to(hidden.device), temperature, chunk_tokens, method=method)

    return _forward(model, batch, head_fn)


def completion_states(model, batch: dict[str, torch.Tensor]) -> CompletionStates:
    """The policy's `CompletionStates` on `batch` (one forward, no logits kept), in
    the head's dtype: the states leave the forward as its output, which a wrapper
    may have converted (accelerate's mixed precision makes a trained model's
    outputs fp32, and a bf16 head then refuses them)."""
    box: list[torch.nn.Module] = []

    def capture(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        box.append(head)
        return hidden

    hidden = _forward(model, batch, capture)
    dtype = _weight_dtype(box[0])
    return CompletionStates(hidden if dtype is None else hidden.to(dtype), box[0], dtype)


def _weight_dtype(head: torch.nn.Module) -> torch.dtype | None:
    """The dtype the head computes in (a LoRA'd head's `weight` is its base layer's)."""
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor):
        return w.dtype
    return next((p.dtype for p in head.parameters()), None)


def adapter_off(policy) -> Callable[[dict[str, torch.Tensor]], CompletionStates]:
    """`CompletionStates` of a PEFT policy with its adapter switched off (the base
    model as a reference, no second copy): the head is re-applied inside
    `disable_adapter()` too, so a LoRA on the head is off there as well."""

    def states(batch: dict[str, torch.Tensor]) -> CompletionStates:
        with policy.disable_adapter():
            st = completion_states(policy, batch)

        def head(h: torch.Tensor) -> torch.Tensor:
            with policy.disable_adapter():
                return st.head(h)

        return CompletionStates(st.hidden, head, st.dtype)

    return states


def completion_logprobs_and_kl(model, batch: dict[str, torch.Tensor],
                               ref: CompletionStates | Callable[[dict[str, torch.Tensor]], CompletionStates],
                               *, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π [K], KL(π‖ref) [K]) at every completion token, exact over the full
    next-token distributions, with at most one chunk of each model's logits alive.
    `ref`: the reference's states, or a function of the batch giving them (e.g.
    `completion_states` bound to a reference model, or `adapter_off(policy)`)."""
    mine = completion_states(model, batch)
    theirs = ref if isinstance(ref, CompletionStates) else ref(batch)
    targets = batch["targets"].to(mine.hidden.device)
    k = mine.hidden.shape[0]
    if theirs.hidden.shape[0] != k:
        raise ValueError(f"completion_logprobs_and_kl: the reference gave {theirs.hidden.shape[0]} completion "
                         f"positions for the policy's {k}")
    step = _chunk(chunk_tokens, mine.head, mine.hidden)
    logps, kls = [], []
    for i in range(0, k, step):
        p = torch.log_softmax(mine.head(mine.chunk(i, i + step)).float(), -1)
        q = torch.log_softmax(theirs.head(theirs.chunk(i, i + step, theirs.hidden.device)).float().to(p.device), -1)
        logps.append(p.gather(-1, targets[i:i + step, None]).squeeze(-1))
        kls.append((p.exp() * (p - q)).sum(-1))
    if not logps:
        empty = mine.hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(kls)


# --- inside the forward --------------------------------------------------------------------------------

def _forward(model, batch: dict[str, torch.Tensor],
             head_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One forward of `model` (through its own __call__: DDP, PEFT, accelerate's
    hooks all see it) with the head replaced by `head_fn(original_head, hidden at
    the completion positions [K, H])`; returns what head_fn returned."""
    extra = {k: batch[k] for k in PACKED_KEYS if batch.get(k) is not None}
    rows, cols = batch["tok_row"], batch["tok_col"]

    def at_completions(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden[rows.to(hidden.device), cols.to(hidden.device)]  # [B, n, H] -> [K, H]
        return head_fn(head, picked)

    with _swapped_head(model, at_completions):
        out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                    position_ids=batch.get("position_ids"), logits_to_keep=batch["logit_index"],
                    use_cache=False, **extra)
    return out.logits


class _HeadSwap(torch.nn.Module):
    """Stands where the LM head was for one forward; the original head is held
    outside the module tree (not registered) so no parameter changes its name."""

    def __init__(self, head: torch.nn.Module, fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]):
        super().__init__()
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "_fn", fn)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._fn(self._head, hidden)


#: Models whose forward changes the head's output after the head (softcapping,
#: scaling): their "logits" would be log-probabilities bent out of shape.
_POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


@contextlib.contextmanager
def _swapped_head(model, fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> Iterator[None]:
    lm = _causal_lm(model)
    cfg = getattr(lm, "config", None)
    bent = [a for a in _POST_HEAD if cfg is not None and getattr(cfg, a, None) not in (None, 1.0)]
    if bent:
        raise ValueError(f"completion log-probs: {type(lm).__name__} transforms its logits after the head "
                         f"({', '.join(bent)}), which the chunked head does not reproduce")
    head = lm.get_output_embeddings()
    parent, name = _parent_of(lm, head)
    parent._modules[name] = _HeadSwap(head, fn)
    try:
        yield
    finally:
        parent._modules[name] = head


def _causal_lm(model) -> torch.nn.Module:
    """The transformers CausalLM inside DDP / torch.compile / PEFT wrappers."""
    m = model
    while True:
        if isinstance(m, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            m = m.module
        elif hasattr(m, "_orig_mod"):
            m = m._orig_mod
        elif hasattr(m, "get_base_model") and callable(m.get_base_model) and m.get_base_model() is not m:
            m = m.get_base_model()
        else:
            break
    if not hasattr(m, "get_output_embeddings") or m.get_output_embeddings() is None:
        raise ValueError(f"completion log-probs: {type(m).__name__} has no output embeddings (LM head)")
    return m


def _parent_of(root: torch.nn.Module, target: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    for parent in root.modules():
        for name, child in parent._modules.items():
            if child is target:
                return parent, name
    raise ValueError(f"completion log-probs: cannot find the LM head inside {type(root).__name__}")


# --- the chunked head ----------------------------------------------------------------------------------

def _chunk(chunk_tokens: int | None, head: Callable, hidden: torch.Tensor) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
        return chunk_tokens
    vocab = getattr(head, "out_features", None) or getattr(getattr(head, "weight", None), "shape", [0])[0]
    return max(1, LOGIT_CHUNK_ELEMENTS // max(int(vocab), 1))


def _target_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """log softmax(head(hidden) / T)[target], computed in fp32 like the plain path."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunked_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                      chunk_tokens: int | None, *, method: str = "auto") -> torch.Tensor:
    """log π of each target, [K] fp32, one chunk of logits alive at a time.
    method: "auto" (on CUDA with Triton, a plain head: "fused"; else a frozen plain
    head: "jacobian", a head that trains: "checkpoint"), or any of the three."""
    if method not in ("auto", "fused", "jacobian", "checkpoint"):
        raise ValueError(f"completion log-probs: no head method {method!r} (auto, fused, jacobian or checkpoint)")
    if hidden.shape[0] == 0:  # still connected to the graph: an empty micro-batch backpropagates zeros
        return hidden.sum(-1).float()
    if method == "fused" or (method == "auto" and _fused_fits(head, hidden)):
        return _fused_logprobs(head, hidden, targets, temperature)
    step = _chunk(chunk_tokens, head, hidden)
    head_trains = any(p.requires_grad for p in head.parameters())
    if not torch.is_grad_enabled() or not (hidden.requires_grad or head_trains):
        return _cat([_target_logprobs(head, hidden[i:i + step], targets[i:i + step], temperature)
                     for i in range(0, hidden.shape[0], step)])
    if method == "auto":
        method = "jacobian" if type(head) is torch.nn.Linear and not head_trains else "checkpoint"
    if method == "jacobian":
        return _FrozenHeadLogprobs.apply(hidden, head, targets, temperature, step)
    # keep only each chunk's input; backward recomputes its logits
    return _cat([checkpoint(_target_logprobs, head, hidden[i:i + step], targets[i:i + step], temperature,
                            use_reentrant=False) for i in range(0, hidden.shape[0], step)])


#: Vocabulary columns of one tile of the fused path (TRL SFTTrainer's own choice:
#: a [4,096 x 32,768] bf16 tile is 256 MiB).
FUSED_VOCAB_CHUNK = 32768


def fused_available(device: torch.device) -> bool:
    """Whether TRL's fused head (`ChunkedLogProbFunction`) runs with its Triton fold
    on `device`. Without Triton it folds tiles with torch ops, several fp32 passes
    over each: no faster than "jacobian", so "auto" keeps ours there."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from transformers.utils import is_triton_available
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: F401
    except ImportError:
        return False
    return bool(is_triton_available())


def head_kind(device: torch.device) -> str:
    """The memory estimator's name for the head "auto" runs on `device` (a plain
    LM head, as every model we load has): "fused" or "chunked"."""
    return "fused" if fused_available(device) else "chunked"


def _fused_fits(head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """A plain Linear head whose weight the fused path may read directly: nothing
    hooked into its forward (a LoRA on the head, accelerate's offload hooks,
    FSDP's gathering are all module types or hooks of their own), on the device of
    the states."""
    return (type(head) is torch.nn.Linear and not head._forward_hooks and not head._forward_pre_hooks
            and "forward" not in vars(head) and head.weight.device == hidden.device
            and type(head.weight) in (torch.Tensor, torch.nn.Parameter) and fused_available(hidden.device))


def _fused_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """TRL's `ChunkedLogProbFunction`: the head's matmul on [4,096 x FUSED_VOCAB_CHUNK]
    tiles into one preallocated buffer, each tile folded into an online logsumexp
    and the target's logit by one Triton kernel that reads it once in the compute
    dtype; backward recomputes each tile, turns it into the logits' gradient in
    place and accumulates the hidden (and, where the head trains, weight)
    gradients in fp32: three head matmuls for a frozen head and ~12 bytes of
    memory traffic per logit. Our "jacobian" path does two matmuls but then runs
    about ten elementwise kernels over every chunk of logits, most in fp32
    (upcast, logsumexp, subtract, exp, negate, scatter, downcast), ~50 bytes per
    logit by our count. On an H200 that traffic, not the matmuls, is the cost (at
    hidden 896 a logit's matmul is 1.8 kFLOP, about 9 bytes' worth of HBM time),
    which is why TRL's measured 691k tokens/s against its 275k on 4,096 x 151,936
    (benchmarks/gpu_kernels.py; within 1e-6 of each other). On a CPU the matmuls
    dominate and "jacobian", one fewer, wins. Reads `head.weight` directly, so it
    is called from inside the model's forward (`_swapped_head`): DDP's reducer
    sees the weight's gradient as it would the head's."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(hidden, head.weight, head.bias, targets, float(temperature),
                                        FUSED_VOCAB_CHUNK, None, 1.0, ())[0]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class _FrozenHeadLogprobs(torch.autograd.Function):
    """A frozen head (LoRA's case): token k's log-prob depends on its own hidden
    state h_k only, so its gradient is one vector, d log π_k / d h_k =
    ((onehot(y_k) - p_k) / T) W, computed with the log-prob while the chunk's
    logits are alive; backward multiplies it by the incoming gradient. Exact, no
    recompute: as many head matmuls as the plain path, and [K, H] kept instead of
    [K, V]."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float,
                step: int) -> torch.Tensor:
        logps, jacobians = [], []
        for i in range(0, hidden.shape[0], step):
            t = targets[i:i + step, None]
            logits = head(hidden[i:i + step])
            z = logits.float()
            if temperature != 1.0:
                z = z / temperature
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            logps.append((z.gather(-1, t) - lse).squeeze(-1))
            if z is logits:  # fp32 logits: z must not alias what the head returned
                z = z.clone()
            d = z.sub_(lse).exp_().neg_().scatter_add_(-1, t, torch.ones_like(t, dtype=z.dtype))  # onehot - p
            if temperature != 1.0:
                d = d.div_(temperature)
            jacobians.append(d.to(logits.dtype) @ head.weight.to(logits.dtype))
            del logits, z, d
        ctx.save_for_backward(_cat(jacobians))
        ctx.hidden_dtype = hidden.dtype
        return _cat(logps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (jacobian,) = ctx.saved_tensors
        return (grad[:, None] * jacobian.float()).to(ctx.hidden_dtype), None, None, None, None
