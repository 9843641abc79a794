#!/usr/bin/env python
"""Kernel self-check: packed attention and the LM head's log-probs, each option
timed forward + backward on one packed micro-batch, with its peak GPU memory and
how far its log-probs are from the reference option's.

    python benchmarks/gpu_kernels.py            # one GPU, a 0.5B-shaped model, under a minute
    python benchmarks/gpu_kernels.py --tiny     # CPU: the tiny model, every code path, no figures

Attention, on a Qwen2.5-0.5B-shaped model (random weights, bf16, LoRA r16 on every
linear layer: the trainer's default shape of work) and one micro-batch of
--tokens tokens in rows of --min-len to --max-len tokens (uniform), the last 15 %
of each row its completion; every option runs the same chunked LM head:
  varlen             nightshift_varlen on torch's varlen_attn (what a GPU run picks)
  per-sequence sdpa  nightshift_varlen on sdpa once per sequence (the fallback)
  sdpa packed mask   sdpa with transformers' block-diagonal mask from position_ids
  sdpa padded        rows padded to the longest, with an attention mask
  flex_attention     transformers' BlockMask from position_ids (compiles first)
LM head, on --head-tokens completion positions of that shape (896 x 151,936),
gradients to the hidden states (LoRA: the head is frozen):
  plain              [K, V] logits, fp32 log-softmax (logits_to_keep, before issue 25)
  chunked jacobian   trainer/logprobs.py with a frozen head (LoRA, what runs): each
                     token's gradient vector computed with its log-prob, no recompute
  chunked recompute  trainer/logprobs.py with a head that trains: chunks recomputed in
                     backward (timed here with the head frozen, as the others)
  trl chunked        TRL's ChunkedLogProbFunction (vocabulary tiles, Triton fold)
Each option runs in its own try/except: a failure is a line of the table, not the
end of the report. tokens/s counts real tokens (no padding); Δlogp is the largest
difference of an option's log-probs from the first option that ran.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from harness import GIB, log  # noqa: E402

#: Qwen2.5-0.5B's config (tied embeddings); "tiny" for the CPU smoke run.
SHAPES = {
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=0),
}


def parse_args(argv: list[str] | None = None):
    ap = harness.parser(__doc__, seed=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU: every code path, not a figure")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens in the packed micro-batch")
    ap.add_argument("--min-len", type=int, default=200, help="shortest row")
    ap.add_argument("--max-len", type=int, default=6000, help="longest row")
    ap.add_argument("--head-tokens", type=int, default=4096, help="completion positions for the LM-head options")
    ap.add_argument("--repeats", type=int, default=3, help="timed forward+backward passes per option (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=55.0,
                    help="skip the options left when this much time has gone (not with --tiny)")
    ap.add_argument("--no-flex", action="store_true", help="leave flex_attention out (its compile takes the longest)")
    args = ap.parse_args(argv)
    import torch

    if args.tiny or not torch.cuda.is_available():
        if not args.tiny:
            log("no GPU: the tiny model on the CPU (a smoke check of every path, not a figure)")
        args.tiny = True
        args.tokens, args.min_len, args.max_len = min(args.tokens, 1024), 20, 300
        args.head_tokens, args.repeats = min(args.head_tokens, 256), 1
        args.budget_s = float("inf")
        torch.set_num_threads(1)  # tiny tensors: threads only fight other processes
    return args


def rows(args, vocab: int) -> list[dict]:
    """Rows of --min-len..--max-len tokens filling --tokens, completions the last 15 %."""
    import random

    rng = random.Random(args.seed)
    out, total = [], 0
    while total < args.tokens:
        n = min(rng.randint(args.min_len, args.max_len), args.tokens - total)
        n = max(n, 2)
        out.append({"input_ids": [rng.randrange(5, vocab) for _ in range(n)],
                    "completion_start": max(1, n - max(1, n * 15 // 100)), "advantage": 1.0, "weight": 1.0})
        total += n
    return out


def build_model(args, device, dtype):
    import torch
    from peft import LoraConfig, get_peft_model

    from nightshift.trainer import tiny

    shape = SHAPES["tiny" if args.tiny else "0.5b"]
    tok = tiny.build_tokenizer()
    vocab = shape["vocab"] or len(tok)
    with torch.device(device):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(args.seed)
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["kv_heads"], max_position_embeddings=32768,
                          tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).to(dtype)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    return model, vocab


def timed(fn: Callable[[], object], repeats: int, device) -> tuple[float, float, object]:
    """(seconds per call after one warm-up, peak bytes above the start, first result)."""
    import torch

    cuda = device.type == "cuda"
    first = fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if cuda:
        torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / repeats
    peak = torch.cuda.max_memory_allocated() - base if cuda else float("nan")
    return per, peak, first


def attention_options(args, model, feats, device) -> list[tuple[str, Callable[[], tuple[str, dict, object]]]]:
    """(label, setup) pairs; setup returns (attn_implementation, batch, kernel override or None)."""
    from nightshift.trainer import attention
    from nightshift.trainer.loop import collate

    def packed(with_bounds: bool) -> dict:
        b = collate(feats, 0, True)
        if with_bounds:
            b.update(attention.packed_kwargs(b["position_ids"]))
        return b

    opts = [
        ("varlen", lambda: (attention.VARLEN, packed(True), "torch")),
        ("per-sequence sdpa", lambda: (attention.VARLEN, packed(True), attention.per_sequence_attn)),
        ("sdpa packed mask", lambda: ("sdpa", packed(False), None)),
        ("sdpa padded", lambda: ("sdpa", collate(feats, 0, False), None)),
    ]
    if not args.no_flex:  # last, and printed on its own: its compile is the one thing that may run long
        opts.append(("flex_attention", lambda: ("flex_attention", packed(False), None)))
    return opts


def run_attention(args, report, device, dtype) -> None:
    import torch

    from nightshift.trainer import attention, logprobs

    model, vocab = build_model(args, device, dtype)
    feats = rows(args, vocab)
    tokens = sum(len(f["input_ids"]) for f in feats)
    lengths = sorted(len(f["input_ids"]) for f in feats)
    report.say(f"attention: {len(feats)} rows, {tokens:,} tokens ({lengths[0]}..{lengths[-1]}), "
               f"{sum(len(f['input_ids']) - f['completion_start'] for f in feats):,} completion tokens; "
               f"varlen self-check: {attention.varlen_problem(device, dtype) or 'passed'}")
    attention.register()
    params = [p for p in model.parameters() if p.requires_grad]
    lines, reference = [], None
    real_kernel = attention.varlen_kernel
    for label, setup in attention_options(args, model, feats, device):
        if label == "flex_attention":  # what ran so far is out before flex_attention compiles
            report.extend(harness.table(lines, COLUMNS, align="<>>>><"))
            report.print()
            report.lines.clear()
            lines = []
        if time.perf_counter() - START > args.budget_s:
            lines.append([label, "", "", "", "", "skipped: out of time"])
            continue
        log(label)
        try:
            impl, batch, kernel = setup()
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if kernel == "torch":
                problem = attention.varlen_problem(device, dtype)
                if problem:
                    raise RuntimeError(problem)
                attention.varlen_kernel = lambda d: attention.torch_varlen()
            elif kernel is not None:
                attention.varlen_kernel = lambda d, k=kernel: k
            model.set_attn_implementation(impl)

            def step():
                lp = logprobs.completion_logprobs(model, batch)
                grads = torch.autograd.grad(lp.float().mean(), params)
                del grads
                return lp.detach().float()

            per, peak, lp = timed(step, args.repeats, device)
            if reference is None:
                reference = lp
            delta = (lp - reference).abs().max().item()
            lines.append([label, f"{tokens / per:,.0f}", f"{per * 1000:,.1f}",
                          "n/a" if peak != peak else f"{peak / GIB:.2f}", f"{delta:.3g}", ""])
        except Exception as e:  # noqa: BLE001 - one option's failure is one line
            lines.append([label, "", "", "", "", failure(e)])
        finally:
            attention.varlen_kernel = real_kernel
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.extend(harness.table(lines, COLUMNS, align="<>>>><"))
    del model


def run_head(args, report, device, dtype) -> None:
    import torch

    from nightshift.trainer import logprobs

    hidden_size, vocab = (64, 512) if args.tiny else (896, 151_936)
    k = args.head_tokens
    gen = torch.Generator(device=device).manual_seed(args.seed)
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device, dtype=dtype).requires_grad_(False)
    hidden = torch.randn(k, hidden_size, device=device, dtype=dtype, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (k,), device=device, generator=gen)

    def plain():
        logits = head(hidden).float()
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)

    def trl_chunked():
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction.apply(hidden, head.weight, None, targets, 1.0, 32768, None, 1.0, ())[0]

    report.say(f"LM head: {k:,} completion positions x {vocab:,} vocabulary, hidden {hidden_size}, "
               f"{str(dtype).removeprefix('torch.')}, gradient to the hidden states")
    lines, reference = [], None
    def ours(method: str):
        return lambda: logprobs._chunked_logprobs(head, hidden, targets, 1.0, None, method=method)

    for label, fn in (("plain", plain), ("chunked jacobian", ours("jacobian")),
                      ("chunked recompute", ours("checkpoint")), ("trl chunked", trl_chunked)):
        if time.perf_counter() - START > args.budget_s:
            lines.append([label, "", "", "", "", "skipped: out of time"])
            continue
        log(label)
        try:
            def step(fn=fn):
                lp = fn()
                (g,) = torch.autograd.grad(lp.sum(), hidden)
                del g
                return lp.detach().float()

            per, peak, lp = timed(step, args.repeats, device)
            if reference is None:
                reference = lp
            lines.append([label, f"{k / per:,.0f}", f"{per * 1000:,.2f}",
                          "n/a" if peak != peak else f"{peak / GIB:.2f}", f"{(lp - reference).abs().max().item():.3g}",
                          ""])
        except Exception as e:  # noqa: BLE001 - one option's failure is one line
            lines.append([label, "", "", "", "", failure(e)])
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report.extend(harness.table(lines, COLUMNS, align="<>>>><"))


COLUMNS = ["option", "tokens/s", "ms/pass", "peak GiB", "Δlogp", "note"]


def failure(e: BaseException) -> str:
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"FAILED: {type(e).__name__}: {first}"


START = time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    global START
    START = time.perf_counter()
    args = parse_args(argv)
    import inspect

    import torch
    from importlib.metadata import version

    gpu = not args.tiny
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    report = harness.Report()
    report.extend(harness.header("nightshift kernels self-check", args, versions=(
        f"torch {torch.__version__}", *(f"{p} {version(p)}" for p in ("transformers", "trl", "peft"))),
        busy_seconds=0.5))
    try:
        from torch.nn.attention.varlen import varlen_attn

        sig = "(" + ", ".join(inspect.signature(varlen_attn).parameters) + ")"
    except ImportError:
        sig = ": none in this torch"
    report.say(f"device: {torch.cuda.get_device_name(0) if gpu else 'CPU'}; {str(dtype).removeprefix('torch.')}; "
               f"varlen_attn{sig}")
    for part in (run_head, run_attention):  # the head first: seconds; flex_attention's compile comes last
        try:
            part(args, report, device, dtype)
        except Exception as e:  # noqa: BLE001 - the other part still reports
            report.say(f"{part.__name__}: FAILED: {type(e).__name__}: {e}")
        report.print()  # each part's lines as soon as it ends: a timeout later keeps them
        report.lines.clear()
    print(f"({time.perf_counter() - START:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
