"""Packed (padding-free) attention without the flash-attn package.

A packed batch is one row of sequences laid end to end, `position_ids`
restarting at 0 for each; attention must stay inside each sequence. One
attention implementation, registered with transformers as `nightshift_varlen`,
does that everywhere, with the best kernel the device has:

- CUDA: PyTorch's own FlashAttention over cu_seqlens (`torch.nn.attention.varlen`,
  torch >= 2.9): cost Σ len², no mask, no padding. It must first pass a
  forward+backward self-check against sdpa on that GPU.
- anywhere else, or when that kernel is missing or fails its check: sdpa once per
  sequence, causal, no mask (`per_sequence_attn`). Exact, and on a CPU the fastest
  option measured (tiny Qwen2, 16 rows of 20-200 tokens, forward+backward:
  164 ms against 269 ms padded sdpa, 449 ms sdpa with transformers' packed
  block-diagonal mask, 1233 ms eager; 6 rows of 100-1500 tokens at hidden 128:
  1.9 s, 2.6 s padded, 8.3 s masked; flex_attention has no backward on a CPU).

The two kernels take the same arguments, so the CPU runs every line around the
CUDA one: registration, the [B, H, S, D] -> [T, H, D] layouts, grouped KV
heads, cu_seqlens, and the torch 2.10 / 2.11+ signatures (`call_varlen`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

#: The attention implementation name a model is loaded with to use these kernels.
VARLEN = "nightshift_varlen"

#: Batch keys the collator may add (see `packed_kwargs`) so sequence boundaries are
#: worked out once per batch on the host, not read back from `position_ids` on
#: the device at each forward. The names are transformers' own
#: (`FlashAttentionKwargs`), so flash_attention_2 reads them too.
PACKED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class AttentionChoice:
    """What a run loads its model with, and why (for the plan line).

    name: the `attn_implementation`. packed: whether batches are packed under it
    (sequences concatenated, positions restarting) rather than padded.
    why: one clause a person reads in the plan line.
    """

    name: str
    packed: bool
    why: str


def packed_attention(device: torch.device | str, requested: str = "auto", *,
                     dtype: torch.dtype | None = None) -> AttentionChoice:
    """The attention implementation for a run on `device`, worked out once.

    `requested` is `train.attention`: "auto" (or `nightshift_varlen`) picks the
    kernel as the module docstring says; another name is honoured as configured
    (packed through transformers' masks from position_ids, or flash-attn's varlen
    path). `dtype`: the model's; FlashAttention needs fp16/bf16.
    """
    device = torch.device(device)
    if requested not in ("auto", VARLEN):
        if requested.startswith("flash_attention"):
            why = f"{requested} as configured, packed through its varlen kernel"
        else:
            why = f"{requested} as configured, packed through transformers' masks from position_ids"
        return AttentionChoice(requested, True, why)
    if requested == "auto" and device.type == "cuda" and _flash_attn_installed():
        return AttentionChoice("flash_attention_2", True, "flash_attention_2 (the flash-attn package is installed)")
    register()
    if device.type != "cuda":
        return AttentionChoice(VARLEN, True, f"{VARLEN}: sdpa per sequence on the {device.type}, no mask")
    problem = varlen_problem(device, dtype)
    if problem is None:
        return AttentionChoice(VARLEN, True, f"{VARLEN}: torch varlen_attn (FlashAttention on cu_seqlens, no mask)")
    return AttentionChoice(VARLEN, True, f"{VARLEN}: sdpa per sequence, no mask ({problem})")


def _flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def varlen_problem(device: torch.device, dtype: torch.dtype | None = None) -> str | None:
    """Why torch's varlen kernel cannot serve `device`, or None when it can (it
    then passed a forward+backward self-check against sdpa on that device)."""
    if device.type != "cuda":
        return "torch's varlen_attn is CUDA-only"
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        return f"varlen_attn needs fp16/bf16, the model is {str(dtype).removeprefix('torch.')}"
    try:
        torch_varlen()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return _self_check(device.index if device.index is not None else torch.cuda.current_device())


# --- the kernels and their calling convention -------------------------------------------------------

def torch_varlen() -> Callable[..., torch.Tensor]:
    """torch's varlen_attn (ImportError where this torch has none)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The kernel `nightshift_varlen` runs on `device` (tests replace this)."""
    if device.type == "cuda" and varlen_problem(device) is None:
        return torch_varlen()
    return per_sequence_attn


@functools.lru_cache(maxsize=8)
def _convention(kernel: Callable) -> tuple[bool, bool, bool, bool]:
    """(takes window_size, takes is_causal, takes enable_gqa, takes scale): torch
    2.9/2.10 say causal with `is_causal=True`, 2.11+ with `window_size=(-1, 0)`;
    `enable_gqa` exists only in some releases (else KV heads are repeated)."""
    params = inspect.signature(kernel).parameters
    return "window_size" in params, "is_causal" in params, "enable_gqa" in params, "scale" in params


def call_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, *, scale: float, window: int | None = None,
                kernel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of packed [T, H, D] tensors with `kernel` (default: the
    device's), whatever its signature. `window`: a sliding window in tokens."""
    kernel = kernel or varlen_kernel(q.device)
    has_window, has_causal, has_gqa, has_scale = _convention(kernel)
    kwargs: dict[str, Any] = {}
    if has_window:
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    elif has_causal and window is None:
        kwargs["is_causal"] = True
    else:
        raise NotImplementedError("this torch's varlen_attn cannot express "
                                  + ("a sliding window" if window is not None else "causal attention"))
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:  # query head h reads KV head h // groups, as transformers' repeat_kv lays them out
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    if has_scale:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is head_dim ** -0.5
        q = q * (scale * q.shape[-1] ** 0.5)
    return kernel(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kwargs)


def per_sequence_attn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                      cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, return_aux: Any = None,
                      scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                      enable_gqa: bool = False) -> torch.Tensor:
    """varlen_attn's contract (torch >= 2.11's signature) in plain torch: sdpa once
    per sequence, so no mask and no cross-sequence work."""
    if not enable_gqa and query.shape[1] != key.shape[1]:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got "
                         f"Hq={query.shape[1]} and Hkv={key.shape[1]}. Try setting enable_gqa=True for GQA.")
    left, right = window_size
    outs = []
    bounds_q, bounds_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for i in range(len(bounds_q) - 1):
        # [1, H, L, D]: sdpa's fused CUDA kernels take 4-D inputs only
        q = query[bounds_q[i]:bounds_q[i + 1]].transpose(0, 1)[None]
        k = key[bounds_k[i]:bounds_k[i + 1]].transpose(0, 1)[None]
        v = value[bounds_k[i]:bounds_k[i + 1]].transpose(0, 1)[None]
        if (left, right) == (-1, -1):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
        elif (left, right) == (-1, 0):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=enable_gqa)
        else:
            n = q.shape[2]
            i_q = torch.arange(n, device=q.device)[:, None]
            i_k = torch.arange(k.shape[2], device=q.device)[None, :]
            allowed = (i_k <= i_q + (n if right < 0 else right)) & (i_k >= i_q - (n if left < 0 else left))
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                                                 enable_gqa=enable_gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs) if outs else query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])


# --- sequence boundaries -----------------------------------------------------------------------------

def packed_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """The varlen kwargs of a packed batch (`PACKED_KEYS`), from its `position_ids`
    [B, S], flattened: a sequence starts wherever a position is not its
    predecessor + 1 (so each unpadded row of a batch is a sequence too). Call it
    in the collator, on the host: the forward then never reads positions back."""
    flat = position_ids.reshape(-1).to("cpu")
    if flat.numel() == 0:
        raise ValueError("packed_kwargs: position_ids is empty: a packed batch needs at least one token")
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    cu = torch.cat([starts.nonzero().reshape(-1), torch.tensor([flat.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


#: (weak reference to the tensor the boundaries came from, cu_seqlens on the host,
#: on the device, the longest sequence): every layer of a forward sees one tensor.
_memo: list[Any] = [None, None, None, 0]


def _bounds(source: torch.Tensor, device: torch.device, cu: torch.Tensor | None = None,
            longest: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """cu_seqlens (host, device) and the longest sequence, from `cu`/`longest` when
    the collator gave them, else from `source` (position_ids); once per forward."""
    ref = _memo[0]
    if ref is not None and ref() is source:
        return _memo[1], _memo[2], _memo[3]
    if cu is None or longest is None:
        kw = packed_kwargs(source)
        cu, longest = kw["cu_seq_lens_q"], kw["max_length_q"]
    host = cu.to("cpu", torch.int32)
    dev = cu.to(device, torch.int32, non_blocking=True)
    _memo[:] = [weakref.ref(source), host, dev, int(longest)]
    return host, dev, int(longest)


# --- the transformers side ---------------------------------------------------------------------------

def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, is_causal: bool | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (query [B, Hq, S, D], key/value
    [B, Hkv, S, D] -> output [B, S, Hq, D]) on the varlen kernel.

    Only the training shape takes the kernel: no mask, as many keys as queries
    (no cache), causal. Anything else (a padding mask, a decoding step) is what
    sdpa does best and goes there, with the mask `varlen_mask` let transformers
    build for it: a model loaded this way can still generate.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or query.shape[2] != key.shape[2] or not causal:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, softcap=softcap, **kwargs)
    if softcap is not None:
        raise ValueError(f"{VARLEN}: attention logit softcapping is not supported; load the model with sdpa")
    if dropout and module.training:
        raise ValueError(f"{VARLEN}: attention dropout {dropout} is not supported; set attention_dropout to 0 "
                         "or load the model with sdpa")
    b, hq, s, d = query.shape
    # FlashAttention computes in fp16/bf16 only: fp32 on a GPU stays exact on sdpa
    fp32_on_gpu = query.is_cuda and query.dtype not in (torch.float16, torch.bfloat16)
    kernel = per_sequence_attn if fp32_on_gpu else varlen_kernel(query.device)
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("max_length_q") is not None:
        source = kwargs["cu_seq_lens_q"]
        host, dev, longest = _bounds(source, query.device, source, kwargs["max_length_q"])
    else:
        pos = kwargs.get("position_ids")
        if pos is None:
            pos = torch.arange(s, device=query.device).expand(b, s)
        elif pos.shape[0] != b:
            pos = pos.expand(b, -1)
        host, dev, longest = _bounds(pos, query.device)
    if int(host[-1]) != b * s:
        raise ValueError(f"{VARLEN}: the sequence boundaries cover {int(host[-1])} tokens, the batch has {b * s}")
    q = query.transpose(1, 2).reshape(b * s, hq, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], value.shape[-1])
    cu = host if kernel is per_sequence_attn else dev  # the loop reads bounds on the host: no sync per layer
    out = call_varlen(q, k, v, cu, cu, longest, longest, scale=scaling if scaling is not None else d ** -0.5,
                      window=sliding_window, kernel=kernel)
    return out.reshape(b, s, hq, value.shape[-1]), None


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor | None:
    """The mask transformers builds for `nightshift_varlen`: none at all for the
    training shape (the kernel reads sequence boundaries from cu_seqlens), and
    sdpa's mask otherwise (padding, a cache), for the sdpa path those calls take."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0 and q_length == kv_length
    if attention_mask is None and plain:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
                     attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Make `nightshift_varlen` a name `from_pretrained(attn_implementation=...)`
    accepts (idempotent; the registration is process-wide)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, varlen_mask)


# --- the self-check ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _self_check(device_index: int) -> str | None:
    return self_check(torch.device("cuda", device_index), torch_varlen())


def self_check(device: torch.device, kernel: Callable[..., torch.Tensor]) -> str | None:
    """Run `kernel` once, forward and backward, on ragged GQA sequences (lengths 1
    to 300) against sdpa sequence by sequence in fp32 on the same device; None if
    it agrees, else why not. A kernel that raises or disagrees costs the run its
    speed, not its night: it falls back to sdpa per sequence and the plan line
    says why. Runs with gradients on and autocast off whatever the caller's
    context (the first use may come under no_grad, from a μ recomputation)."""
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False):
            gen = torch.Generator(device=device).manual_seed(0)
            lengths = [1, 7, 300, 64]
            t, hq, hkv, d = sum(lengths), 8, 2, 64
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            q, k, v = (torch.randn(t, h, d, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
                       for h in (hq, hkv, hkv))
            out = call_varlen(q, k, v, cu, cu, max(lengths), max(lengths), scale=d ** -0.5, kernel=kernel)
            grad = torch.randn(out.shape, device=device, generator=gen).to(out.dtype)
            got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
            qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, k, v))
            ref_out = per_sequence_attn(qr, kr, vr, cu.cpu(), cu.cpu(), max(lengths), max(lengths), scale=d ** -0.5,
                                        window_size=(-1, 0), enable_gqa=True)
            want = [ref_out, *torch.autograd.grad(ref_out, (qr, kr, vr), grad.float())]
            for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
                err = (g.float() - w).abs().max().item()
                if not err <= 0.05 * max(w.abs().max().item(), 1.0):  # bf16 against fp32: ~1e-2 at worst
                    return f"varlen_attn failed its self-check: {name} off by {err:.3g}"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernel
        return f"varlen_attn failed its self-check: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


# The name is valid as soon as this module is imported: a model loaded with it
# (a μ recomputation, an evaluation) must not depend on who called packed_attention first.
register()
