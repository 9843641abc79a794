"""The pg loss as a function, and the batches it is fed: hand-checkable numbers."""

from __future__ import annotations

import math

import pytest
import torch

from nightshift.trainer.algorithms.pg import pg_loss
from nightshift.trainer.logprobs import completion_logprobs
from nightshift.trainer.loop import collate


def _grad(clip: str, logp0: list[float], old: list[float], adv: list[float], tok_seq: list[int], **kw):
    logp = torch.tensor(logp0, requires_grad=True)
    loss, stats = pg_loss(logp, torch.tensor(old), torch.tensor(adv), torch.tensor(tok_seq),
                          torch.ones(len(adv)), clip=clip, **kw)
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


def test_on_policy_gradient_is_advantage_over_tokens():
    # Two sequences: 2 tokens with A=+1, 1 token with A=-2; no logged logprobs.
    _, g, stats = _grad("ppo", [-1.0, -2.0, -0.5], [math.nan] * 3, [1.0, -2.0], [0, 0, 1])
    # loss = (-(1/2)(A0 + A0) - A1) / 2: d/dlogp = -A_seq / n_tok(seq) / B
    assert g == pytest.approx([-0.25, -0.25, 1.0])
    assert stats["pg/ratio_mean"] == pytest.approx(1.0)
    assert stats["pg/logged_frac"] == 0.0


def test_ppo_clip_stops_the_gradient_outside_the_trust_region():
    # ratio = e^(logp - old) = e^1 > 1.2: a positive advantage gets no more push;
    # a negative one still does (the min keeps the unclipped, lower objective).
    _, g, stats = _grad("ppo", [-1.0, -1.0], [-2.0, -2.0], [1.0, -1.0], [0, 1], epsilon=0.2)
    assert g[0] == 0.0
    assert g[1] == pytest.approx(math.e / 2)
    assert stats["pg/clip_frac"] == pytest.approx(0.5)
    # without clipping both move, the first by the full ratio
    _, g, _ = _grad("none", [-1.0, -1.0], [-2.0, -2.0], [1.0, -1.0], [0, 1])
    assert g == pytest.approx([-math.e / 2, math.e / 2])


def test_truncated_importance_weight_caps_the_ratio():
    _, g, stats = _grad("truncate", [-1.0, -3.0], [-3.0, -2.0], [1.0, 1.0], [0, 1], truncate_max=2.0)
    # ratios e^2 (capped at 2) and e^-1: gradient -min(r, 2)·A / B
    assert g == pytest.approx([-1.0, -math.exp(-1) / 2])
    assert stats["pg/clip_frac"] == pytest.approx(0.5)


def test_ratio_is_one_when_logged_logprobs_equal_the_policy():
    logp = [-1.3, -0.2, -4.0]
    _, g_logged, stats = _grad("ppo", logp, logp, [0.7], [0, 0, 0])
    _, g_none, _ = _grad("ppo", logp, [math.nan] * 3, [0.7], [0, 0, 0])
    assert stats["pg/ratio_mean"] == pytest.approx(1.0)
    assert stats["pg/logged_frac"] == 1.0
    assert g_logged == pytest.approx(g_none)


def test_kl_penalty_pulls_toward_the_reference():
    # With no advantage, only the k3 KL term acts: log π above the reference is pushed down.
    _, g, stats = _grad("ppo", [-0.5], [math.nan], [0.0], [0], ref_logp=torch.tensor([-1.0]), kl_coef=1.0)
    assert g[0] > 0  # gradient descent lowers logp toward the reference
    assert stats["pg/kl"] == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_sequence_weights_count_trajectories_not_calls():
    # the same advantage, one sequence weighted 0.25 (a call of a 4-call trajectory)
    _, g, _ = _grad("ppo", [-1.0, -1.0], [math.nan] * 2, [1.0, 1.0], [0, 1])
    logp = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = pg_loss(logp, torch.tensor([math.nan] * 2), torch.tensor([1.0, 1.0]), torch.tensor([0, 1]),
                      torch.tensor([1.0, 0.25]))
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([g[0], g[1] * 0.25])


def test_packed_and_padded_batches_give_the_same_logprobs(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    feats = [
        {"input_ids": list(range(10, 30)), "completion_start": 12, "advantage": 1.0, "weight": 1.0},
        {"input_ids": list(range(40, 47)), "completion_start": 3, "advantage": 0.0, "weight": 1.0},
        {"input_ids": list(range(50, 80)), "completion_start": 29, "advantage": -1.0, "weight": 1.0},
    ]
    with torch.no_grad():
        packed = completion_logprobs(model, collate(feats, 0, packed=True))
        padded = completion_logprobs(model, collate(feats, 0, packed=False))
        alone = torch.cat([completion_logprobs(model, collate([f], 0, packed=False)) for f in feats])
    assert packed.shape == (8 + 4 + 1,)
    assert torch.allclose(packed, alone, atol=1e-5)
    assert torch.allclose(padded, alone, atol=1e-5)
    # and the token log-probs are those of a full forward pass
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([feats[0]["input_ids"]])).logits[0], -1)
    ref = [full[p - 1, feats[0]["input_ids"][p]].item() for p in range(12, 20)]
    assert packed[:8].tolist() == pytest.approx(ref, abs=1e-5)


def test_collate_refuses_an_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty"):
        collate([{"input_ids": [1, 2], "completion_start": 0, "advantage": 1.0, "weight": 1.0}], 0)


def test_topr_positives_have_no_ratio_negatives_a_ratio_truncated_at_one():
    # μ known for both: ratios e^(logp - old) = e^1 (π above μ) and e^-1 (π below μ).
    # A positive row gets the plain -A/B whatever the ratio (nothing caps a gain);
    # a negative row is pushed down by clip(π/μ, 0, 1)·|A|/B: at most 1, less where π < μ.
    _, g, stats = _grad("topr", [-1.0, -3.0, -1.0, -3.0], [-2.0, -2.0, -2.0, -2.0],
                        [1.0, 1.0, -1.0, -1.0], [0, 1, 2, 3])
    assert g == pytest.approx([-0.25, -0.25, 0.25, math.exp(-1) / 4])
    assert stats["pg/clip_frac"] == pytest.approx(0.25)  # the negative with π > μ, truncated at 1


def test_topr_negatives_without_mu_follow_the_setting():
    # no logged or recomputed μ: negatives are left out (0) or down-weighted, positives untouched
    _, g, _ = _grad("topr", [-1.0, -1.0], [math.nan, math.nan], [1.0, -1.0], [0, 1])
    assert g == pytest.approx([-0.5, 0.0])
    _, g, stats = _grad("topr", [-1.0, -1.0], [math.nan, math.nan], [1.0, -1.0], [0, 1], unknown_mu_negatives=0.3)
    assert g == pytest.approx([-0.5, 0.15])
    assert stats["pg/neg_weight_mean"] == pytest.approx(0.3)


def test_temperature_logprobs_are_those_of_the_sampled_distribution(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    f = {"input_ids": list(range(10, 22)), "completion_start": 8, "advantage": 1.0, "weight": 1.0}
    with torch.no_grad():
        at_half = completion_logprobs(model, collate([f], 0), temperature=0.5)
        logits = model(torch.tensor([f["input_ids"]])).logits[0].float()
    ref = [torch.log_softmax(logits[p - 1] / 0.5, -1)[f["input_ids"][p]].item() for p in range(8, 12)]
    assert at_half.tolist() == pytest.approx(ref, abs=1e-5)
    assert not torch.allclose(at_half, completion_logprobs(model, collate([f], 0)))


def test_awr_weights_are_positive_normalized_monotone_and_capped():
    from types import SimpleNamespace

    from nightshift.trainer.algorithms.awr import awr_features

    def ex(a: float):
        return SimpleNamespace(row={"weight": 1.0, "advantage": a}, r=SimpleNamespace(prompt_ids=[1], completion_ids=[2],
                                                                                      old_logprobs=None))

    feats = awr_features([ex(a) for a in (-1.0, 0.0, 1.0, 5.0)], beta=0.5, max_weight=3.0)
    w = [f["advantage"] for f in feats]
    assert all(x > 0 for x in w) and w[0] < w[1] < w[2]
    assert w[3] == 3.0  # capped
    raw = [math.exp(a / 0.5) for a in (-1.0, 0.0, 1.0, 5.0)]
    assert w[1] / w[0] == pytest.approx(raw[1] / raw[0])
    assert w[2] == pytest.approx(min(raw[2] / (sum(raw) / 4), 3.0))
