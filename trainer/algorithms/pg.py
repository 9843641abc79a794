"""`pg`: policy gradient on logged calls, on the shared loop (trainer/loop.py).

Every row is one LLM call with a credit-assigned advantage A, produced by some
earlier policy μ (the base model, or an older published adapter). The default
(`clip: topr`, Tapered Off-Policy REINFORCE, arXiv 2503.14286) is what works on
such data: positive rows get the plain A·∇log π, with no importance ratio, so
nothing caps how far a good action may rise; negative rows get the ratio
truncated to clip(π/μ, 0, 1), so an action the policy already left behind is
not pushed further down (the push that squeezes mass into malformed output).
Negatives whose μ is unknown get `unknown_mu_negatives` as their ratio (0: left
out). `ppo`, `truncate` and `none` are the classic surrogates against μ. Token
losses are averaged within a sequence, then sequences are weighted by the
transition's `weight` (1/calls of its trajectory) so a long trajectory does not
outvote a short one. μ comes from trainer/behaviour.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nightshift.settings import setting

from . import Algorithm, Prepared

if TYPE_CHECKING:
    import torch

    from ..config import TrainConfig
    from ..examples import Example
    from ..plan import RunPlan

CLIP_MODES = ("topr", "ppo", "truncate", "none")
MU_SOURCES = ("auto", "logged")
REFERENCES = ("base", "init")


@dataclass
class PGSettings:
    """Policy gradient on logged calls (this module says why each choice)."""

    clip: str = setting("topr", help="how the ratio pi/mu against the policy mu that made each call enters: topr "
                                     "(positives without a ratio, negatives with clip(pi/mu, 0, 1)), ppo (PPO's "
                                     "clipped surrogate against mu), truncate (at most truncate_max) or none; there "
                                     "is no clip against the policy training starts from: that capped every gain",
                        choices=CLIP_MODES)
    epsilon: float = setting(0.2, help="ppo's clip range", bounds="(0, inf)")
    truncate_max: float = setting(2.0, help="truncate's largest importance weight", bounds="(0, inf)")
    mu: str = setting("auto", help="where mu's token log-probs come from: auto = logged ones where the row carries "
                                   "them for our tokens, else recomputed with the weights of the version that made "
                                   "the call (policy_version) at the request's temperature; logged = only logged ones",
                      choices=MU_SOURCES)
    unknown_mu_negatives: float = setting(0.0, help="the ratio given to negative rows whose mu is known neither way "
                                                    "(0: left out, the safe choice)", bounds="[0, 1]")
    baseline_offset: float = setting(0.1, help="added to every advantage: the baseline set that much below the mean "
                                               "(AsymRE, arXiv 2506.20520: above the behaviour policy's mean "
                                               "collapses training, slightly below is stable)")
    kl_coef: float = setting(0.0, help="weight of a KL penalty to the reference policy; 0 turns it off and skips "
                                       "the reference pass", bounds="[0, inf)")
    reference: str = setting("base", help="the KL's reference: base (the base model, adapter off) or init (the "
                                          "policy training started from, e.g. the published adapter)",
                             choices=REFERENCES)
    normalize_advantages: bool = setting(False, help="rescale advantages to unit standard deviation over the "
                                                     "training rows (the transform may have normalized them already)")


def pg_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    tok_seq: torch.Tensor,
    seq_weight: torch.Tensor,
    *,
    clip: str = "topr",
    epsilon: float = 0.2,
    truncate_max: float = 2.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    unknown_mu_negatives: float = 0.0,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy-gradient loss of a batch, and what a person watching it wants to see.

    logp: [K] log π of the completion tokens of every sequence, concatenated.
    old_logp: [K] logged log μ of the same tokens, NaN where unknown (ratio 1).
    adv: [B] advantage of each sequence. tok_seq: [K] the sequence of each token.
    seq_weight: [B] weight of each sequence. ref_logp: [K] reference log-probs,
    for the k3 estimate of KL(π‖ref) (non-negative, unbiased) times `kl_coef`.
    The loss is the weighted sum of the sequences' mean token losses over
    `denominator` (default: this batch's sequences; the shared loop passes 1 and
    divides by the rows of the whole optimizer step).
    """
    import torch

    b = adv.shape[0]
    logged = ~torch.isnan(old_logp)
    old = torch.where(logged, old_logp, logp.detach())
    ratio = torch.exp(logp - old)
    a = adv[tok_seq].to(logp.dtype)
    if clip == "topr":
        # positives: ratio 1 (plain A·∇log π); negatives: clip(π/μ, 0, 1) as a fixed
        # weight where μ is known, `unknown_mu_negatives` where it is not
        neg = a < 0
        w = torch.where(logged, ratio.detach().clamp(max=1.0), torch.full_like(ratio, unknown_mu_negatives))
        w = torch.where(neg, w, torch.ones_like(w))
        obj = w * logp * a
        clip_frac = (neg & logged & (ratio.detach() > 1.0)).float()
    elif clip == "ppo":
        clipped = ratio.clamp(1.0 - epsilon, 1.0 + epsilon)
        obj = torch.minimum(ratio * a, clipped * a)
        clip_frac = ((ratio * a) > (clipped * a)).float()
    elif clip == "truncate":
        w = ratio.detach().clamp(max=truncate_max)
        obj = w * logp * a  # its gradient is min(r, c)·A·∇log π
        clip_frac = (ratio.detach() > truncate_max).float()
    else:
        obj = ratio * a
        clip_frac = torch.zeros_like(ratio)
    tok_loss = -obj
    kl = None
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        tok_loss = tok_loss + kl_coef * kl
    ones = torch.ones_like(tok_loss)
    n_tok = torch.zeros(b, dtype=tok_loss.dtype, device=tok_loss.device).index_add(0, tok_seq, ones)
    seq_loss = torch.zeros(b, dtype=tok_loss.dtype, device=tok_loss.device).index_add(0, tok_seq, tok_loss)
    seq_loss = seq_loss / n_tok.clamp(min=1.0)
    loss = (seq_loss * seq_weight.to(seq_loss.dtype)).sum() / (b if denominator is None else denominator)
    with torch.no_grad():
        stats = {
            "pg/ratio_mean": ratio.mean().item(),
            "pg/ratio_max": ratio.max().item() if ratio.numel() else 1.0,
            "pg/clip_frac": clip_frac.mean().item() if clip_frac.numel() else 0.0,
            "pg/logged_frac": logged.float().mean().item() if logged.numel() else 0.0,
            "pg/logp_mean": logp.mean().item() if logp.numel() else 0.0,
            "pg/adv_mean": adv.float().mean().item(),
        }
        if clip == "topr":
            stats["pg/neg_weight_mean"] = w[a < 0].mean().item() if bool((a < 0).any()) else 1.0
        if kl is not None:
            stats["pg/kl"] = kl.mean().item()
    return loss, stats


def examples(cfg: TrainConfig, rendered: list[Example]) -> tuple[list[dict], Counter]:
    """Every row, as token features with its advantage (shifted by the baseline offset)."""
    from ..examples import pg_features

    return pg_features(rendered, cfg.pg.normalize_advantages, cfg.pg.baseline_offset), Counter()


def objective(settings: PGSettings):
    """The loss the shared loop calls on each micro-batch's completion log-probs:
    summed over its rows, the loop divides by the step's rows (each sequence
    weighs its `weight`, whatever its length or micro-batch)."""
    from ..loop import Objective

    def loss(logp, batch):
        return pg_loss(logp, batch["old_logprobs"], batch["advantage"], batch["tok_seq"], batch["weight"],
                       clip=settings.clip, epsilon=settings.epsilon, truncate_max=settings.truncate_max,
                       ref_logp=batch.get("ref_logprobs"), kl_coef=settings.kl_coef,
                       unknown_mu_negatives=settings.unknown_mu_negatives, denominator=1.0)

    return Objective(loss, per="row")


def make_trainer(cfg: TrainConfig, plan: RunPlan, model, tok, rows: list[dict], args: dict, callbacks: list):
    from ..loop import make_trainer

    return make_trainer(cfg, plan, model, tok, rows, args, callbacks, objective(cfg.pg))


def before_training(cfg: TrainConfig, plan: RunPlan, policy, tok, rows: list[dict], ref) -> Prepared:
    """The reference's log-probs for the KL penalty (when on), and μ for every row
    (logged, or recomputed with the weights of the version that made the call)."""
    from .. import behaviour

    out = Prepared()
    if cfg.pg.kl_coef > 0:
        import torch

        from ..loop import collate, to_device, token_batches, uses_boundaries

        was_training = policy.training
        policy.eval()
        with torch.no_grad():
            for chunk in token_batches(rows, plan.micro_batch_tokens, plan.packed):
                batch = to_device(collate(chunk, tok.pad_token_id, plan.packed, uses_boundaries(plan)), plan.device)
                seq = batch["tok_seq"].tolist()
                values = ref.logprobs(batch).float().cpu().tolist()
                for j, f in enumerate(chunk):
                    f["ref_logprobs"] = [v for v, s in zip(values, seq) if s == j]
        policy.train(was_training)
    if cfg.pg.clip == "none":
        return out
    mu = behaviour.attach(cfg, plan, rows, tok, policy)
    out.logged.update({f"mu_{k}": n for k, n in mu.counts.items()})
    out.manifest["mu"] = mu.summary()
    if mu.rows:
        out.notes.append(mu.line())
    if mu.versions:
        out.notes.append("μ producers: " + ", ".join(f"{v} {n:,}" for v, n in sorted(mu.versions.items())))
    if mu.drift is not None:
        out.notes.append(f"logged vs recomputed μ: mean |Δ log μ| {mu.drift:.4f} per token over "
                         f"{mu.drift_tokens:,} tokens")
    return out


ALGORITHM = Algorithm(
    name="pg", settings=PGSettings, order=0, examples=examples, trainer=make_trainer, needs_advantage=True,
    reference=lambda cfg: cfg.pg.reference, before_training=before_training,
)
