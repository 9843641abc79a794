"""The trainer benchmark (benchmarks/train_gpu.py). On the CPU at tiny size it runs
every path the GPU run takes (rows drawn by token count and measured, each model's
runs in a child process, the trainer's defaults, TRL's peer, mu timed apart, the
memory cap flag), and its figures are printed, never asserted. What only a GPU run
reaches (the order runs go in, the caps, the time budget, the FLOPs convention) is
checked here on the script's own functions, so the lead's few GPU minutes are not
spent finding a typo."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("nightshift sft (defaults)", "nightshift pg (defaults)", "trl sft default")


def _bench():
    """benchmarks/train_gpu.py as a module (it is a script, not a package)."""
    if "train_gpu" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_gpu", ROOT / "benchmarks" / "train_gpu.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_gpu"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["train_gpu"]


def _cells(line: str) -> list[str]:
    # columns are two spaces apart at least (train_gpu.row_line); "1.2 GiB" is one cell
    return re.split(r"\s{2,}", line.strip())


def test_train_benchmark_runs_every_path_at_tiny_size(tmp_path):
    results = tmp_path / "results.jsonl"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_gpu.py"), "--tiny", "--steps", "4",
                        "--warmup", "1", "--memory-gib", "24", "--results", str(results)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "--memory-gib 24 is ignored on a CPU" in out
    # the rows' real token counts, rendered: near the asked-for mean prompt (6000 tokens at the tiny
    # scale; the template adds ~30), none past the longest allowed (16384 at that scale)
    scale = _bench().TINY_SCALE
    prompt = re.search(r"prompt\s+mean ([\d,]+)", out)
    total_max = re.search(r"total\s+mean [\d,]+, .* max ([\d,]+);", out)
    assert prompt and total_max, out
    assert 0.8 <= int(prompt[1].replace(",", "")) / (6000 / scale) <= 1.4, prompt[0]
    assert int(total_max[1].replace(",", "")) <= 16384 // scale, total_max[0]
    tps, steps = {}, {}
    for name in NAMES:
        # the first line per run: printed as it ended (the summary repeats it)
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"tiny   {name}"))
        model, run, _cap, tokens_s, _mfu, _mfu_meas, _peak, _reserved, n_steps, notes = _cells(line)
        assert (model, run) == ("tiny", name), line
        tps[name], steps[name] = float(tokens_s.replace(",", "")), int(n_steps)
        assert tps[name] > 0, line  # tokens/s measured
        if "pg" in name:
            assert re.search(r"mu: \d+ rows recomputed in [\d.]+ s", notes), line  # mu's cost, apart
    # every run did the steps asked (3 timed after 1 warm-up are still 4 steps), and the
    # printed ratios are those of the printed figures, not figures of their own
    assert set(steps.values()) == {4}, steps
    for run in ("sft", "pg"):
        ratio = float(out.split(f"nightshift {run} / trl defaults, tokens/s:")[1].split("x")[0])
        assert ratio == pytest.approx(tps[f"nightshift {run} (defaults)"] / tps["trl sft default"], abs=0.011)
    assert "CPU, tiny model" in out and "not judged on a CPU" in out
    # each run's raw result survives as it ends (a GPU run cut short keeps what finished)
    raw = [json.loads(x) for x in results.read_text().splitlines()]
    assert [(r["name"], r["status"]) for r in raw] == [(n, "ok") for n in NAMES], raw


def _args(**kw) -> argparse.Namespace:
    base = dict(models="0.5b,1.5b,7b", runs="sft,pg,trl", steps=0, warmup=-1, memory_gib="auto", eval=False,
                tokens_per_step=None, max_length=None, batch_size=None, checkpointing=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_gpu_runs_go_headline_first_one_process_each_7b_capped_at_40_gib(tmp_path):
    bench = _bench()
    longest = {"0.5b": 16000, "1.5b": 16000, "7b": 16000}
    jobs = bench.plan_tasks(_args(), tmp_path, longest, gpu=True)
    assert all(len(j) == 1 for j in jobs)  # one process a run: an OOM costs that run only
    order = [(j[0].shape, j[0].run, j[0].cap_gib) for j in jobs]
    assert order == [("0.5b", "sft", 0), ("1.5b", "sft", 0), ("7b", "sft", 40), ("0.5b", "pg", 0), ("1.5b", "pg", 0),
                     ("7b", "pg", 40), ("0.5b", "trl", 0), ("1.5b", "trl", 0), ("7b", "trl", 0)]
    assert [j[0].build for j in jobs] == [True, True, True] + [False] * 6  # each model built once, by its first run
    assert [j[0].matmul for j in jobs] == [True] + [False] * 8
    assert [j[0].steps for j in jobs[:3]] == [12, 12, 8] and all(j[0].name.endswith("(defaults)") for j in jobs[:6])
    # a cap list repeats each of our runs per cap; TRL's peer is never capped
    caps = bench.plan_tasks(_args(models="7b", memory_gib="24,48,80"), tmp_path, longest, gpu=True)
    assert [(j[0].run, j[0].cap_gib) for j in caps] == [("sft", 24), ("sft", 48), ("sft", 80), ("pg", 24), ("pg", 48),
                                                        ("pg", 80), ("trl", 0)]
    # settings given on the command line are the run's name, not "defaults"
    named = bench.plan_tasks(_args(models="7b", runs="sft", max_length=8192), tmp_path, longest, gpu=True)
    assert named[0][0].name == "nightshift sft (max_length=8192)"


def test_a_run_the_budget_cannot_hold_is_estimated_from_those_measured(tmp_path):
    bench = _bench()
    jobs = [j[0] for j in bench.plan_tasks(_args(), tmp_path, {m: 16000 for m in ("0.5b", "1.5b", "7b")}, gpu=True)]
    by = {(t.shape, t.run): t for t in jobs}
    assert bench.estimate_s(by["0.5b", "sft"], []) is None  # nothing measured: nothing skipped blindly
    done = [{"task": {"shape": "0.5b", "run": "sft", "steps": 12}, "status": "ok", "wall_s": 40.0, "build_s": 10.0,
             "params": list(bench.shape_params("0.5b"))}]
    assert bench.estimate_s(by["0.5b", "pg"], done) == pytest.approx(30.0 * 1.4)  # the build is not a run's cost
    # another model: scaled by body parameters and steps (7b runs 8), plus writing its weights once
    est = bench.estimate_s(by["7b", "sft"], done)
    body7, body05 = bench.shape_params("7b")[0], bench.shape_params("0.5b")[0]
    assert est == pytest.approx(30.0 * body7 / body05 * 8 / 12 + 4 * body7 / 1e9)


def test_flops_convention_reproduces_the_public_7b_lora_figure():
    """NeMo AutoModel's Qwen2.5-7B LoRA row (../shared/gpu/README.md): 14,110 tokens/s on
    packed 4096-token rows, loss at every position, is 423 TFLOP/s. Ours at the same
    rate must agree, so "45 % of 989" means what the public figures mean."""
    bench = _bench()
    rows = bench.Rows(n=2, prompt=[0, 0], completion=[4096, 4096])  # loss at every position
    tflops = 14_110 * bench.flops_per_token(list(bench.shape_params("7b")), rows) / 1e12
    assert tflops == pytest.approx(423, rel=0.05)


def test_body_parameters_from_the_config_are_those_of_the_model():
    bench = _bench()
    from nightshift.trainer.tiny import build_model, build_tokenizer

    tok = build_tokenizer()
    s = bench.SHAPES["tiny"]
    model = build_model(tok, "qwen2", hidden=s["hidden"], layers=s["layers"], heads=s["heads"], kv_heads=s["kv_heads"],
                        intermediate=s["intermediate"])
    assert bench.body_params(model) == bench.shape_params("tiny", len(tok))
    # the published non-embedding counts (Qwen2.5 model cards: 0.36B, 1.31B, 6.53B)
    assert [round(bench.shape_params(m)[0] / 1e9, 2) for m in ("0.5b", "1.5b", "7b")] == [0.36, 1.31, 6.53]


class _FakeCuda:
    """Just the CUDA memory calls smaller_card makes, on a card with `free` of `total`
    bytes free: allocations reserve in 2 MiB blocks, like the caching allocator."""

    def __init__(self, free: int, total: int):
        self.free, self.total, self.reserved, self.fraction = free, total, 0, 1.0

    def mem_get_info(self, device=None):
        return self.free, self.total

    def memory_allocated(self, device=None):
        return self.reserved

    def memory_reserved(self, device=None):
        return self.reserved

    def set_per_process_memory_fraction(self, fraction, device=None):
        self.fraction = fraction

    def take(self, n: int) -> object:
        n = -(-n // (2 << 20)) * (2 << 20)
        self.reserved += n
        self.free -= n
        return object()


@pytest.mark.parametrize("free_gib,cap_gib", [(139.0, 40.0), (79.0, 24.0), (30.0, 40.0)])
def test_a_memory_cap_makes_the_card_look_that_small_to_the_plan_and_the_allocator(monkeypatch, free_gib, cap_gib):
    import torch

    bench, gib = _bench(), 1 << 30
    fake = _FakeCuda(int(free_gib * gib), int(140 * gib))
    for name in ("mem_get_info", "memory_allocated", "memory_reserved", "set_per_process_memory_fraction"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda n, dtype=None, device=None: fake.take(n) if device == "cuda"
                        else real_empty(n, dtype=dtype))
    ballast = bench.smaller_card(cap_gib)
    if free_gib <= cap_gib:  # a card no bigger than the cap: left as it is
        assert ballast is None and fake.fraction == pytest.approx(cap_gib / 140)
        return
    # what the memory plan reads (cudaMemGetInfo) is the small card's free memory, within a block
    assert fake.free == pytest.approx(cap_gib * gib, abs=2 << 20) and ballast.free_after == fake.free
    # the allocator may go cap_gib beyond the ballast, no further; the ballast is left out of the peaks
    assert fake.fraction * fake.total == pytest.approx(ballast.reserved + cap_gib * gib)
    assert ballast.reserved == ballast.allocated == fake.reserved


@pytest.mark.gpu
def test_a_memory_cap_on_a_real_gpu_stops_the_run_at_the_cap():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    bench, gib = _bench(), 1 << 30
    torch.cuda.empty_cache()
    ballast = bench.smaller_card(4.0)
    try:
        assert ballast is not None
        assert torch.cuda.mem_get_info()[0] == pytest.approx(4 * gib, abs=64 << 20)
        fits = torch.empty(3 * gib, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(2 * gib, dtype=torch.uint8, device="cuda")  # 3 + 2 > 4 GiB
        del fits
    finally:
        del ballast
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
