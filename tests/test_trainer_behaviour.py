"""μ recomputed from the policy that made each call (trainer/behaviour.py) without
a second copy of a model the policy already is: before its first step, the
policy with its adapter off is the base, and full fine-tuning's policy is the
base itself. At 7B that copy is 15 GB of weights loaded again.

Tolerance: fp32 on a CPU, the same weights and the same forward: 1e-6 absolute.
On a GPU machine the models sit where the trainer puts them (run.py moves the
policy to the plan's device before μ) and compute in the plan's bf16, where a
packed batch and a row alone differ by kernel shape: 2e-2 there."""

from __future__ import annotations

import pytest
import torch

from nightshift.settings import apply
from nightshift.trainer import behaviour, model as model_mod
from nightshift.trainer.config import TrainConfig
from nightshift.trainer.logprobs import completion_logprobs
from nightshift.trainer.loop import collate, to_device
from nightshift.trainer.plan import work_out


def _placed(model, plan):
    """The model where the trainer runs it (trainer/run.py: the plan's device)."""
    return model.to(plan.device)


def _tol(plan) -> float:
    return 1e-6 if plan.dtype == torch.float32 else 2e-2


def _features(tok, n: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        p, c = 6 + 3 * i, 2 + i
        ids = torch.randint(5, len(tok), (p + c,), generator=g).tolist()
        out.append({"input_ids": ids, "completion_start": p, "advantage": 1.0, "weight": 1.0,
                    "old_logprobs": None, "policy_version": None, "model": None,
                    "temperature": 0.7 if i % 2 else None})
    return out


@pytest.mark.parametrize("full", [False, True])
def test_mu_of_the_base_comes_from_the_policy_not_a_second_copy(tmp_path, tiny_model, monkeypatch, full):
    cfg = TrainConfig()
    apply(cfg, dict(data=str(tmp_path), base_model=str(tiny_model), output=str(tmp_path / "ck"), algorithm="pg",
                    full_finetune=full), "test")
    plan = work_out(cfg)
    tok = model_mod.load_tokenizer(cfg)
    policy = _placed(model_mod.load_policy(cfg, plan), plan)
    if not full:  # a fresh adapter starts as the base: make it matter, so "adapter off" is tested
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
    policy.train()
    loads: list = []
    real = model_mod.load_version
    monkeypatch.setattr(model_mod, "load_version", lambda *a, **k: loads.append(a) or real(*a, **k))
    feats = _features(tok)
    report = behaviour.attach(cfg, plan, feats, tok, policy)
    assert loads == [] and report.loaded == 0 and report.counts["recomputed"] == len(feats)
    assert policy.training  # handed back as it came
    base = _placed(real(cfg, None, plan), plan).eval()
    with torch.no_grad():
        for f in feats:
            batch = to_device(collate([f], tok.pad_token_id), plan.device)
            want = completion_logprobs(base, batch, temperature=f["temperature"] or 1.0)
            torch.testing.assert_close(torch.tensor(f["old_logprobs"]), want.float().cpu(), atol=_tol(plan), rtol=0)
            if not full:  # and not the adapter's: the policy with it on differs
                assert (completion_logprobs(policy, batch) - completion_logprobs(base, batch)).abs().max() > 1e-4
    # without the policy (another caller), the base is loaded as before
    again = _features(tok)
    assert behaviour.attach(cfg, plan, again, tok).loaded == 1 and len(loads) == 1
    assert all(abs(a - b) <= _tol(plan) for f, g in zip(feats, again) for a, b in zip(f["old_logprobs"], g["old_logprobs"]))


def test_mu_of_the_init_adapters_version_comes_from_the_policy(tmp_path, tiny_model, monkeypatch):
    """Continuing the published adapter (`init_adapter`): calls that version made
    get μ from the policy as loaded, before its first step, with the adapter on."""
    import json

    cfg = TrainConfig()
    apply(cfg, dict(data=str(tmp_path), base_model=str(tiny_model), output=str(tmp_path / "ck"), algorithm="pg"),
          "test")
    plan = work_out(cfg)
    tok = model_mod.load_tokenizer(cfg)
    first = _placed(model_mod.load_policy(cfg, plan), plan)
    for n, p in first.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    version = tmp_path / "ck" / "v0001"
    first.save_pretrained(version)
    (version / "manifest.json").write_text(json.dumps({"version": "v0001", "kind": "lora"}))
    cfg.init_adapter = str(version)
    policy = _placed(model_mod.load_policy(cfg, plan), plan)
    real = model_mod.load_version
    loads: list = []
    monkeypatch.setattr(model_mod, "load_version", lambda *a, **k: loads.append(a) or real(*a, **k))
    feats = [{**f, "policy_version": "v0001"} for f in _features(tok, 3)]
    assert behaviour.attach(cfg, plan, feats, tok, policy).loaded == 0 and loads == []
    with torch.no_grad():
        for f in feats:
            batch = to_device(collate([f], tok.pad_token_id), plan.device)
            want = completion_logprobs(first.eval(), batch, temperature=f["temperature"] or 1.0)
            torch.testing.assert_close(torch.tensor(f["old_logprobs"]), want.float().cpu(), atol=_tol(plan), rtol=0)
