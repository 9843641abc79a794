"""How much GPU memory a training step needs, before step 1, and the plan that fits.

A run used to learn its memory by running out of it: Qwen2.5-7B LoRA at the old
defaults (8 rows x 2048 tokens, no checkpointing) peaked at 118 GiB, so it failed
on every 80 GB card. Here the peak is estimated from the model's config, term by
term, the way the bytes are really laid out (transformers 5 Qwen2/Llama layers,
PEFT's LoRA, accelerate's autocast, the LM head of each code path), and `plan`
picks the micro-batch and the checkpointing that fit a share of the free memory.

The estimate is what `torch.cuda.max_memory_allocated` would report: allocated
bytes, not what the caching allocator reserves around them, and not the CUDA
context (neither is in that figure). `plan` adds the allocator's share
(`ALLOCATOR_OVERHEAD`) before comparing with the free memory, which already
excludes the context. No constant in the per-layer terms was fitted: each is a
count of the tensors autograd keeps, checked against the H200 table in
../shared/gpu/README.md (tests/test_trainer_memory.py: every row within 4 %, the
test's bound 15 %) and against a tiny model's allocations measured on a CPU
(within 5 %, bf16 under autocast included).

Checkpointing is per decoder layer: "full" recomputes every layer in backward,
"selective" k of them (`checkpoint_flags`: transformers checkpoints a layer whose
`gradient_checkpointing` flag is set). Recomputing a layer costs its forward
again (about a third of its step time), so the plan checkpoints as few layers as
it can and spends the memory that frees on a bigger micro-batch only while the
micro-batch is below `EFFICIENT_TOKENS`.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

GIB = 2**30

#: Micro-batches are multiples of this many tokens (the varlen kernel and cuBLAS like
#: round shapes, and a plan line reads better).
TOKEN_QUANTUM = 1024
#: From about this many tokens a micro-batch keeps an H100/H200 busy on 0.5B-7B
#: shapes (every matmul is at least 8k rows tall); beyond it, a bigger micro-batch
#: buys little, while checkpointing a layer costs its forward again. So the plan
#: prefers no checkpointing at >= this many tokens over checkpointing at more.
EFFICIENT_TOKENS = 8192
#: Reserved / allocated bytes of PyTorch's caching allocator with micro-batches of
#: varying shapes: what it keeps around the peak (rounding to blocks, blocks split
#: between sizes). The table's figures are allocated bytes, so it cannot say: 1.10
#: is an assumption (the usual 5-10 % of fragmentation), not a measurement; the
#: gpu-marked test in tests/test_trainer_memory.py checks reserved <= estimate x
#: this on the lent GPU, and the OOM retry (`shrink`) covers a wrong guess.
ALLOCATOR_OVERHEAD = 1.10
#: Logit elements (tokens x vocabulary) per chunk of the completion-only LM head
#: (trainer/logprobs.py, LOGIT_CHUNK_ELEMENTS: a test keeps the two equal).
HEAD_CHUNK_ELEMENTS = 1 << 26
#: TRL 1.16 SFTTrainer's fused LM head (trl/kernels/chunked_logprob.py): tokens x
#: vocabulary columns of its one projection buffer.
TRL_TILE = (4096, 32768)

CHECKPOINTING = ("off", "selective", "full")
ATTENTION = ("varlen", "sdpa", "sdpa_mask")
HEADS = ("chunked", "kept", "fused", "full")


class MemoryPlanError(ValueError):
    """The model cannot train within the memory given, or a plan cannot shrink further."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = True
    max_positions: int = 32768
    qkv_bias: bool = False
    name: str = "model"

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (Qwen2, Llama and their kin; a multimodal
        config's text part)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if getattr(config, k, None) is None]
        if missing:
            raise MemoryPlanError(f"memory plan: the model's config has no {', '.join(missing)} "
                                  f"({type(config).__name__}), so its memory cannot be estimated")
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        model_type = getattr(config, "model_type", "") or ""
        return cls(
            hidden=hidden, layers=int(config.num_hidden_layers), heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            intermediate=int(config.intermediate_size), vocab=int(config.vocab_size),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            max_positions=int(getattr(config, "max_position_embeddings", None) or 0),
            qkv_bias=model_type.startswith("qwen2") or bool(getattr(config, "attention_bias", False)),
            name=model_type or type(config).__name__)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def params(self) -> int:
        """Every weight: embeddings, layers, final norm, and the LM head if not tied."""
        d, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        attn = d * q + 2 * d * kv + q * d + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * d * i + 2 * d
        return self.vocab * d * (1 if self.tied else 2) + self.layers * layer + d

    def lora_params(self, r: int) -> int:
        """LoRA on every linear layer but the head (PEFT's all-linear): r x (in + out)
        for q, k, v, o, gate, up, down."""
        d, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + i) + (i + d)
        return self.layers * r * per_layer


@functools.lru_cache(maxsize=1)
def varlen_repeats_kv() -> bool:
    """Whether this torch's varlen_attn needs k and v repeated to every query head
    (no `enable_gqa` in some releases: trainer/attention.py then repeats them, and
    the kernel keeps the repeated copies for backward)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return True
    return "enable_gqa" not in inspect.signature(varlen_attn).parameters


def _mixed(dtype_bytes: int) -> bool:
    """Half precision trains under autocast (accelerate), with PEFT keeping the
    adapters in fp32; fp32 trains without either."""
    return dtype_bytes < 4


def layer_bytes_per_token(shape: ModelShape, *, dtype_bytes: int = 2, lora_r: int = 16,
                          full_finetune: bool = False, attention: str = "varlen",
                          repeat_kv: bool | None = None, width: int = 0) -> float:
    """Bytes one decoder layer keeps for backward, per token (Qwen2/Llama layer:
    RMSNorm, q/k/v/o, sdpa-style attention, SiLU-gated MLP, residual adds).

    width: the padded row length, for the dense-mask term of `sdpa_mask`.
    repeat_kv: whether the kernel gets k and v repeated to every query head
    (transformers does so for sdpa with a mask, trainer/attention.py for a
    varlen_attn without `enable_gqa`; None: implied by `attention` and this torch).
    """
    b = dtype_bytes
    d, q, kv, i, h = shape.hidden, shape.q_width, shape.kv_width, shape.intermediate, shape.heads
    if repeat_kv is None:
        repeat_kv = attention == "sdpa_mask" or (attention == "varlen" and shape.kv_heads < shape.heads
                                                 and varlen_repeats_kv())
    # Both RMSNorms upcast their input to fp32 and keep it for the backward of x².
    norms = 2 * 4 * d
    if full_finetune:
        norms += 2 * b * d  # a trainable norm weight also keeps the normalized input
    # Inputs kept for the weight gradients. Full fine-tuning and same-dtype LoRA keep
    # one tensor per shared input (q/k/v read the same one, so do gate/up); under
    # autocast each of the 7 adapters casts its input to its fp32 weight's dtype
    # and autocast casts it back, so each keeps a copy of its own.
    if full_finetune:
        proj = b * (2 * d + q + i)
    elif _mixed(dtype_bytes):
        proj = b * (3 * d + q + 2 * d + i) + 7 * b * lora_r  # + lora_A's outputs, kept by lora_B
    else:
        proj = b * (2 * d + q + i) + 7 * b * lora_r
    # The attention kernel keeps q, k, v (k and v at their own width, or repeated to
    # every query head), its output, and the logsumexp of each head in fp32.
    attn = b * (q + 2 * (q if repeat_kv else kv) + q) + 4 * h
    if attention == "sdpa_mask":
        attn += b * width  # the boolean mask, converted to an additive one per layer and kept
    # The MLP keeps gate's output (for SiLU), SiLU's output and up's output (for the product).
    mlp = 3 * b * i
    return norms + proj + attn + mlp


def _backward_workspace(shape: ModelShape, dtype_bytes: int, full_finetune: bool) -> float:
    """Gradients alive at once while one layer is differentiated, per token: at
    down_proj, the gradient of its input from the frozen weight and from the
    adapter (in fp32 under autocast, then cast back), beside the incoming one."""
    b, i, d = dtype_bytes, shape.intermediate, shape.hidden
    cast = 0 if full_finetune or not _mixed(dtype_bytes) else 4 * i
    return 2 * b * i + cast + 2 * b * d


def head_bytes(shape: ModelShape, *, head: str, dtype_bytes: int, tokens: int, positions: int,
               region: int | None = None, head_trains: bool = False) -> float:
    """Peak bytes of the LM head and its loss, beyond the body's activations.

    chunked: trainer/logprobs.py, logits at completion positions only, a chunk of
      `HEAD_CHUNK_ELEMENTS` at a time. A frozen head (LoRA) takes each token's
      gradient with its log-probability in the forward and keeps that [K, H]; a
      head that trains (`head_trains`, full fine-tuning) recomputes each chunk in
      backward.
    kept: the old pg path: logits at `region` positions (rows x the span from the
      first completion to the end), made fp32 by accelerate's autocast wrapper,
      the `positions` completion rows gathered in fp32 and kept for backward.
    fused: TRL 1.16's fused head (what the measured sft rows ran, and what
      trainer/logprobs.py runs on CUDA with Triton): the completion states kept,
      their fp32 gradient and one [4,096 x 32,768] tile; a head that trains adds its
      weight's gradient accumulated in fp32, then cast.
    full: plain logits and cross-entropy at every position.
    """
    b, d, v = dtype_bytes, shape.hidden, shape.vocab
    f32 = 0 if b == 4 else 4  # an fp32 copy, unless the logits already are fp32
    if head == "chunked":
        chunk = min(positions, max(1, HEAD_CHUNK_ELEMENTS // v)) * v
        if not head_trains:
            # forward: the gradients gathered so far, and one chunk's logits with the
            # fp32 copy its softmax is worked in place on (8 bytes an element, bf16 or
            # fp32 alike: fp32 logits are cloned); backward: the gradients, upcast,
            # times the incoming one
            return max(positions * d * b + chunk * 8, positions * d * (2 * b + 8))
        # the hidden states at the completions (kept) and their gradient; then, while
        # a chunk is recomputed and differentiated, its fp32 logits (kept by logsumexp),
        # their exp(x - lse), and the two gradients that meet (logsumexp's and
        # gather's), all fp32: 16 bytes an element in bf16 and fp32 alike (the
        # compute-dtype logits are freed as soon as they are upcast)
        return positions * d * (b + 4) + chunk * 16
    if head == "kept":
        region = positions if region is None else region
        forward = region * v * (b + f32)  # the logits as the model returns them, and accelerate's fp32 copy
        gather = region * v * 4 + positions * v * 4  # fp32 logits, and the completion rows gathered
        # backward: the gathered rows (kept by logsumexp), their accumulated gradient, and
        # the zero-filled full-size gradient of one 1024-row chunk being added to it
        backward = 3 * positions * v * 4
        return max(forward, gather, backward)
    if head == "fused":
        tile = min(positions, TRL_TILE[0]) * TRL_TILE[1] * b
        return positions * d * (b + 4) + tile + (v * d * (4 + b) if head_trains else 0)
    if head == "full":
        # the logits in fp32 for the loss (compute-dtype ones freed once upcast, unless
        # the caller keeps the output), log-softmax kept, and its gradient
        return tokens * v * 12
    raise MemoryPlanError(f"memory estimate: unknown head {head!r} (one of {', '.join(HEADS)})")


@dataclass(frozen=True)
class Estimate:
    """The peak and its parts, in bytes (a test or a plan's notes print them).

    The step peaks either at the head (every layer's activations kept, the head's
    logits and their gradient alive) or during the backward of a layer (the layers
    below it still kept, this one recomputed if checkpointed, its gradients).
    """

    weights: float
    trainable: float  # parameters that train, their gradients and optimizer state
    activations: float  # everything the forward keeps for backward, the head's loss apart
    head: float
    backward: float  # the largest live set while a layer is differentiated

    @property
    def total(self) -> int:
        return int(self.weights + self.trainable + max(self.activations + self.head, self.backward))


def checkpoint_flags(layers: int, checkpointing: str, checkpoint_layers: int | None = None) -> list[bool]:
    """Which decoder layers recompute in backward. selective: `checkpoint_layers` of
    them (default half), spread evenly from the bottom, so the recompute cost grows
    one layer at a time (transformers' every_n_layers only offers half or all
    beyond L/2; setting each layer's `gradient_checkpointing` flag offers any k)."""
    if checkpointing == "off":
        return [False] * layers
    if checkpointing == "full":
        return [True] * layers
    if checkpointing == "selective":
        k = layers // 2 if checkpoint_layers is None else min(max(checkpoint_layers, 0), layers)
        return [(i + 1) * k // layers > i * k // layers for i in range(layers)]
    raise MemoryPlanError(f"memory estimate: unknown checkpointing {checkpointing!r} "
                          f"(one of {', '.join(CHECKPOINTING)})")


def estimate(shape: ModelShape, *, micro_batch_tokens: int, rows: int = 1, width: int = 0,
             lora_r: int = 16, full_finetune: bool = False, dtype_bytes: int = 2,
             checkpointing: str = "off", checkpoint_layers: int | None = None, attention: str = "varlen",
             repeat_kv: bool | None = None, head: str = "chunked", logits_positions: int | None = None,
             logits_region: int | None = None, fp32_master: bool = False) -> Estimate:
    """The parts of `estimate_peak`'s figure (same arguments)."""
    if attention not in ATTENTION:
        raise MemoryPlanError(f"memory estimate: unknown attention {attention!r} (one of {', '.join(ATTENTION)})")
    b = dtype_bytes
    tokens = rows * width if width > 0 else micro_batch_tokens  # what the layers compute on, padding included
    positions = tokens if logits_positions is None else logits_positions
    n = shape.params()
    weights = n * b  # every weight in the training dtype, frozen or not
    if full_finetune:
        # gradients in the weights' dtype and AdamW's two moments (like the weights);
        # with fp32 master weights, a fp32 copy and fp32 moments instead
        trainable = n * b + (n * (4 + 8) if fp32_master else n * 2 * b)
    else:
        # the adapters in fp32 (PEFT keeps them so under autocast), their gradients and AdamW's moments
        trainable = shape.lora_params(lora_r) * (4 + 4 + 8)
    per_layer = tokens * layer_bytes_per_token(shape, dtype_bytes=b, lora_r=lora_r, full_finetune=full_finetune,
                                               attention=attention, repeat_kv=repeat_kv, width=width)
    ck = checkpoint_flags(shape.layers, checkpointing, checkpoint_layers)
    # a checkpointed layer keeps only its input (the residual stream); the others keep everything
    kept = [tokens * b * shape.hidden if c else per_layer for c in ck]
    # shared by every layer: RoPE's cos and sin, the final norm's fp32 input
    shared = tokens * (2 * b * shape.head_dim + 4 * shape.hidden)
    if attention == "sdpa_mask" and any(ck):
        shared += tokens * width  # the boolean mask, an input every checkpoint keeps
    work = tokens * _backward_workspace(shape, b, full_finetune)
    backward, below = 0.0, sum(kept)
    for layer in reversed(range(shape.layers)):  # backward walks down, freeing each layer it leaves
        backward = max(backward, shared + below + (per_layer if ck[layer] else 0) + work)
        below -= kept[layer]
    head_peak = head_bytes(shape, head=head, dtype_bytes=b, tokens=tokens, positions=positions,
                           region=logits_region, head_trains=full_finetune)
    return Estimate(weights=weights, trainable=trainable, activations=shared + sum(kept), head=head_peak,
                    backward=backward)


def estimate_peak(shape: ModelShape, **kwargs) -> int:
    """Peak allocated bytes of one training step (forward, backward, optimizer).

    micro_batch_tokens: tokens in the micro-batch (packed: their sum; padded: set
      `rows` and `width`, the longest row, and the layers compute rows x width).
    lora_r / full_finetune: LoRA of that rank on every linear layer, or all weights.
    dtype_bytes: 2 (bf16/fp16 under autocast, fp32 adapters) or 4 (fp32).
    checkpointing: off | selective (`checkpoint_layers` of the layers) | full.
    attention: varlen (packed, no mask; flash-style kernels), sdpa (no mask),
      sdpa_mask (a dense mask: padded rows, or packs under sdpa).
    head: chunked (the new path) | kept (old pg) | fused (TRL 1.16 SFT) | full.
    logits_positions: completion tokens whose log-probabilities are taken (default:
      every token); logits_region: positions whose logits `kept` computes.
    """
    return estimate(shape, **kwargs).total


def attention_kind(attn_implementation: str, packed: bool) -> str:
    """The estimator's attention kind for a model loaded with `attn_implementation`:
    flash-style varlen kernels and flex_attention's block masks build no dense mask;
    sdpa and eager get one, over the padded rows or over the whole pack."""
    name = attn_implementation
    if name.startswith(("flash_attention", "nightshift_varlen", "flex_attention")):
        return "varlen"
    return "sdpa_mask"


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was made from, so `shrink` can re-estimate without the caller."""

    shape: ModelShape
    tokens_per_step: int
    lora_r: int = 16
    full_finetune: bool = False
    dtype_bytes: int = 2
    attention: str = "varlen"
    packed: bool = True
    completion_share: float = 1.0
    available_bytes: int | None = None
    longest_row: int = 0  # the longest row the data has (0: unknown, max_length)
    head: str = "chunked"  # the LM head's path (trainer/logprobs.py's head_kind)


def _level_name(layers: int, k: int) -> str:
    return "off" if k == 0 else "full" if k >= layers else "selective"


@dataclass
class MemoryPlan:
    """The micro-batch and the checkpointing a run trains with, chosen before step 1.

    micro_batch_tokens: tokens per forward (packed: their sum; padded: rows x width);
    a row longer than it travels alone, and the plan made sure one row of
    max_length fits. grad_accum: micro-batches per optimizer step. checkpointing:
    off | selective | full, `checkpointed_layers` of the decoder layers (which
    ones: `layer_flags()`). estimated_gib: the peak the estimator expects, as
    torch.cuda.max_memory_allocated would report it; available_gib: memory_fraction
    x the free memory (None: no device limit, a CPU).
    """

    micro_batch_tokens: int
    grad_accum: int
    checkpointing: str
    max_length: int
    estimated_gib: float
    available_gib: float | None
    notes: list[str] = field(default_factory=list)
    checkpointed_layers: int = 0
    free_gib: float | None = None
    memory_fraction: float | None = None
    inputs: PlanInputs | None = field(default=None, repr=False, compare=False)

    @property
    def tokens_per_step(self) -> int:
        """The tokens of a step the plan was made for (its micro-batches are budgets:
        a step of 256 tokens runs as one micro-batch of 256, not of 1,024)."""
        if self.inputs is not None:
            return self.inputs.tokens_per_step
        return self.micro_batch_tokens * self.grad_accum

    def layer_flags(self) -> list[bool]:
        """Per decoder layer, bottom first: set as that layer's `gradient_checkpointing`
        (after `activation_checkpointing_enable()` has given every layer the function)."""
        if self.inputs is None:
            raise MemoryPlanError("memory plan: this plan was not made by plan(), so its layers are unknown")
        return checkpoint_flags(self.inputs.shape.layers, self.checkpointing, self.checkpointed_layers)

    def line(self) -> str:
        ck = self.checkpointing
        if ck == "selective" and self.inputs is not None:
            ck += f" ({self.checkpointed_layers} of {self.inputs.shape.layers} layers)"
        step = self.tokens_per_step
        exact = self.micro_batch_tokens * self.grad_accum == step
        head = (f"memory plan: micro-batch {'' if exact else 'up to '}{self.micro_batch_tokens:,} tokens x "
                f"{self.grad_accum} accumulation {'=' if exact else 'for'} {step:,} tokens/step, checkpointing {ck}, "
                f"max_length {self.max_length:,}, ")
        if self.available_gib is None:
            tail = f"estimated {self.estimated_gib:.1f} GiB, no device limit (CPU)"
        else:
            tail = (f"estimated {self.estimated_gib:.1f} GiB (+{ALLOCATOR_OVERHEAD - 1:.0%} allocator) of "
                    f"{self.available_gib:.1f} GiB available")
            if self.free_gib is not None and self.memory_fraction is not None:
                tail += f" ({self.memory_fraction:g} of {self.free_gib:.1f} free)"
        return head + tail + "".join(f"; {n}" for n in self.notes)


def device_budget(memory_fraction: float, device=None) -> tuple[int | None, int | None]:
    """(available bytes, free bytes) on a CUDA device: the share of what is free now,
    after the CUDA context and anything else on the card, and within what this
    process may still take (`process_cap`). On a CPU: (None, None), no limit: a
    CPU run is a test or a demo on a tiny model, and a plan that depended on the
    machine's free RAM would make those runs differ by machine."""
    import torch

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    cap = process_cap(device, total)
    if cap is not None:
        free = min(free, cap[1])
    return int(free * memory_fraction), int(free)


def process_cap(device, total: int) -> tuple[float, int] | None:
    """(fraction, bytes this process may still reserve) when the process's memory is
    capped below the whole card (`torch.cuda.set_per_process_memory_fraction`, as
    benchmarks/train_gpu.py's --memory-gib does): the caching allocator refuses to
    reserve beyond fraction x total, counting what it already holds, however much
    the card has free. None: no cap."""
    import torch

    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    fraction = float(get(device))
    if fraction >= 1.0:
        return None
    return fraction, max(0, int(fraction * total) - int(torch.cuda.memory_reserved(device)))


def _round_up(n: int, q: int = TOKEN_QUANTUM) -> int:
    return max(q, -(-int(n) // q) * q)


def _candidates(low: int, tokens_per_step: int) -> list[int]:
    """Micro-batch sizes worth trying: the longest row rounded up to 1024, then
    powers of two x 1024 up to a whole step."""
    low = _round_up(low)
    top = max(low, _round_up(tokens_per_step))
    out, p = {low, top}, TOKEN_QUANTUM
    while p < top:
        if p > low:
            out.add(p)
        p *= 2
    return sorted(out)


def _levels(layers: int, requested: str) -> list[int]:
    """Numbers of checkpointed layers the plan may choose, cheapest first."""
    return {"auto": list(range(layers + 1)), "off": [0], "selective": list(range(1, layers)) or [layers],
            "on": [layers], "full": [layers]}[requested]


def _estimate(inp: PlanInputs, micro: int, width: int, k: int) -> int:
    rows, w = (1, 0) if inp.packed else (max(1, micro // width), width)
    if inp.packed and inp.attention == "sdpa_mask":
        rows, w = 1, micro  # one pack under a dense block-diagonal mask
    return estimate_peak(inp.shape, micro_batch_tokens=micro, rows=rows, width=w, lora_r=inp.lora_r,
                         full_finetune=inp.full_finetune, dtype_bytes=inp.dtype_bytes,
                         checkpointing=_level_name(inp.shape.layers, k), checkpoint_layers=k,
                         attention=inp.attention, head=inp.head,
                         logits_positions=max(1, math.ceil(micro * inp.completion_share)))


def _fits(inp: PlanInputs, micro: int, width: int, k: int) -> bool:
    return inp.available_bytes is None or _estimate(inp, micro, width, k) * ALLOCATOR_OVERHEAD <= inp.available_bytes


def _make(inp: PlanInputs, micro: int, max_length: int, width: int, k: int, notes: list[str],
          free_bytes: int | None, memory_fraction: float | None) -> MemoryPlan:
    return MemoryPlan(
        micro_batch_tokens=micro, grad_accum=_accumulation(inp.tokens_per_step, micro),
        checkpointing=_level_name(inp.shape.layers, k), max_length=max_length,
        estimated_gib=_estimate(inp, micro, width, k) / GIB,
        available_gib=None if inp.available_bytes is None else inp.available_bytes / GIB, notes=notes,
        checkpointed_layers=min(k, inp.shape.layers),
        free_gib=None if free_bytes is None else free_bytes / GIB, memory_fraction=memory_fraction, inputs=inp)


def plan(shape: ModelShape, *, tokens_per_step: int, max_length_wanted: int = 0, longest_row: int = 0,
         lora_r: int = 16, full_finetune: bool = False, dtype_bytes: int = 2, available_bytes: int | None = None,
         attention: str = "varlen", packed: bool = True, checkpointing: str = "auto",
         completion_share: float = 1.0, free_bytes: int | None = None,
         memory_fraction: float | None = None, head: str = "chunked") -> MemoryPlan:
    """The micro-batch and checkpointing for a run, from the model's shape and the
    memory available (`device_budget`; None: no limit).

    max_length_wanted: 0 = the model's own limit. longest_row: the longest row the
    data has (0: unknown, max_length assumed); a micro-batch must hold it. If it
    does not fit even with every layer checkpointed, max_length is lowered to what
    fits (a note says so; longer rows are left out and counted by the caller).
    checkpointing: auto (the plan chooses) | off | selective | on/full (honoured;
    the micro-batch adapts). completion_share: the largest share of a micro-batch's
    tokens that are completion tokens (the head's memory follows it; 1.0 is safe).
    head: the LM head's path, "chunked" (ours) or "fused" (TRL's, which
    trainer/logprobs.py runs on CUDA with Triton: `head_kind`).

    The rule: the fewest checkpointed layers whose largest fitting micro-batch
    reaches `EFFICIENT_TOKENS` (or a whole step, or the longest row, if that is
    the binding one); if none does, the largest micro-batch any level fits, the
    cheaper level on a tie. A micro-batch of 8k tokens already keeps the GPU
    busy, while each checkpointed layer costs its forward again, so memory buys
    fewer recomputed layers first and bigger micro-batches after.
    """
    if tokens_per_step < 1:
        raise MemoryPlanError(f"memory plan: tokens_per_step must be at least 1, not {tokens_per_step}")
    if checkpointing not in ("auto", "on", "off", "selective", "full"):
        raise MemoryPlanError(f"memory plan: unknown checkpointing {checkpointing!r} (auto, on, off or selective)")
    inp = PlanInputs(shape=shape, tokens_per_step=tokens_per_step, lora_r=lora_r, full_finetune=full_finetune,
                     dtype_bytes=dtype_bytes, attention=attention, packed=packed,
                     completion_share=min(max(completion_share, 0.0), 1.0), available_bytes=available_bytes,
                     longest_row=max(0, longest_row), head=head)
    notes: list[str] = []
    limit = shape.max_positions or 32768
    max_length = max_length_wanted or limit
    if max_length > limit:
        notes.append(f"max_length {max_length:,} is beyond the model's {limit:,} positions: capped")
        max_length = limit
    need = min(max_length, longest_row) if longest_row > 0 else max_length
    levels = _levels(shape.layers, checkpointing)
    if available_bytes is None:
        return _make(inp, _candidates(need, tokens_per_step)[-1], max_length, need, levels[0], notes, free_bytes,
                     memory_fraction)
    most = levels[-1]
    if not _fits(inp, _round_up(need), need, most):
        fitting = [n for n in range(_round_up(need) - TOKEN_QUANTUM, 0, -TOKEN_QUANTUM) if _fits(inp, n, n, most)]
        if not fitting:
            est = _estimate(inp, TOKEN_QUANTUM, TOKEN_QUANTUM, most) * ALLOCATOR_OVERHEAD / GIB
            parts = estimate(shape, micro_batch_tokens=0, lora_r=lora_r, full_finetune=full_finetune,
                             dtype_bytes=dtype_bytes, head=head, logits_positions=0)
            raise MemoryPlanError(
                f"memory plan: {shape.name} does not fit in the {available_bytes / GIB:.1f} GiB available: its "
                f"weights and training state take {(parts.weights + parts.trainable) / GIB:.1f} GiB, and "
                f"{TOKEN_QUANTUM:,} tokens with checkpointing {_level_name(shape.layers, most)} need about "
                f"{est:.1f} GiB in all (use a bigger GPU, LoRA instead of full fine-tuning, or a higher "
                "train.memory_fraction)")
        notes.append(f"max_length lowered from {max_length:,} to {fitting[0]:,}: a longer row does not fit "
                     f"even with checkpointing {_level_name(shape.layers, most)}")
        max_length = need = fitting[0]
    candidates = _candidates(need, tokens_per_step)
    floor = max(candidates[0], min(EFFICIENT_TOKENS, candidates[-1]))
    best: tuple[int, int] | None = None  # (micro, k)
    for k in levels:
        fit = [m for m in candidates if _fits(inp, m, need, k)]
        if not fit:
            continue
        if fit[-1] >= floor:
            return _make(inp, fit[-1], max_length, need, k, notes, free_bytes, memory_fraction)
        if best is None or fit[-1] > best[0]:
            best = (fit[-1], k)
    assert best is not None  # the most saving level fits the longest row (checked above)
    return _make(inp, best[0], max_length, need, best[1], notes, free_bytes, memory_fraction)


def shrink(p: MemoryPlan) -> MemoryPlan:
    """The plan to retry a step with after an out-of-memory error (the estimate was
    wrong, or something else took memory): half the micro-batch while it stays at
    least `EFFICIENT_TOKENS` and the longest row; else checkpoint a quarter more of
    the layers (at least one); else half the micro-batch down to the longest row.
    Tokens per step stay about the same (accumulation grows). Pure: the caller
    retries with the result. Raises MemoryPlanError when nothing is left."""
    if p.inputs is None:
        raise MemoryPlanError("memory plan: this plan was not made by plan(), so it cannot be shrunk")
    inp, layers = p.inputs, p.inputs.shape.layers
    longest = min(p.max_length, inp.longest_row) if inp.longest_row else p.max_length
    low = _round_up(longest)
    half = max(low, _round_up(p.micro_batch_tokens // 2))  # never below the longest row
    half = min(half, p.micro_batch_tokens)
    k = p.checkpointed_layers
    more = min(layers, k + max(1, layers // 4))
    what = f"out of memory at micro-batch {p.micro_batch_tokens:,} tokens, {k} of {layers} layers checkpointed"
    if half < p.micro_batch_tokens and half >= EFFICIENT_TOKENS:
        micro, how = half, f"micro-batch {half:,}"
    elif k < layers:
        micro, k, how = p.micro_batch_tokens, more, f"{more} of {layers} layers checkpointed"
    elif half < p.micro_batch_tokens:
        micro, how = half, f"micro-batch {half:,}"
    else:
        raise MemoryPlanError(f"memory plan: {what}, as small as the longest row ({longest:,} tokens): nothing "
                              "left to shrink (lower train.max_length or train.memory_fraction, or use a bigger GPU)")
    out = _make(inp, micro, p.max_length, min(longest, micro), k, [*p.notes, f"{what}: retried with {how}"],
                None, p.memory_fraction)
    out.free_gib = p.free_gib
    out.grad_accum = _accumulation(p.tokens_per_step, micro)
    return out


def _accumulation(tokens_per_step: int, micro: int) -> int:
    """Micro-batches a step takes at least: a step of 100,000 tokens in budgets of
    16,384 is 7 of them, not round()'s 6."""
    return max(1, -(-tokens_per_step // micro))
