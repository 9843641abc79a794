"""The memory estimator against what was measured, and the plan it makes.

(a) Every row of the H200 table in ../shared/gpu/README.md (commit b853c89),
    reconstructed: the benchmark's own row generator and tokenizer give each row's
    real token counts; HF's length-grouped sampler (or TRL's random one) gives the
    batches; the estimator must land within 15 % of torch.cuda.max_memory_allocated.
(b) A tiny Qwen2 LoRA model's real allocations on this CPU (every tensor an op
    creates, tracked until freed), at a few sizes and checkpointing settings.
(c) The plans for Qwen2.5-7B and its smaller kin on 24, 40 and 80 GiB cards.
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest

from nightshift.trainer.memory import (
    ALLOCATOR_OVERHEAD, EFFICIENT_TOKENS, GIB, MemoryPlanError, ModelShape, checkpoint_flags, estimate,
    estimate_peak, plan, shrink,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 151_936


def qwen(name: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, *,
         tied: bool = True) -> ModelShape:
    return ModelShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
                      intermediate=intermediate, vocab=VOCAB, tied=tied, max_positions=32768, qkv_bias=True,
                      name=name)


# Qwen2.5-7B's published shape (the issue); the table's 7B rows were built like the
# benchmark's other shapes, by trainer/tiny.py with tied embeddings.
QWEN_7B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944)


# --- (a) the measured table -------------------------------------------------------------------------------

#: ../shared/gpu/README.md: (shape, run, rows per batch, checkpointing, peak GiB). Every
#: run: bf16, sdpa, padded batches, LoRA r16 all-linear, 30 steps. pg and sft grouped
#: by length; TRL's defaults sample at random. pg keeps logits from the first
#: completion position on (`kept`); TRL 1.16's SFTTrainer uses its fused head.
TABLE = [
    ("0.5b", "pg", 16, "off", 55.5),
    ("0.5b", "sft", 16, "off", 47.4),
    ("0.5b", "trl", 8, "full", 3.2),
    ("1.5b", "pg", 16, "off", 104.6),
    ("1.5b", "sft", 16, "off", 97.3),
    ("1.5b", "trl", 8, "full", 6.9),
    ("1.5b", "pg", 8, "off", 54.2),
    ("1.5b", "sft", 8, "off", 50.1),
    ("7b", "pg", 8, "off", 118.0),
    ("7b", "pg", 8, "full", 21.9),
]
TOLERANCE = 0.15


#: benchmarks/train_gpu.py at b853c89, the commit the table measured: its words and
#: its `text` and `write_rows` (the benchmark has since moved to agent-length rows),
#: kept here verbatim in what they compute so the table's rows can be rebuilt.
WORDS_B853C89 = ("the agent calls a tool to look up the answer and then replies with a short summary of what it "
                 "found weather city temperature capital country population calculator expression result").split()
SHAPES_B853C89 = {
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960),
}


def _rows_b853c89(n: int = 2000, prompt_tokens: int = 768, completion_tokens: int = 192, seed: int = 0):
    """(user text, answer text) of each row `write_rows` wrote with the table's
    defaults (--rows 2000, prompt 768, completion 192, ±50 %, seed 0)."""
    import random

    rng = random.Random(seed)

    def text(n_tokens: int) -> str:
        return " ".join(rng.choice(WORDS_B853C89) for _ in range(max(1, n_tokens // 2)))

    out = []
    for i in range(n):
        p = int(prompt_tokens * rng.uniform(0.5, 1.5))
        c = int(completion_tokens * rng.uniform(0.5, 1.5))
        q = f"task {i % (n // 4 or 1)}"
        rng.random()  # the row's reward
        user = q + ": " + text(p)
        out.append((user, text(c)))
    return out


@pytest.fixture(scope="module")
def table_rows():
    """(prompt, completion) token counts of the 2000 rows the table's runs trained
    on, rendered by the tiny offline tokenizer with the chat template as the
    trainer renders them. Rendering 2000 rows takes seconds, so the template's
    tokens are counted on one row and every row's two texts are tokenized in one
    batch; 20 rows rendered in full check that the sum is exact."""
    sys.path.insert(0, str(ROOT / "tests"))
    from transitions_data import msg, row

    from nightshift.trainer.render import render
    from nightshift.trainer.tiny import build_tokenizer

    texts = _rows_b853c89()
    tok = build_tokenizer()
    n_user = [len(x) for x in tok([u for u, _ in texts], add_special_tokens=False)["input_ids"]]
    n_answer = [len(x) for x in tok([a for _, a in texts], add_special_tokens=False)["input_ids"]]

    def rendered(i: int):
        user, answer = texts[i]
        return render(tok, row([msg("system", "You are a careful agent."), msg("user", user)], answer, 1.0))

    first = rendered(0)
    extra_p, extra_c = len(first.prompt_ids) - n_user[0], len(first.completion_ids) - n_answer[0]
    lengths = [(u + extra_p, a + extra_c) for u, a in zip(n_user, n_answer)]
    for i in range(1, 21):
        r = rendered(i)
        assert (len(r.prompt_ids), len(r.completion_ids)) == lengths[i]
    return lengths


def _batches(lengths, rows: int, grouped: bool, steps: int = 30) -> list[list[int]]:
    """The first `steps` batches: HF's LengthGroupedSampler (megabatches of 50 x rows
    sorted by length, the longest row first) or a random permutation (TRL's
    defaults). The table's run drew from the global RNG; the peak batch hardly
    depends on the draw (the longest row always comes first), so one seed stands
    for it."""
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    total = [p + c for p, c in lengths]
    gen = torch.Generator().manual_seed(0)
    order = (get_length_grouped_indices(total, rows, generator=gen) if grouped
             else torch.randperm(len(total), generator=gen).tolist())
    return [order[i:i + rows] for i in range(0, steps * rows, rows)]


def _table_estimate(shape: ModelShape, run: str, rows: int, checkpointing: str, lengths) -> int:
    """The largest estimate over the run's batches: padded to the longest row, the
    mask dense (sdpa with padding), logits at completion positions (pg: every row
    from the batch's first completion position on) or TRL's fused head."""
    worst = 0
    for batch in _batches(lengths, rows, grouped=run != "trl"):
        width = max(sum(lengths[i]) for i in batch)
        completions = sum(lengths[i][1] for i in batch)
        first = min(lengths[i][0] for i in batch)
        worst = max(worst, estimate_peak(
            shape, micro_batch_tokens=sum(sum(lengths[i]) for i in batch), rows=len(batch), width=width,
            lora_r=16, dtype_bytes=2, checkpointing=checkpointing, attention="sdpa_mask",
            head="kept" if run == "pg" else "fused", logits_positions=completions,
            logits_region=len(batch) * (width - first)))
    return worst


def test_every_row_of_the_measured_h200_table_within_15_percent(table_rows):
    shapes = {name: qwen(name, **s) for name, s in SHAPES_B853C89.items()}
    shapes["7b"] = qwen("7b", **QWEN_7B)
    report, errors = [], []
    for name, run, rows, ck, measured in TABLE:
        est = _table_estimate(shapes[name], run, rows, ck, table_rows) / GIB
        err = est / measured - 1
        report.append(f"{name:5} {run:4} {rows:2} rows, checkpointing {ck:4}: measured {measured:6.1f} GiB, "
                      f"estimated {est:6.1f} GiB ({err:+.1%})")
        errors.append(abs(err))
    print("\n".join(report))
    assert max(errors) <= TOLERANCE, "\n".join(report)


def test_the_table_rows_are_not_matched_by_a_flat_guess(table_rows):
    """The estimate's agreement comes from its terms: leave out the head a run really
    had, or the mask, or the checkpointing, and rows fall outside the tolerance."""
    shape = qwen("1.5b", hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960)
    pg = _table_estimate(shape, "pg", 16, "off", table_rows) / GIB
    sft = _table_estimate(shape, "sft", 16, "off", table_rows) / GIB
    assert pg / 104.6 - 1 <= TOLERANCE and abs(sft / 97.3 - 1) <= TOLERANCE
    assert abs(sft / 104.6 - 1) > 0.05  # pg's kept logits are what the pg row measured beyond sft
    no_mask = estimate_peak(shape, micro_batch_tokens=16 * 1862, rows=16, width=1862, attention="sdpa",
                            head="fused", logits_positions=5300) / GIB
    assert no_mask < sft * 0.97  # the dense mask is ~3 % of that row: not noise, and not the bulk


# --- (b) a tiny model's allocations on this CPU ------------------------------------------------------------

@pytest.fixture
def one_thread():
    """These tiny steps run on one thread: on a shared 2-core machine, intra-op
    threads spin-wait for each other and cost 10x the CPU time of the work."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Allocations:
    """Every tensor storage an op creates while active, counted until it is freed
    (storages that existed before, weights and optimizer state, are known and left
    out): the CPU's stand-in for torch.cuda.max_memory_allocated."""

    def __init__(self, known):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        outer = self
        self.known = {id(t.untyped_storage()) for t in known}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        outer._add(t.untyped_storage())
                return out

        self.mode = Mode()

    def _add(self, storage) -> None:
        key = id(storage)
        if key in self.known or key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


def _measure_tiny(tokens: int, *, rows: int = 1, padded: bool = False, checkpointing: str = "off",
                  checkpoint_layers: int | None = None, bf16: bool = False) -> tuple[int, int]:
    """(measured peak, estimate) of a training step (forward, backward, AdamW with
    its moments) of a 4-layer Qwen2 with LoRA r8 on every linear layer."""
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model

    from nightshift.trainer.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    base = build_model(tok, "qwen2", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
                       max_positions=4096)
    shape = ModelShape.from_config(base.config)
    if bf16:
        base = base.to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    flags = checkpoint_flags(shape.layers, checkpointing, checkpoint_layers)
    if any(flags):
        base.activation_checkpointing_enable()
        for layer, on in zip(base.model.layers, flags):
            layer.gradient_checkpointing = on
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, len(tok) - 8, (rows, tokens // rows), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, ids.shape[1] // 2:] = 0
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:  # AdamW's moments exist from the first step on: make them without a step
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    before = [*model.parameters(), *model.buffers(), *state]
    track = _Allocations(before)
    with track.mode:
        with autocast:
            out = model(input_ids=ids, attention_mask=mask if padded else None, labels=ids, use_cache=False)
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad()
    static = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in before}.values())
    est = estimate_peak(shape, micro_batch_tokens=ids.numel(), rows=rows if padded else 1,
                        width=ids.shape[1] if padded else 0, lora_r=8, dtype_bytes=2 if bf16 else 4,
                        checkpointing=checkpointing, checkpoint_layers=checkpoint_layers,
                        attention="sdpa_mask" if padded else "sdpa", head="full")
    return static + track.peak, est


#: The allocator factor does not apply (these are allocations, not reservations); the
#: CPU kernels' scratch buffers are not op outputs, and a tiny model's fixed costs
#: (the loss, RoPE tables) weigh more than on a 7B: 10 %.
CPU_TOLERANCE = 0.10


@pytest.mark.parametrize("case", [
    dict(tokens=1024),
    dict(tokens=1024, checkpointing="full"),
    dict(tokens=1024, checkpointing="selective", checkpoint_layers=2),
    dict(tokens=1024, rows=4, padded=True),
    dict(tokens=512, bf16=True),
], ids=["packed", "full-checkpointing", "selective-2-of-4", "padded-mask", "bf16-autocast"])
def test_estimate_matches_a_tiny_models_measured_allocations_on_cpu(case, one_thread):
    measured, est = _measure_tiny(**case)
    print(f"{case}: measured {measured / 2**20:.2f} MiB, estimated {est / 2**20:.2f} MiB "
          f"({est / measured - 1:+.1%})")
    assert abs(est / measured - 1) <= CPU_TOLERANCE, (case, measured, est)


# --- the shape from a config -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_shape_from_config_counts_the_real_models_parameters(arch, one_thread):
    from peft import LoraConfig, get_peft_model

    from nightshift.trainer.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(), arch, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    shape = ModelShape.from_config(model.config)
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate) == \
        (64, 2, 4, 2, 16, 96)
    assert shape.tied and shape.max_positions == 2048 and shape.qkv_bias == (arch == "qwen2")
    assert shape.params() == sum(p.numel() for p in model.parameters())
    peft = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
    assert shape.lora_params(8) == sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_a_config_without_a_transformer_shape_is_a_clear_error():
    class Config:
        hidden_size = 64
        num_hidden_layers = 2
        num_attention_heads = 4

    with pytest.raises(MemoryPlanError, match="no intermediate_size, vocab_size"):
        ModelShape.from_config(Config())


def test_unknown_settings_are_clear_errors():
    shape = qwen("0.5b", **SHAPES_B853C89["0.5b"])
    for kw, word in ((dict(attention="eager"), "attention"), (dict(head="liger"), "head"),
                     (dict(checkpointing="some"), "checkpointing")):
        with pytest.raises(MemoryPlanError, match=word):
            estimate_peak(shape, micro_batch_tokens=1024, **kw)
    with pytest.raises(MemoryPlanError, match="checkpointing"):
        plan(shape, tokens_per_step=65536, checkpointing="sometimes")
    with pytest.raises(MemoryPlanError, match="tokens_per_step"):
        plan(shape, tokens_per_step=0)



def test_grouped_kv_heads_repeated_or_not():
    """k and v are kept at their own width by a kernel that reads grouped heads, at
    every query head's width where they are repeated (sdpa with a mask; a
    varlen_attn without enable_gqa): the difference is exactly that."""
    from nightshift.trainer.memory import layer_bytes_per_token

    shape = qwen("7b", **QWEN_7B)
    grouped = layer_bytes_per_token(shape, attention="varlen", repeat_kv=False)
    repeated = layer_bytes_per_token(shape, attention="varlen", repeat_kv=True)
    assert repeated - grouped == 2 * 2 * (shape.q_width - shape.kv_width)
    assert layer_bytes_per_token(shape, attention="sdpa") == grouped
    assert layer_bytes_per_token(shape, attention="sdpa_mask", width=0) == repeated

# --- (c) the plan --------------------------------------------------------------------------------------------

QWEN_7B_REAL = ModelShape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                          vocab=152_064, tied=False, max_positions=32768, qkv_bias=True, name="Qwen2.5-7B")
#: Agent rows: ~6k prompt + 400 completion tokens, a tail to 16k.
AGENT = dict(longest_row=16384, completion_share=400 / 6400)


def card(gib: float, fraction: float = 0.9) -> dict:
    """What `device_budget` gives on a card of `gib` GiB with ~0.5 GiB taken by the CUDA context."""
    free = int((gib - 0.5) * GIB)
    return dict(available_bytes=int(free * fraction), free_bytes=free, memory_fraction=fraction)


def _fits(p) -> bool:
    return p.estimated_gib * ALLOCATOR_OVERHEAD <= p.available_gib


def test_qwen_7b_lora_plans_fit_80_40_and_24_gib_and_choose_sensibly():
    plans = {gib: plan(QWEN_7B_REAL, tokens_per_step=65536, **AGENT, **card(gib)) for gib in (80, 40, 24)}
    for gib, p in plans.items():
        print(gib, p.line())
        assert _fits(p)
        assert p.micro_batch_tokens % 1024 == 0 and p.micro_batch_tokens >= min(p.max_length, 16384)
        assert p.tokens_per_step == 65536 and 0 <= p.micro_batch_tokens * p.grad_accum - 65536 < p.micro_batch_tokens
    big, mid, small = plans[80], plans[40], plans[24]
    # 16k-token rows need checkpointing on a 7B; the bigger card recomputes fewer layers
    assert big.checkpointing == "selective" and 0 < big.checkpointed_layers < mid.checkpointed_layers
    assert big.micro_batch_tokens >= EFFICIENT_TOKENS and mid.micro_batch_tokens >= EFFICIENT_TOKENS
    assert big.max_length == mid.max_length == 32768 and not big.notes and not mid.notes
    # 24 GiB: the weights take 14 GiB, so the longest rows no longer fit: max_length
    # comes down (and says so), still above an agent call's ~6.4k tokens
    assert small.checkpointing == "full" and 6400 < small.max_length < 16384
    assert "max_length lowered" in small.line()
    # each plan is the cheapest that fits: one layer fewer checkpointed would not
    for p in (big, mid):
        fewer = estimate_peak(QWEN_7B_REAL, micro_batch_tokens=p.micro_batch_tokens, checkpointing="selective",
                              checkpoint_layers=p.checkpointed_layers - 1,
                              logits_positions=round(p.micro_batch_tokens * AGENT["completion_share"]))
        assert fewer * ALLOCATOR_OVERHEAD > p.available_gib * GIB


def test_without_checkpointing_at_8k_tokens_rather_than_checkpointing_at_more():
    """0.5B on an 80 GiB card with rows up to 8k: no checkpointing at the largest
    micro-batch that fits, though checkpointing would fit the whole step at once."""
    shape = qwen("0.5b", **SHAPES_B853C89["0.5b"])
    p = plan(shape, tokens_per_step=262144, longest_row=8192, **card(80))
    assert p.checkpointing == "off" and EFFICIENT_TOKENS <= p.micro_batch_tokens < 262144
    full = estimate_peak(shape, micro_batch_tokens=262144, checkpointing="full")
    assert full * ALLOCATOR_OVERHEAD < card(80)["available_bytes"]  # the bigger micro-batch was on offer
    # below 8k without checkpointing, it checkpoints some layers to reach 8k
    tight = plan(shape, tokens_per_step=65536, longest_row=2048, **card(6))
    off = estimate_peak(shape, micro_batch_tokens=EFFICIENT_TOKENS)
    assert off * ALLOCATOR_OVERHEAD > card(6)["available_bytes"]
    assert tight.checkpointing in ("selective", "full") and tight.micro_batch_tokens >= EFFICIENT_TOKENS


def test_checkpointing_asked_for_is_honoured():
    for asked, want in (("off", "off"), ("on", "full"), ("full", "full")):
        p = plan(QWEN_7B_REAL, tokens_per_step=65536, checkpointing=asked, **AGENT, **card(80))
        assert p.checkpointing == want and _fits(p)
    off = plan(QWEN_7B_REAL, tokens_per_step=65536, checkpointing="off", **AGENT, **card(80))
    assert off.max_length < 16384 and "max_length lowered" in off.notes[0]  # a 16k row needs checkpointing
    sel = plan(QWEN_7B_REAL, tokens_per_step=65536, checkpointing="selective", **AGENT, **card(80))
    assert sel.checkpointing == "selective"


def test_a_model_that_cannot_fit_is_a_clear_error():
    with pytest.raises(MemoryPlanError,
                       match=r"does not fit in the 13.9 GiB available: its weights and training state take 14.8 GiB"):
        plan(QWEN_7B_REAL, tokens_per_step=65536, **card(16))


def test_on_a_cpu_there_is_no_limit_and_no_checkpointing():
    p = plan(QWEN_7B_REAL, tokens_per_step=65536, max_length_wanted=4096)
    assert (p.checkpointing, p.micro_batch_tokens, p.grad_accum, p.max_length) == ("off", 65536, 1, 4096)
    assert p.line().endswith("no device limit (CPU)")


def test_max_length_beyond_the_model_is_capped_and_said():
    p = plan(QWEN_7B_REAL, tokens_per_step=65536, max_length_wanted=100_000)
    assert p.max_length == 32768 and "beyond the model's 32,768 positions" in p.line()


def test_the_plan_line():
    p = plan(QWEN_7B_REAL, tokens_per_step=65536, **AGENT, **card(80))
    line = p.line()
    assert line.startswith(f"memory plan: micro-batch {p.micro_batch_tokens:,} tokens x {p.grad_accum} "
                           f"accumulation = {p.tokens_per_step:,} tokens/step, checkpointing selective "
                           f"({p.checkpointed_layers} of 28 layers), max_length 32,768, estimated ")
    assert line.endswith(f"GiB available (0.9 of {79.5:.1f} free)")
    flags = p.layer_flags()
    assert len(flags) == 28 and sum(flags) == p.checkpointed_layers


def test_a_step_smaller_or_not_a_multiple_of_the_micro_batch_is_said_as_it_runs():
    """The micro-batch is a budget: a 256-token step runs as one micro-batch of 256
    tokens, and the line said "1,024 tokens/step"; a 100,000-token step in budgets
    of 16,384 takes 7 micro-batches, and the line said 6 (round)."""
    tiny = plan(QWEN_7B_REAL, tokens_per_step=256, max_length_wanted=200)
    assert tiny.micro_batch_tokens == 1024 and tiny.tokens_per_step == 256 and tiny.grad_accum == 1
    assert tiny.line().startswith("memory plan: micro-batch up to 1,024 tokens x 1 accumulation for 256 tokens/step,")
    assert "1,024 tokens/step" not in tiny.line()
    odd = plan(QWEN_7B_REAL, tokens_per_step=100_000, longest_row=16384, **card(80))
    assert odd.grad_accum == -(-100_000 // odd.micro_batch_tokens)
    assert f"x {odd.grad_accum} accumulation for 100,000 tokens/step" in odd.line()


def test_device_budget_honours_the_process_memory_fraction(monkeypatch):
    """A process capped with torch.cuda.set_per_process_memory_fraction cannot reserve
    more than fraction x total (less what it holds), however much the card has free:
    the plan must be made for that, not for the card (a fake CUDA: mem_get_info,
    the fraction and the reserved bytes are what torch would report)."""
    import torch

    from nightshift.trainer.memory import device_budget

    state = {"fraction": 40 / 140}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"],
                        raising=False)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * GIB)
    available, free = device_budget(0.9, torch.device("cuda", 0))
    assert free == 38 * GIB and available == int(38 * GIB * 0.9)  # 40 GiB allowed, 2 held: not 100 free
    state["fraction"] = 1.0  # no cap: the card's free memory, as before
    assert device_budget(0.9, torch.device("cuda", 0)) == (int(100 * GIB * 0.9), 100 * GIB)
    state["fraction"] = 0.9  # a cap above what is free changes nothing
    assert device_budget(0.5, torch.device("cuda", 0))[1] == 100 * GIB


def test_checkpoint_flags_spread_evenly():
    assert checkpoint_flags(4, "selective", 2) == [False, True, False, True]
    assert checkpoint_flags(28, "selective", 7).count(True) == 7
    assert checkpoint_flags(3, "full") == [True] * 3 and checkpoint_flags(3, "off") == [False] * 3


def test_shrink_halves_then_checkpoints_more_then_halves_to_one_row_then_gives_up():
    shape = qwen("0.5b", **SHAPES_B853C89["0.5b"])
    p = plan(shape, tokens_per_step=65536, max_length_wanted=4096, **card(80))
    assert p.checkpointing == "off" and p.micro_batch_tokens > EFFICIENT_TOKENS
    seen = [p]
    while True:
        try:
            seen.append(shrink(seen[-1]))
        except MemoryPlanError as e:
            assert "nothing left to shrink" in str(e)
            break
        assert len(seen) < 40
    micro = [s.micro_batch_tokens for s in seen]
    layers = [s.checkpointed_layers for s in seen]
    assert all(a >= b for a, b in zip(micro, micro[1:])) and all(a <= b for a, b in zip(layers, layers[1:]))
    assert all(s.tokens_per_step == 65536 and 0 <= s.micro_batch_tokens * s.grad_accum - 65536 < s.micro_batch_tokens
               for s in seen)  # accumulation keeps the step whole
    first_ck = layers.index(next(k for k in layers if k > 0))
    assert micro[first_ck] == EFFICIENT_TOKENS  # halved to 8k before any layer is checkpointed
    assert seen[-1].checkpointing == "full" and seen[-1].micro_batch_tokens == 4096
    # the floor is the longest row the plan was made for, not max_length
    rows_3k = plan(shape, tokens_per_step=65536, longest_row=3000, checkpointing="on", **card(80))
    assert rows_3k.max_length == 32768
    while rows_3k.micro_batch_tokens > 3072:
        rows_3k = shrink(rows_3k)
    with pytest.raises(MemoryPlanError, match="as small as the longest row \\(3,000 tokens\\)"):
        shrink(rows_3k)
    assert "out of memory at micro-batch" in seen[1].notes[-1] and "retried with" in seen[1].notes[-1]
    assert seen[0].notes == []  # pure: the plan shrunk is left as it was



# --- on a GPU (the lead runs these on the lent machine) ----------------------------------------------------

def _gpu_case(shape: ModelShape, lengths: list[int], checkpoint_layers: int, completion: int = 400):
    """Train steps of a randomly initialized model of `shape` (bf16, LoRA r16 all-linear,
    autocast as accelerate sets it, AdamW) on one-sequence micro-batches of `lengths`
    tokens, the last `completion` of each through the chunked completion-only head:
    (max allocated, max reserved, the estimate for the longest)."""
    import gc

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nightshift.trainer.logprobs import completion_logprobs

    gc.collect()  # what an earlier case or test left cached would count as this one's reserve
    torch.cuda.empty_cache()
    device = torch.device("cuda")
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         tie_word_embeddings=shape.tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            base = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    assert ModelShape.from_config(base.config).params() == sum(p.numel() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    flags = checkpoint_flags(shape.layers, "selective", checkpoint_layers)
    if any(flags):
        base.activation_checkpointing_enable()
        for layer, on in zip(base.model.layers, flags):
            layer.gradient_checkpointing = on
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step(n: int) -> None:
        ids = torch.randint(0, shape.vocab, (1, n), device=device)
        k = min(completion, n - 1)
        batch = {"input_ids": ids, "position_ids": torch.arange(n, device=device)[None],
                 "logit_index": torch.arange(n - k - 1, n - 1, device=device),
                 "tok_row": torch.zeros(k, dtype=torch.long, device=device),
                 "tok_col": torch.arange(k, device=device), "targets": ids[0, n - k:]}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = -completion_logprobs(model, batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1024)  # AdamW's moments, cuBLAS's workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for n in lengths:
        step(n)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    ck = "off" if checkpoint_layers == 0 else "full" if checkpoint_layers >= shape.layers else "selective"
    from nightshift.trainer.logprobs import head_kind

    est = estimate_peak(shape, micro_batch_tokens=max(lengths), lora_r=16, dtype_bytes=2, checkpointing=ck,
                        checkpoint_layers=checkpoint_layers, attention="sdpa", head=head_kind(device),
                        logits_positions=completion)
    return allocated, reserved, est


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,layers_checkpointed", [("0.5b", 0), ("7b", "plan")])
def test_gpu_estimate_and_allocator_overhead_on_the_new_path(name, layers_checkpointed):
    """The plan's own configuration on the device: one-sequence micro-batches of 9k
    to 16k tokens (the allocator meets several shapes), no mask (flash kernel, as
    varlen: q, k, v, output and logsumexp kept, grouped KV heads not repeated),
    completion-only chunked head. max_memory_allocated within 15 % of the estimate
    (as the table), and max_memory_reserved within the estimate plus
    ALLOCATOR_OVERHEAD, the share the plan keeps for the allocator. The 7B case
    runs what plan() chooses for 16k-token rows on a 60 GiB budget. The figures go
    to $OUT/memory_gpu.txt when the run has an $OUT."""
    import os

    shape = qwen("7b", **QWEN_7B, tied=False) if name == "7b" else qwen(name, **SHAPES_B853C89[name])
    k = layers_checkpointed
    if k == "plan":
        p = plan(shape, tokens_per_step=65536, longest_row=16384, completion_share=400 / 16384, **card(60))
        assert p.micro_batch_tokens == 16384, p.line()
        k = p.checkpointed_layers
    allocated, reserved, est = _gpu_case(shape, [16384, 12288, 9000], k)
    line = (f"{name} {k}/{shape.layers} layers checkpointed, 16,384 tokens: allocated {allocated / GIB:.2f} GiB, "
            f"estimated {est / GIB:.2f} GiB ({est / allocated - 1:+.1%}), reserved {reserved / GIB:.2f} GiB "
            f"(reserved/allocated {reserved / allocated:.3f}, reserved/estimate {reserved / est:.3f})")
    print(line)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "memory_gpu.txt", "a") as f:
            f.write(line + "\n")
    assert abs(est / allocated - 1) <= TOLERANCE, line
    assert reserved <= est * ALLOCATOR_OVERHEAD, line


def test_head_chunk_matches_the_chunked_head():
    from nightshift.trainer import logprobs
    from nightshift.trainer.memory import HEAD_CHUNK_ELEMENTS

    assert HEAD_CHUNK_ELEMENTS == logprobs.LOGIT_CHUNK_ELEMENTS


@pytest.mark.parametrize("full_finetune", [False, True], ids=["lora", "full-finetune"])
def test_estimate_matches_measured_allocations_with_the_chunked_head_on_cpu(full_finetune, one_thread):
    """The new path's head (trainer/logprobs.py: completion positions only, a chunk
    of logits at a time) on a 32k vocabulary, where it outweighs the layers, in bf16
    under autocast as on a GPU: a frozen head (LoRA) takes its gradient in the
    forward, a trained one (full fine-tuning) recomputes chunks in backward."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nightshift.trainer.logprobs import completion_logprobs

    shape = ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=32768,
                       max_positions=4096, qkv_bias=True)
    config = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=shape.max_positions,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    if not full_finetune:
        model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear", lora_dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    n, k = 2048, 400
    ids = torch.randint(0, shape.vocab, (1, n), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(n)[None], "logit_index": torch.arange(n - k - 1, n - 1),
             "tok_row": torch.zeros(k, dtype=torch.long), "tok_col": torch.arange(k), "targets": ids[0, n - k:]}
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    before = [*model.parameters(), *model.buffers(), *state]
    track = _Allocations(before)
    with track.mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = -completion_logprobs(model, batch).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    measured = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in before}.values()) + track.peak
    est = estimate(shape, micro_batch_tokens=n, full_finetune=full_finetune, dtype_bytes=2, attention="sdpa",
                   head="chunked", logits_positions=k)
    print(f"chunked head, {'full fine-tuning' if full_finetune else 'LoRA'}: measured {measured / 2**20:.1f} MiB, "
          f"estimated {est.total / 2**20:.1f} MiB ({est.total / measured - 1:+.1%})")
    assert est.head > est.activations  # the head is what this case measures
    assert abs(est.total / measured - 1) <= CPU_TOLERANCE, (measured, est)
