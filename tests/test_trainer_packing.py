"""Packed attention (trainer/attention.py): packed, each row's loss and gradients
equal those of the row alone, for sft (token-mean NLL), pg and awr, on the Qwen2
and Llama layouts, through `completion_logprobs` and the attention a run picks.

The CUDA kernel cannot run on a CPU; its plumbing (registration, layouts, grouped
KV heads, cu_seqlens, the torch 2.10 / 2.11+ signatures) runs here with kernels
that take its exact arguments. The `gpu` tests check the kernel itself.

Tolerances: fp32 on a CPU, one sequence's attention computed alone or inside a
pack: losses within 1e-5 absolute, gradients within 1e-4 relative + 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from nightshift.trainer import attention, logprobs, tiny
from nightshift.trainer.algorithms.pg import pg_loss
from nightshift.trainer.loop import collate

#: (prompt, completion) tokens: a one-token prompt, a one-token completion, a long row
ROWS = [(6, 4), (1, 1), (23, 9), (3, 1), (60, 12)]


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads, and on a busy machine they lose ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def features(tok, rows=ROWS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, c) in enumerate(rows):
        ids = torch.randint(5, len(tok), (p + c,), generator=g).tolist()
        old = torch.randn(c, generator=g).sub(2.0).tolist()
        if c > 1:
            old[0] = math.nan  # a token whose μ is unknown
        out.append({"input_ids": ids, "completion_start": p, "advantage": (-1.0) ** i * (0.5 + i),
                    "weight": 1.0 / (1 + i), "old_logprobs": old})
    return out


def lora_model(tok, arch: str, attn: str, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    from peft import LoraConfig, get_peft_model

    m = tiny.build_model(tok, arch, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=3)
    m.set_attn_implementation(attn)
    m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(4)
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return m


def sft_loss(logp, batch):
    """sft on one row: the mean NLL of its completion tokens."""
    return -logp.mean(), {}


def pg_row_loss(logp, batch):
    """pg's default (TOPR: negatives' ratio truncated where μ is logged)."""
    return pg_loss(logp, batch["old_logprobs"], batch["advantage"], batch["tok_seq"], batch["weight"])


def awr_row_loss(logp, batch):
    """awr: the weighted log-likelihood, no ratio (μ unknown everywhere)."""
    unknown = torch.full_like(batch["old_logprobs"], math.nan)
    return pg_loss(logp, unknown, batch["advantage"].abs(), batch["tok_seq"], batch["weight"], clip="none")


LOSSES = {"sft": sft_loss, "pg": pg_row_loss, "awr": awr_row_loss}


def row_batch(batch: dict, i: int) -> dict:
    """Row i's share of a collated batch, for its loss alone (the loss's inputs only)."""
    sel = batch["tok_seq"] == i
    return {"old_logprobs": batch["old_logprobs"][sel], "tok_seq": torch.zeros(int(sel.sum()), dtype=torch.long),
            "advantage": batch["advantage"][i:i + 1], "weight": batch["weight"][i:i + 1]}


def per_row_losses_and_grads(model, batch, n_rows: int, objectives: dict):
    """{loss name: [(row i's loss, its gradients w.r.t. the LoRA weights)]}, one forward."""
    params = [p for p in model.parameters() if p.requires_grad]
    logp = logprobs.completion_logprobs(model, batch, chunk_tokens=7)
    out: dict[str, list] = {}
    for name, objective in objectives.items():
        out[name] = []
        for i in range(n_rows):
            loss, _ = objective(logp[batch["tok_seq"] == i], row_batch(batch, i))
            out[name].append((loss.detach(), torch.autograd.grad(loss, params, retain_graph=True)))
    return out


def assert_rows_equal(packed_model, alone_model, tok, feats, objectives: dict):
    packed = per_row_losses_and_grads(packed_model, collate(feats, tok.pad_token_id, True), len(feats), objectives)
    for i, f in enumerate(feats):
        alone = per_row_losses_and_grads(alone_model, collate([f], tok.pad_token_id, False), 1, objectives)
        for name in objectives:
            ((loss, grads),) = alone[name]
            torch.testing.assert_close(packed[name][i][0], loss, atol=1e-5, rtol=0, msg=f"{name} row {i} loss")
            for j, (g_packed, g_alone) in enumerate(zip(packed[name][i][1], grads)):
                torch.testing.assert_close(g_packed, g_alone, rtol=1e-4, atol=1e-6, msg=f"{name} row {i} grad {j}")
            assert any(g.abs().sum() > 0 for g in grads), f"{name} row {i}: no gradient to compare"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_rows_equal_rows_alone(tok, arch):
    """sft, pg and awr, through the attention a CPU run picks (nightshift_varlen:
    sdpa per sequence); the row alone runs plain sdpa, unpacked."""
    choice = attention.packed_attention("cpu")
    assert (choice.name, choice.packed) == (attention.VARLEN, True)
    assert_rows_equal(lora_model(tok, arch, choice.name), lora_model(tok, arch, "sdpa"), tok, features(tok), LOSSES)


def test_packed_rows_equal_rows_alone_with_transformers_masks(tok):
    """`train.attention: sdpa` packs through transformers' block-diagonal masks."""
    assert attention.packed_attention("cpu", "sdpa") == attention.AttentionChoice(
        "sdpa", True, "sdpa as configured, packed through transformers' masks from position_ids")
    assert_rows_equal(lora_model(tok, "qwen2", "sdpa"), lora_model(tok, "qwen2", "sdpa"), tok, features(tok),
                      {"pg": pg_row_loss})


# --- the varlen plumbing, with stand-ins for torch's CUDA kernel ---------------------------------------

def kernel_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's varlen_attn signature (window_size, enable_gqa)."""
    return attention.per_sequence_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                       window_size=window_size, enable_gqa=enable_gqa)


def kernel_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
                page_table=None, seqused_k=None):
    """torch 2.11's: window_size, but no enable_gqa (KV heads must match)."""
    assert query.shape[1] == key.shape[1], "no enable_gqa in this signature"
    return attention.per_sequence_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                       window_size=window_size)


def kernel_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False,
                scale=None):
    """torch 2.10's: is_causal instead of window_size."""
    assert query.shape[1] == key.shape[1], "no enable_gqa in this signature"
    return attention.per_sequence_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                       window_size=(-1, 0) if is_causal else (-1, -1))


KERNELS = {"2.13": kernel_2_13, "2.11": kernel_2_11, "2.10": kernel_2_10}


def dense_reference(q, k, v, lengths, scale):
    """Attention over the whole pack with a block-diagonal causal mask, written out."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    idx = torch.arange(q.shape[0])
    allowed = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("version", sorted(KERNELS))
def test_call_varlen_adapts_to_each_signature(version):
    lengths = [1, 5, 17, 2]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), 8, 16, generator=g, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 16, generator=g, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 16, generator=g, requires_grad=True)
    cu = torch.tensor([0, 1, 6, 23, 25], dtype=torch.int32)
    got = attention.call_varlen(q, k, v, cu, cu, 17, 17, scale=0.3, kernel=KERNELS[version])
    want = dense_reference(q, k, v, lengths, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(want.shape, generator=g)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_call_varlen_without_scale_parameter():
    """A kernel with no `scale` argument gets a query pre-scaled to the same result."""
    def no_scale(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False):
        return attention.per_sequence_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                           window_size=window_size, enable_gqa=enable_gqa)

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(9, h, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    got = attention.call_varlen(q, k, v, cu, cu, 5, 5, scale=0.2, kernel=no_scale)
    torch.testing.assert_close(got, dense_reference(q, k, v, [4, 5], 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", sorted(KERNELS))
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_through_each_kernel_signature(tok, monkeypatch, arch, version):
    """The whole model on each signature's kernel: the layouts, grouped KV heads
    (4 query heads on 2 KV heads) and boundaries the CUDA kernel would get."""
    calls = []

    def kernel_for(device):
        def spy(*args, **kwargs):
            calls.append(args[3].tolist())
            return KERNELS[version](*args, **kwargs)

        spy.__signature__ = __import__("inspect").signature(KERNELS[version])
        return spy

    monkeypatch.setattr(attention, "varlen_kernel", kernel_for)
    attention._convention.cache_clear()
    feats = features(tok)
    assert_rows_equal(lora_model(tok, arch, attention.VARLEN), lora_model(tok, arch, "sdpa"), tok, feats[:3],
                      {"pg": pg_row_loss})
    lengths = [p + c for p, c in ROWS[:3]]
    assert calls and calls[0] == [0, *torch.tensor(lengths).cumsum(0).tolist()]


def test_packed_kwargs_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 0, 1, 2, 3]])
    kw = attention.packed_kwargs(pos)
    assert kw["cu_seq_lens_q"].tolist() == [0, 3, 4, 6, 10] and kw["cu_seq_lens_q"].dtype == torch.int32
    assert kw["max_length_q"] == 4 and kw["cu_seq_lens_k"] is kw["cu_seq_lens_q"]
    rows = attention.packed_kwargs(torch.arange(3).expand(2, 3))  # unpadded rows of a batch: one sequence each
    assert rows["cu_seq_lens_q"].tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="position_ids is empty"):
        attention.packed_kwargs(torch.zeros(1, 0, dtype=torch.long))


def test_collator_kwargs_and_position_ids_agree_boundaries_once_per_forward(tok, monkeypatch):
    """With cu_seq_lens in the batch the forward never derives boundaries; without,
    it derives them once per forward, not once per layer."""
    model = lora_model(tok, "llama", attention.VARLEN)
    batch = collate(features(tok), tok.pad_token_id, True)
    derived = []
    real = attention.packed_kwargs
    monkeypatch.setattr(attention, "packed_kwargs", lambda pos: derived.append(1) or real(pos))
    with torch.no_grad():
        from_positions = logprobs.completion_logprobs(model, batch)
        assert len(derived) == 1 and model.config.num_hidden_layers > 1
        given = {**batch, **real(batch["position_ids"])}
        derived.clear()
        from_kwargs = logprobs.completion_logprobs(model, given)
        assert derived == []
    torch.testing.assert_close(from_kwargs, from_positions, atol=0, rtol=0)


def test_boundaries_that_do_not_cover_the_batch_are_refused(tok):
    model = lora_model(tok, "qwen2", attention.VARLEN)
    batch = collate(features(tok), tok.pad_token_id, True)
    bad = {**batch, "cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32), "max_length_q": 5}
    with pytest.raises(ValueError, match="sequence boundaries cover 5 tokens, the batch has"):
        logprobs.completion_logprobs(model, bad)


@torch.no_grad()
def test_padded_batches_and_generation_take_sdpa(tok):
    """A padding mask or a KV cache is sdpa's job: same results as an sdpa model."""
    varlen = tiny.build_model(tok, "qwen2", seed=5)
    varlen.set_attn_implementation(attention.packed_attention("cpu").name)
    plain = tiny.build_model(tok, "qwen2", seed=5)
    batch = collate(features(tok), tok.pad_token_id, False)
    torch.testing.assert_close(logprobs.completion_logprobs(varlen, batch),
                               logprobs.completion_logprobs(plain, batch), atol=1e-6, rtol=0)
    prompt = torch.tensor([[7, 8, 9, 10, 11]])
    assert varlen.generate(prompt, max_new_tokens=6, do_sample=False).tolist() == \
        plain.generate(prompt, max_new_tokens=6, do_sample=False).tolist()


@torch.no_grad()
def test_self_check_passes_a_right_kernel_and_names_a_wrong_one():
    """The check the CUDA kernel must pass before a run uses it, here on stand-ins,
    under no_grad (its first use may come from a μ recomputation)."""
    cpu = torch.device("cpu")
    assert attention.self_check(cpu, kernel_2_11) is None
    assert attention.self_check(cpu, kernel_2_10) is None

    def leaks(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
              enable_gqa=False):
        whole = torch.tensor([0, query.shape[0]], dtype=torch.int32)
        return attention.per_sequence_attn(query, key, value, whole, whole, query.shape[0], query.shape[0],
                                           scale=scale, window_size=window_size, enable_gqa=enable_gqa)

    assert attention.self_check(cpu, leaks).startswith("varlen_attn failed its self-check: output off by")

    def cuda_only(*args, **kwargs):
        raise NotImplementedError("Could not run 'torch_attn::_varlen_attn' with arguments from the 'CPU' backend")

    cuda_only.__signature__ = __import__("inspect").signature(kernel_2_13)
    assert attention.self_check(cpu, cuda_only) == ("varlen_attn failed its self-check: NotImplementedError: Could "
                                                    "not run 'torch_attn::_varlen_attn' with arguments from the "
                                                    "'CPU' backend")


def test_choices_on_a_cpu():
    assert attention.packed_attention("cpu").why == "nightshift_varlen: sdpa per sequence on the cpu, no mask"
    assert attention.packed_attention("cpu", attention.VARLEN).name == attention.VARLEN
    eager = attention.packed_attention("cpu", "eager")
    assert (eager.name, eager.packed) == ("eager", True)
    assert attention.varlen_problem(torch.device("cpu")) == "torch's varlen_attn is CUDA-only"


# --- on a GPU (the lead runs these on the lent machine) ------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
GPU = torch.device("cuda")  # a name, so the bodies below can be rehearsed on a CPU with stand-in kernels


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


@pytest.mark.gpu
@cuda
def test_gpu_varlen_kernel_matches_sdpa():
    """torch's kernel through `call_varlen`, bf16, ragged GQA sequences (1 to 1500
    tokens): output and gradients no further from an fp32 computation than bf16
    sdpa on the same sequences (3x: KV heads repeated where the kernel has no
    enable_gqa add their gradients in bf16), plus 1e-2 of the largest value; a
    wrong layout or boundary is off by the size of the values themselves."""
    device = GPU
    problem = attention.varlen_problem(device, torch.bfloat16)
    assert problem is None, problem
    lengths = [1, 5, 37, 300, 1500, 64]
    g = torch.Generator(device=device).manual_seed(0)
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v = (torch.randn(t, h, 64, device=device, generator=g, dtype=torch.bfloat16) for h in (14, 2, 2))
    grad = torch.randn(t, 14, 64, device=device, generator=g, dtype=torch.bfloat16)

    def run(kernel, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = attention.call_varlen(*xs, cu, cu, max(lengths), max(lengths), scale=0.125, kernel=kernel)
        return [out, *torch.autograd.grad(out, xs, grad.to(dtype))]

    exact = run(attention.per_sequence_attn, torch.float32)
    ours = run(attention.torch_varlen(), torch.bfloat16)
    sdpa = run(attention.per_sequence_attn, torch.bfloat16)
    for name, o, s, e in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact):
        assert relative_error(o, e) <= 3 * relative_error(s, e) + 1e-2, name


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_packed_model_matches_rows_alone(tok, arch):
    """A bf16 LoRA model on the GPU, rows of 2 to 1500 tokens packed through the
    attention a GPU run picks (boundaries from the collator): log-probs and LoRA
    gradients of a per-token-weighted loss no further from fp32 rows-alone than
    bf16 sdpa rows-alone are (2x, plus 1e-2 of the largest value). The same pack
    with its boundaries erased (one sequence: attention leaks across rows) must
    land far outside that, or this test could not see a leak at all."""
    device = GPU
    choice = attention.packed_attention(device, dtype=torch.bfloat16)
    assert choice.name == attention.VARLEN and attention.varlen_problem(device, torch.bfloat16) is None, choice.why
    rows = [(1, 1), (4, 1), (30, 7), (250, 50), (1200, 300), (40, 24)]
    feats = features(tok, rows)

    def run(attn: str, dtype, packed: bool, leak: bool = False):
        m = lora_model(tok, arch, attn, hidden=256, heads=4, kv_heads=2).to(device, dtype)
        params = [p for p in m.parameters() if p.requires_grad]
        if packed:
            b = collate(feats, tok.pad_token_id, True)
            b.update(attention.packed_kwargs(b["position_ids"]))
            if leak:
                n = b["input_ids"].shape[1]
                b.update(cu_seq_lens_q=torch.tensor([0, n], dtype=torch.int32), max_length_q=n)
            batches = [b]
        else:
            batches = [collate([f], tok.pad_token_id, False) for f in feats]
        lp = torch.cat([logprobs.completion_logprobs(m, {k: v.to(device) if torch.is_tensor(v) else v
                                                         for k, v in b.items()}) for b in batches])
        loss = lp.mul(torch.linspace(-1, 1, lp.numel(), device=device)).sum()  # the same weights for every run
        return [lp, *torch.autograd.grad(loss, params)]

    exact = run("sdpa", torch.float32, False)
    errors = {name: [relative_error(o, e) for o, e in zip(out, exact)] for name, out in (
        ("ours", run(choice.name, torch.bfloat16, True)), ("sdpa", run("sdpa", torch.bfloat16, False)),
        ("leak", run(choice.name, torch.bfloat16, True, leak=True)))}
    for i, (o, s, leak) in enumerate(zip(errors["ours"], errors["sdpa"], errors["leak"])):
        what = "log-probs" if i == 0 else f"grad {i}"
        assert o <= 2 * s + 1e-2, f"{what}: {errors}"
        assert leak > 5 * max(o, s), f"{what}: a leak would not show: {errors}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("frozen", [True, False])
def test_gpu_chunked_head_memory(frozen):
    """A 0.5B-shaped head (896 x 151,936) on 4,096 completion tokens, frozen (LoRA)
    or training: the chunked path's extra peak is under a third of the plain
    path's (~7 GiB of [K, V] logits, their fp32 copies and gradients; the chunked
    path's is ~1.4 GiB training, the head's gradient included, ~0.6 GiB frozen),
    its log-probs and gradients the plain path's to bf16 precision."""
    device = GPU
    gen = torch.Generator(device=device).manual_seed(0)
    head = torch.nn.Linear(896, 151936, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(not frozen)
    hidden = torch.randn(4096, 896, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 151936, (4096,), device=device, generator=gen)
    weights = torch.randn(4096, device=device, generator=gen)

    def run(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp = fn()
        lp.mul(weights).sum().backward()
        torch.cuda.synchronize()
        grads = [t.grad for t in (hidden, head.weight) if t.grad is not None]
        hidden.grad = head.weight.grad = None
        return torch.cuda.max_memory_allocated() - base, lp.detach(), grads

    def plain():
        logits = head(hidden).float()
        return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)

    peak_plain, lp_plain, g_plain = run(plain)
    peak, lp, g = run(lambda: logprobs._chunked_logprobs(head, hidden, targets, 1.0, None))
    assert peak < peak_plain / 3, (peak, peak_plain)
    assert (lp - lp_plain).abs().max().item() < 0.05  # bf16 logits (an ulp is 0.016 at 3), fp32 from there
    for a, b in zip(g, g_plain):
        assert relative_error(a, b) < 2e-2
