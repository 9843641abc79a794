"""μ for every row: the token log-probs of the policy that really produced each
logged call, which `pg`'s importance ratios need.

Instrumentations rarely log logprobs, but every call says which policy made it
(`policy_version`: a published version, or none for the base model) and at which
temperature. So μ is recomputed with that version's own weights, at that
temperature (log softmax(logits / T): the distribution sampled from, not the
T = 1 one). Where a row did log logprobs for exactly our tokens they are kept,
and compared with the recomputed ones: the drift printed says whether the
logged numbers and the checkpoints agree (a different engine, precision or
temperature shows up there). Rows whose producer cannot be found (a model never
published here, a version deleted from disk) keep μ unknown, and `pg` treats
their negatives by `pg.unknown_mu_negatives`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .config import TrainConfig
from .plan import RunPlan

BASE = "base"


#: Fully logged rows recomputed anyway, to compare the logged numbers with the
#: weights' (a different engine, precision or temperature shows up there): a
#: sample is enough to see a drift, and the rest costs nothing.
DRIFT_SAMPLE = 32


@dataclass
class MuReport:
    counts: Counter = field(default_factory=Counter)  # logged | recomputed | unknown, per row
    drift: float | None = None  # mean |logged - recomputed| per token, where both exist
    drift_tokens: int = 0
    versions: Counter = field(default_factory=Counter)  # which producer, per recomputed row
    rows: int = 0  # rows through a forward pass (the recomputed and the drift sample)
    tokens: int = 0  # their tokens
    seconds: float = 0.0  # the whole recomputation: loading the producers and their forwards
    loaded: int = 0  # producers loaded from disk (the policy itself gives the base and its init adapter)

    def line(self) -> str:
        return f"μ: {self.rows:,} rows recomputed ({self.tokens:,} tokens) in {self.seconds:.1f} s"

    def summary(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "models_loaded": self.loaded, **{k: n for k, n in self.counts.items()}}


def producer(cfg: TrainConfig, feature: dict) -> str | None:
    """The folder (or BASE) of the policy that made a call, or None when unknown."""
    version = feature.get("policy_version")
    if version:
        folder = Path(cfg.output.removeprefix("file://")) / version
        return str(folder) if (folder / "manifest.json").is_file() else None
    model = feature.get("model")
    base_names = {cfg.served_name(), cfg.base_model, Path(cfg.base_model).name}
    return BASE if model is None or model in base_names else None


@contextlib.contextmanager
def _producer_model(cfg: TrainConfig, plan: RunPlan, src: str, policy) -> Iterator[tuple[object, bool]]:
    """The model that made `src`'s calls, and whether it was loaded for this. The
    policy, before its first step, already is the base (full fine-tuning; LoRA
    with the adapter switched off) and, with `init_adapter`, that version: a
    second copy of the base would cost its weights again (15 GB at 7B)."""
    import torch

    is_peft = policy is not None and hasattr(policy, "disable_adapter")
    init = cfg.init_adapter and src != BASE and Path(src).resolve() == Path(cfg.init_adapter).resolve()
    if policy is not None and ((src == BASE and (is_peft or cfg.full_finetune)) or (is_peft and init)):
        was_training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter() if is_peft and src == BASE else contextlib.nullcontext():
                yield policy, False
        finally:
            policy.train(was_training)
        return
    from .model import load_version

    model = load_version(cfg, None if src == BASE else src, plan).to(plan.device).eval()
    try:
        yield model, True
    finally:
        del model
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()


def attach(cfg: TrainConfig, plan: RunPlan, features: list[dict], tok, policy=None) -> MuReport:
    """Fill each feature's `old_logprobs` (NaN entries) with μ recomputed from its
    producer, in batches of the memory plan's tokens; fully logged rows are kept,
    and up to `DRIFT_SAMPLE` of them recomputed to cross-check the logged numbers.
    `policy`: the model about to train, not yet stepped (it gives the base and the
    init adapter's μ without loading them again)."""
    import torch

    from .logprobs import completion_logprobs
    from .loop import collate, to_device, token_batches, uses_boundaries

    report = MuReport()
    work: dict[tuple[str, float], list[dict]] = defaultdict(list)
    sampled = 0
    for f in features:
        old = f.get("old_logprobs")
        logged = old is not None and not all(math.isnan(x) for x in old)  # a template tail may be unlogged
        complete = logged and not any(math.isnan(x) for x in old)
        src = producer(cfg, f) if cfg.pg.mu == "auto" else None
        report.counts["logged" if logged else "recomputed" if src else "unknown"] += 1
        if src:
            report.versions[Path(src).name if src != BASE else BASE] += 1
        if src and (not complete or sampled < DRIFT_SAMPLE):
            sampled += complete
            t = f.get("temperature")
            work[(src, 1.0 if t is None else float(t))].append(f)
    abs_sum, n_tok = 0.0, 0
    t0 = time.perf_counter()
    for src in sorted({s for s, _ in work}):
        with _producer_model(cfg, plan, src, policy) as (model, loaded), torch.no_grad():
            report.loaded += loaded
            for (s, temp), fs in work.items():
                if s != src:
                    continue
                for chunk in token_batches(fs, plan.micro_batch_tokens, plan.packed):
                    batch = to_device(collate(chunk, tok.pad_token_id, plan.packed, uses_boundaries(plan)),
                                      plan.device)
                    report.rows += len(chunk)
                    report.tokens += int(batch["input_ids"].numel() if plan.packed else
                                         batch["attention_mask"].sum().item())
                    if temp <= 0:  # greedy: μ is a point mass on what was chosen
                        values = [0.0] * batch["targets"].numel()
                    else:
                        values = completion_logprobs(model, batch, temperature=temp).float().cpu().tolist()
                    seq = batch["tok_seq"].tolist()
                    for j, f in enumerate(chunk):
                        mine = [v for v, q in zip(values, seq) if q == j]
                        old = f.get("old_logprobs")
                        if old is None:
                            f["old_logprobs"] = mine
                            continue
                        for o, m in zip(old, mine):
                            if not math.isnan(o):
                                abs_sum += abs(o - m)
                                n_tok += 1
                        f["old_logprobs"] = [m if math.isnan(o) else o for o, m in zip(old, mine)]
    report.seconds = time.perf_counter() - t0
    if n_tok:
        report.drift, report.drift_tokens = abs_sum / n_tok, n_tok
    return report
