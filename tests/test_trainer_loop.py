"""The shared loop (trainer/loop.py) on a tiny model: a step cut into micro-batches
has the gradient of the step taken at once (sft: the token mean over the step;
pg: the rows' weighted mean), an out-of-memory error is survived with the same
gradient, and each rank's share of a step carries the whole step's counts.

Tolerances: fp32 on a CPU, the same sums in another order: gradients agree to
~1e-6 relative; 1e-4 (the team's gradient tolerance) leaves room, while a wrong
normalization (a mean per micro-batch) is off by tens of percent here, where
micro-batches hold different numbers of rows and tokens."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from nightshift.trainer.config import TrainConfig
from nightshift.trainer.plan import work_out

RTOL, ATOL = 1e-4, 1e-7


def _features(tok, n: int = 7) -> list[dict]:
    """Rows of different prompt and completion lengths, advantages of both signs."""
    out = []
    for i in range(n):
        prompt = tok(f"user: what is {i} + {i}? " + "please " * (i % 4))["input_ids"]
        answer = tok(f"The answer is {2 * i}." + " Checked." * (i % 3))["input_ids"]
        out.append({"input_ids": prompt + answer, "completion_start": len(prompt),
                    "advantage": (-1.0) ** i * (0.5 + 0.1 * i), "weight": 1.0 + 0.25 * (i % 2)})
    return out


def _trainer(tmp_path: Path, tiny_model: Path, objective, micro_tokens: int, rows_per_step: int = 7,
             device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nightshift.trainer.loop import make_trainer, training_args

    cfg = TrainConfig(base_model=str(tiny_model), output=str(tmp_path / "out"), batch_size=rows_per_step,
                      max_steps=1, tensorboard=False, precision="fp32")
    plan = work_out(cfg)
    plan = dataclasses.replace(plan, device=torch.device(device),  # the comparison is about sums, not devices
                               memory=dataclasses.replace(plan.memory, micro_batch_tokens=micro_tokens))
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=plan.attention)
    rows = _features(tok)
    args = {**training_args(cfg, plan, tmp_path / "run", progress=False), "use_cpu": device == "cpu"}
    trainer = make_trainer(cfg, plan, model, tok, rows, args, [], objective)
    return trainer, model, rows, tok


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _whole_step(model, rows, tok, objective, plan_packed: bool = True) -> dict[str, torch.Tensor]:
    """The step's gradient taken at once: every row in one batch, the loss summed and
    divided by the step's rows or completion tokens."""
    from nightshift.trainer.logprobs import completion_logprobs
    from nightshift.trainer.loop import collate

    model.zero_grad(set_to_none=True)
    batch = collate(rows, tok.pad_token_id, plan_packed)
    part, _ = objective.loss(completion_logprobs(model, batch), batch)
    count = len(rows) if objective.per == "row" else sum(len(r["input_ids"]) - r["completion_start"] for r in rows)
    (part / count).backward()
    return _grads(model)


def _objectives():
    from nightshift.trainer.algorithms import pg, sft
    from nightshift.trainer.loop import Objective

    return {"sft": Objective(sft.nll, per="token"), "pg": pg.objective(pg.PGSettings(clip="none"))}


@pytest.mark.parametrize("name", ["sft", "pg"])
def test_a_step_in_micro_batches_has_the_gradient_of_the_whole_step(tmp_path, tiny_model, name):
    objective = _objectives()[name]
    trainer, model, rows, tok = _trainer(tmp_path, tiny_model, objective, micro_tokens=48)
    step = trainer.train_dataset[0]
    micro = trainer._fit(step.micro)  # cut to the plan's micro-batch, as the step runs
    assert step.rows == len(rows) and len(micro) >= 3  # one step, several micro-batches
    assert len({len(mb) for mb in micro}) > 1  # of different numbers of rows (and tokens)
    model.zero_grad(set_to_none=True)
    loss = trainer.training_step(model, step)
    got = _grads(model)
    want = _whole_step(model, rows, tok, objective)
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=k)
    assert math.isfinite(float(loss))


def test_an_out_of_memory_micro_batch_is_split_and_the_step_redone_with_the_same_gradient(tmp_path, tiny_model,
                                                                                         monkeypatch, caplog):
    from nightshift.trainer import loop

    objective = _objectives()["sft"]
    trainer, model, rows, tok = _trainer(tmp_path, tiny_model, objective, micro_tokens=1024)
    step = trainer.train_dataset[0]
    assert len(step.micro) == 1  # all in one micro-batch: the one to split
    model.zero_grad(set_to_none=True)
    trainer.training_step(model, step)
    unsplit = _grads(model)

    real, calls = loop.completion_logprobs, []

    def first_forward_runs_out(m, batch, **kw):
        calls.append(int(batch["input_ids"].numel()))
        if len(calls) == 2:  # the second micro-batch's forward, after the first one's backward
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(m, batch, **kw)

    monkeypatch.setattr(loop, "completion_logprobs", first_forward_runs_out)
    trainer.budget = 10**6  # the original plan for one micro-batch ...
    step.micro = [rows[:3], rows[3:]]  # ... but two, so partial gradients exist when the second fails
    model.zero_grad(set_to_none=True)
    with caplog.at_level("WARNING", logger="nightshift.trainer"):
        trainer.training_step(model, step)
    retried = _grads(model)
    # redone from the first micro-batch, the failing one split: every row once more, in more forwards
    assert len(calls) >= 2 + 3, calls
    assert calls[2] == calls[0] and sum(calls[2:]) == sum(len(r["input_ids"]) for r in rows)
    for k in unsplit:
        torch.testing.assert_close(retried[k], unsplit[k], rtol=RTOL, atol=ATOL, msg=k)
    assert len(trainer.retries) == 1 and "out of memory in step 1" in trainer.retries[0]
    assert "split in two and the step redone" in caplog.text
    # and the rest of the run plans with less: more layers checkpointed (this micro-batch
    # is at the plan's floor already), the model told so
    assert trainer.memory.checkpointed_layers > trainer.plan.memory.checkpointed_layers
    assert "the rest of the run: memory plan:" in trainer.retries[0]


def test_one_row_that_runs_out_of_memory_with_nothing_left_to_shrink_is_a_sentence(tmp_path, tiny_model,
                                                                                   monkeypatch):
    from nightshift.trainer import loop
    from nightshift.trainer.memory import MemoryPlanError

    trainer, model, rows, _ = _trainer(tmp_path, tiny_model, _objectives()["sft"], micro_tokens=1024)
    step = trainer.train_dataset[0]
    step.micro = [rows[:1]]

    def always(*a, **kw):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(loop, "completion_logprobs", always)
    with pytest.raises(MemoryPlanError, match=r"out of memory in step 1 .*in 1 row\(s\).*nothing left to shrink"):
        trainer.training_step(model, step)


def test_each_rank_gets_its_share_of_a_step_and_the_whole_steps_counts(tiny_model):
    from transformers import AutoTokenizer

    from nightshift.trainer.loop import Steps

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = _features(tok, 24)
    plan = work_out(TrainConfig(base_model=str(tiny_model), batch_size=0, tokens_per_step=300))
    plan = dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, micro_batch_tokens=64))
    one = Steps(rows, plan, seed=3)
    ranks = [Steps(rows, dataclasses.replace(plan, world_size=2, rank=r), seed=3) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) > 1
    seen = []
    for a, b in zip(ranks[0].steps, ranks[1].steps):
        assert len(a.micro) == len(b.micro) >= 1
        mine = [id(f) for mb in a.micro + b.micro for f in mb]
        assert (a.rows, a.completion_tokens, a.tokens) == (b.rows, b.completion_tokens, b.tokens) == \
            (len(mine), sum(len(f["input_ids"]) - f["completion_start"] for mb in a.micro + b.micro for f in mb),
             sum(len(f["input_ids"]) for mb in a.micro + b.micro for f in mb))
        seen += mine
    assert sorted(seen) == sorted(id(f) for f in rows)  # every row once, over both ranks
    assert sum(s.tokens for s in one.steps) == sum(len(f["input_ids"]) for f in rows)
    assert all(s.tokens <= 300 + 64 for s in one.steps[:-1])  # about tokens_per_step each


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_out_of_memory_is_survived_with_the_same_gradient(tmp_path, tiny_model, monkeypatch):
    """On the device: the allocator's own OutOfMemoryError (a 32 TiB request in the
    second micro-batch's forward), caught, the cache emptied, the step redone on the
    GPU. fp32 on both sides, so the tolerance is the CPU's."""
    from nightshift.trainer import loop

    trainer, model, rows, tok = _trainer(tmp_path, tiny_model, _objectives()["sft"], micro_tokens=1024,
                                         device="cuda")
    assert next(model.parameters()).device.type == "cuda"
    step = trainer.train_dataset[0]
    step.micro = [rows[:3], rows[3:]]
    model.zero_grad(set_to_none=True)
    trainer.training_step(model, step)
    unsplit = {k: v.cpu() for k, v in _grads(model).items()}
    real, calls = loop.completion_logprobs, []

    def second_forward_runs_out(m, batch, **kw):
        calls.append(1)
        if len(calls) == 2:
            torch.empty(1 << 45, dtype=torch.uint8, device="cuda")  # the real allocator refuses
        return real(m, batch, **kw)

    monkeypatch.setattr(loop, "completion_logprobs", second_forward_runs_out)
    model.zero_grad(set_to_none=True)
    trainer.training_step(model, step)
    assert len(trainer.retries) == 1 and "out of memory" in trainer.retries[0]
    for k, v in _grads(model).items():
        torch.testing.assert_close(v.cpu(), unsplit[k], rtol=RTOL, atol=1e-6, msg=k)
