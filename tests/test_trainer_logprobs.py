"""Completion log-probs without full-vocabulary logits (trainer/logprobs.py) equal
the plain computation (the head over every kept position, [K, V] logits, then
log-softmax), values and gradients, on tiny Qwen2 and Llama models; keep no
[K, V] tensor for backward; work through DDP; and give evaluation its exact KL.

Each holds for both paths of the head: ours ("auto" on a CPU: the frozen head's
gradient taken in the forward, a trained head's chunks recomputed) and TRL's
fused one ("fused", what "auto" picks on CUDA with Triton). On a CPU the fused
path folds its tiles with TRL's torch fallback instead of its Triton kernel; the
wiring tested here (the head's weight read inside the forward, tied embeddings,
temperature, gradients to the head, DDP) is the same. Its vocabulary tiles are
made small (`small_tiles`) so a tiny vocabulary spans several of them.

Tolerances: fp32 on a CPU, the same matmuls in other groupings: values within
1e-5 absolute (log-probs are O(1-10)), gradients within 1e-4 relative + 1e-6.
"""

from __future__ import annotations

import math
import socket

import pytest
import torch

from nightshift.trainer import logprobs, tiny
from nightshift.trainer.loop import collate

LENGTHS = [(5, 3), (12, 7), (1, 1), (30, 9)]  # (prompt, completion) tokens per row


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


def features(tok, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, c in lengths:
        ids = torch.randint(5, len(tok), (p + c,), generator=g).tolist()
        out.append({"input_ids": ids, "completion_start": p, "advantage": 1.0, "weight": 1.0})
    return out


def plain_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Today's path: logits at every kept position, [K, V] in fp32, log-softmax."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), logits_to_keep=batch["logit_index"], use_cache=False)
    logits = out.logits[batch["tok_row"], batch["tok_col"]].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch["targets"][:, None]).squeeze(-1)


def model_for(tok, arch: str, kind: str):
    """kind: lora (grads on the adapter), full (tied head = embeddings), untied (a head of its own)."""
    m = tiny.build_model(tok, arch, seed=1)
    if kind == "untied":
        cfg = m.config
        cfg.tie_word_embeddings = False
        torch.manual_seed(2)
        m = type(m)(cfg)
        assert m.lm_head.weight is not m.model.embed_tokens.weight
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
        for n, p in m.named_parameters():  # B starts at zero: make the adapter matter
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
    return m


METHODS = ["auto", "fused"]


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(logprobs, "FUSED_VOCAB_CHUNK", 100)  # 512 tokens: 6 tiles, the last partial


def grads_of(model, logp: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    g = torch.autograd.grad((logp * weights).sum(), list(params.values()), allow_unused=True)
    return {n: x for n, x in zip(params, g) if x is not None}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("kind", ["lora", "full", "untied"])
def test_chunked_equals_plain_values_and_grads(tok, arch, kind, method, small_tiles):
    model = model_for(tok, arch, kind)
    feats = features(tok)
    for packed in (True, False):
        batch = collate(feats, tok.pad_token_id, packed)
        weights = torch.linspace(-1.0, 2.0, batch["targets"].numel())  # pg's per-token weights, signs mixed
        for temperature in (1.0, 0.7):
            want = plain_logprobs(model, batch, temperature)
            got = logprobs.completion_logprobs(model, batch, temperature=temperature, chunk_tokens=3, method=method)
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            g_want, g_got = grads_of(model, want, weights), grads_of(model, got, weights)
            assert g_got.keys() == g_want.keys() and g_got
            for name in g_want:
                torch.testing.assert_close(g_got[name], g_want[name], rtol=1e-4, atol=1e-6, msg=name)
    if kind == "lora":
        assert any("lora_B" in n for n in g_got)
    else:  # full fine-tuning: the head's gradient reaches its weight (the embeddings, when tied)
        head = "model.embed_tokens.weight" if kind == "full" else "lm_head.weight"
        assert g_got[head].abs().sum() > 0


@pytest.mark.parametrize("method", METHODS)
def test_no_grad_path_equals_and_default_chunk(tok, method, small_tiles):
    """μ is recomputed under no_grad (no checkpointing then); the default chunk
    (LOGIT_CHUNK_ELEMENTS / vocabulary) covers a tiny vocabulary in one piece."""
    model = model_for(tok, "qwen2", "full")
    batch = collate(features(tok), tok.pad_token_id, True)
    want = plain_logprobs(model, batch, 0.5)
    with torch.no_grad():
        got = logprobs.completion_logprobs(model, batch, temperature=0.5, method=method)
    assert not got.requires_grad
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)


def saved_for_backward(fn) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_no_vocabulary_sized_tensor_kept_for_backward(tok, kind, method, small_tiles):
    """What backward keeps: the plain path holds the [K, V] logits (the check sees
    them); the chunked path not even one chunk of them, whether the head is
    frozen (LoRA: each token's gradient vector kept) or trains (recomputed)."""
    model = model_for(tok, "qwen2", kind)
    batch = collate(features(tok), tok.pad_token_id, True)
    vocab, k = model.config.vocab_size, batch["targets"].numel()

    def logit_rows(shapes):  # rows of vocabulary-wide tensors, all of them together
        return sum(s[0] if len(s) == 2 else 1 for s in shapes if s and s[-1] == vocab)

    assert logit_rows(saved_for_backward(lambda: plain_logprobs(model, batch))) >= k
    assert logit_rows(saved_for_backward(
        lambda: logprobs.completion_logprobs(model, batch, chunk_tokens=4, method=method))) == 0


@pytest.mark.parametrize("kind, calls_per_chunk", [("lora", 1), ("full", 2)])
def test_frozen_head_is_not_recomputed(tok, kind, calls_per_chunk):
    """A frozen head runs once per chunk (its gradient comes with the forward); a
    head that trains runs again in backward."""
    model = model_for(tok, "llama", kind)
    head = model.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    try:
        batch = collate(features(tok), tok.pad_token_id, True)
        logprobs.completion_logprobs(model, batch, chunk_tokens=8).sum().backward()
    finally:
        handle.remove()
    k = batch["targets"].numel()
    assert sum(calls) == calls_per_chunk * k and len(calls) == calls_per_chunk * math.ceil(k / 8)


@pytest.mark.parametrize("method", METHODS)
def test_empty_completion_backpropagates_zero(tok, method):
    model = model_for(tok, "qwen2", "lora")
    feats = [{"input_ids": [5, 6, 7], "completion_start": 3, "advantage": 1.0, "weight": 1.0}]
    batch = collate(feats, tok.pad_token_id, True)
    logp = logprobs.completion_logprobs(model, batch, method=method)
    assert logp.shape == (0,)
    logp.sum().backward()  # an all-empty micro-batch must not break the step


def test_head_restored_and_clear_errors(tok):
    model = model_for(tok, "llama", "lora")
    head = model.get_output_embeddings()
    batch = collate(features(tok), tok.pad_token_id, True)
    with pytest.raises(ValueError, match="chunk_tokens must be at least 1"):
        logprobs.completion_logprobs(model, batch, chunk_tokens=0)
    assert model.get_output_embeddings() is head  # put back even when the forward failed
    capped = tiny.build_model(tok, "qwen2")
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        logprobs.completion_logprobs(capped, batch)


def exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    p, q = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref_logits.float(), -1)
    return (p.exp() * (p - q)).sum(-1)


def all_logits(model, batch) -> torch.Tensor:
    out = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                position_ids=batch.get("position_ids"), logits_to_keep=batch["logit_index"], use_cache=False)
    return out.logits[batch["tok_row"], batch["tok_col"]]


@torch.no_grad()
def test_kl_to_a_reference_model_and_to_the_adapter_off(tok):
    policy = model_for(tok, "qwen2", "lora")
    other = tiny.build_model(tok, "qwen2", seed=7)
    for packed in (True, False):
        batch = collate(features(tok), tok.pad_token_id, packed)
        logits = all_logits(policy, batch)
        logp, kl = logprobs.completion_logprobs_and_kl(
            policy, batch, lambda b: logprobs.completion_states(other, b), chunk_tokens=3)
        torch.testing.assert_close(logp, plain_logprobs(policy, batch), atol=1e-5, rtol=0)
        torch.testing.assert_close(kl, exact_kl(logits, all_logits(other, batch)), atol=1e-5, rtol=1e-4)
        assert (kl > 0).all()
        _, kl_off = logprobs.completion_logprobs_and_kl(policy, batch, logprobs.adapter_off(policy))
        with policy.disable_adapter():
            base_logits = all_logits(policy, batch)
        torch.testing.assert_close(kl_off, exact_kl(logits, base_logits), atol=1e-5, rtol=1e-4)
        assert kl_off.max() > 1e-6  # the adapter moved the policy: the KL sees it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", METHODS)
def test_through_ddp_gradients_arrive(tok, method, small_tiles):
    """A 1-process gloo group: the forward enters DDP's __call__ and DDP's reducer
    all-reduces the gradient of every parameter, the head's and the embeddings'
    included (its communication hook counts them), each of two steps; the
    gradients equal the unwrapped model's (the fused path reads the head's weight
    directly: from inside the forward, so the reducer still sees it)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plain = model_for(tok, "llama", "untied")
        wrapped = model_for(tok, "llama", "untied")
        ddp = DistributedDataParallel(wrapped)
        reduced: list[int] = []

        def count(state, bucket):
            reduced.append(bucket.buffer().numel())
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, count)
        batch = collate(features(tok), tok.pad_token_id, True)
        weights = torch.linspace(-1.0, 1.0, batch["targets"].numel())
        (plain_lp := logprobs.completion_logprobs(plain, batch, chunk_tokens=5)).mul(weights).sum().backward()
        every = sum(p.numel() for p in wrapped.parameters())
        for _ in range(2):
            wrapped.zero_grad()
            reduced.clear()
            lp = logprobs.completion_logprobs(ddp, batch, chunk_tokens=5, method=method)
            lp.mul(weights).sum().backward()
            assert sum(reduced) == every
        torch.testing.assert_close(lp, plain_lp, atol=1e-5, rtol=0)
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
            assert q.grad is not None, name
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        assert wrapped.lm_head.weight.grad.abs().sum() > 0
        assert isinstance(wrapped.lm_head, torch.nn.Linear)  # the swap is undone
    finally:
        dist.destroy_process_group()


@torch.no_grad()
def test_kl_after_accelerate_wrapped_the_forward(tok):
    """After training under mixed precision, accelerate has wrapped the model's
    forward (autocast inside, outputs made fp32): the completion states come back
    fp32 while the head is bf16. The exact KL must still run, outside any autocast,
    and agree with the log-probs the wrapped forward gives (on the lent H200 it
    failed with 'expected mat1 and mat2 to have the same dtype'). bf16 on a CPU:
    the same bf16 matmuls either way, 2e-2 absolute on log-probs of O(1-10)."""
    from types import MethodType

    from accelerate.utils import convert_outputs_to_fp32

    policy = model_for(tok, "qwen2", "lora").to(torch.bfloat16)
    wrapped = torch.autocast("cpu", dtype=torch.bfloat16)(policy.forward.__func__)
    policy.forward = MethodType(convert_outputs_to_fp32(wrapped), policy)
    batch = collate(features(tok), tok.pad_token_id, True)
    states = logprobs.completion_states(policy, batch)
    assert states.hidden.dtype == torch.bfloat16
    logp, kl = logprobs.completion_logprobs_and_kl(policy, batch, logprobs.adapter_off(policy))
    torch.testing.assert_close(logp, logprobs.completion_logprobs(policy, batch), atol=2e-2, rtol=0)
    assert torch.isfinite(kl).all() and kl.max() > 0


def test_auto_takes_the_fused_head_only_where_it_may_read_the_weight(tok, monkeypatch):
    """"auto" picks TRL's fused head where its Triton fold runs (CUDA; pretended
    here) and the head is a plain Linear nothing hooks into; a LoRA on the head or
    a hook (accelerate's, FSDP's) keeps ours, which calls the head module."""
    from peft import LoraConfig, get_peft_model

    assert not logprobs.fused_available(torch.device("cpu")) and logprobs.head_kind(torch.device("cpu")) == "chunked"
    monkeypatch.setattr(logprobs, "fused_available", lambda device: True)
    used: list[str] = []
    real = logprobs._fused_logprobs
    monkeypatch.setattr(logprobs, "_fused_logprobs", lambda *a: used.append("fused") or real(*a))
    batch = collate(features(tok), tok.pad_token_id, True)
    plain = model_for(tok, "qwen2", "lora")
    logprobs.completion_logprobs(plain, batch)
    assert used == ["fused"]
    hooked = model_for(tok, "qwen2", "lora")
    handle = hooked.get_output_embeddings().register_forward_hook(lambda *a: None)
    logprobs.completion_logprobs(hooked, batch)
    handle.remove()
    lora_head = get_peft_model(tiny.build_model(tok, "qwen2", seed=1),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], lora_dropout=0.0))
    got = logprobs.completion_logprobs(lora_head, batch)
    assert used == ["fused"]  # neither of the last two
    torch.testing.assert_close(got, plain_logprobs(lora_head, batch), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no head method 'triton'"):
        logprobs.completion_logprobs(plain, batch, method="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fused_head_equals_ours(tok, monkeypatch):
    """On the device: "auto" runs TRL's fused head with its Triton fold (where
    Triton is installed) and agrees with ours ("jacobian") in bf16 on values, and
    its adapter gradients are as close to the same model's fp32 gradients as ours
    are. A direct bf16-vs-bf16 comparison of gradients failed on the lent H100
    (a lora_A of layer 0 beyond 5e-2 relative) though both heads only differ in
    where bf16 rounds: which one is off is only told by an fp32 reference."""
    import copy

    device = torch.device("cuda")
    used: list[int] = []
    real = logprobs._fused_logprobs
    monkeypatch.setattr(logprobs, "_fused_logprobs", lambda *a: used.append(1) or real(*a))
    fp32 = model_for(tok, "qwen2", "lora").to(device)
    model = copy.deepcopy(fp32).to(torch.bfloat16)
    batch = {k: v.to(device) for k, v in collate(features(tok), tok.pad_token_id, True).items()}
    weights = torch.linspace(-1.0, 2.0, batch["targets"].numel(), device=device)
    auto = logprobs.completion_logprobs(model, batch, temperature=0.7)
    assert bool(used) == logprobs.fused_available(device) == (logprobs.head_kind(device) == "fused")
    ours = logprobs.completion_logprobs(model, batch, temperature=0.7, method="jacobian")
    torch.testing.assert_close(auto, ours, atol=2e-2, rtol=0)
    g_auto, g_ours = grads_of(model, auto, weights), grads_of(model, ours, weights)
    ref = logprobs.completion_logprobs(fp32, batch, temperature=0.7, method="jacobian")
    g_ref = grads_of(fp32, ref, weights)
    worst = []
    for name in g_ours:
        scale = g_ref[name].abs().max().item() + 1e-6
        e_auto = (g_auto[name].float() - g_ref[name]).abs().max().item() / scale
        e_ours = (g_ours[name].float() - g_ref[name]).abs().max().item() / scale
        worst.append((e_auto - e_ours, name, e_auto, e_ours))
    worst.sort(reverse=True)
    for d, name, e_auto, e_ours in worst[:5]:
        print(f"{name}: fused {e_auto:.4f}, ours {e_ours:.4f} of the fp32 gradient's largest entry")
    for _, name, e_auto, e_ours in worst:
        assert e_auto <= max(2 * e_ours, 2e-2), (name, e_auto, e_ours)
