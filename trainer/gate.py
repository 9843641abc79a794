"""The eval gate: is the new checkpoint not worse than the one serving? Both are
scored on the same held-out transitions (trajectories split off by a stable hash,
so neither trained on them), then the user's own evaluation command runs if one
is configured. Every decision is appended, with its numbers, to
`<checkpoints>/gate-log.jsonl`.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import logging
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import TrainConfig

log = logging.getLogger("nightshift.gate")

#: metric -> True when higher is better
METRICS = {"adv_weighted_logp": True, "nll": False}


@dataclass
class GateSettings:
    """`metric`: adv_weighted_logp (advantage-weighted log-likelihood of the held-out
    calls: up means the policy prefers what was rewarded) or nll (lower is
    better). `margin`: how much worse the candidate may be and still pass.
    `command`: your evaluation, run through the shell with NIGHTSHIFT_CANDIDATE,
    NIGHTSHIFT_PUBLISHED (empty for the base) and NIGHTSHIFT_BASE_MODEL set; exit 0
    passes, anything else blocks; a JSON object on its last stdout line is kept.
    `min_rows`: fewer held-out rows than this and the offline comparison is
    skipped (said in the decision), the command still runs."""

    enabled: bool = True
    metric: str = "adv_weighted_logp"
    margin: float = 0.0
    command: str = ""
    timeout: float = 3600.0
    min_rows: int = 1


@dataclass
class GateDecision:
    passed: bool
    reason: str
    candidate: str
    published: str | None
    metric: str
    margin: float
    candidate_metrics: dict = field(default_factory=dict)
    published_metrics: dict = field(default_factory=dict)
    command: dict | None = None
    time: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    def lines(self) -> list[str]:
        head = "gate: PASSED" if self.passed else "gate: BLOCKED"
        out = [f"{head}: {self.reason}"]
        m = self.metric
        if self.candidate_metrics:
            c, p = self.candidate_metrics.get(m), self.published_metrics.get(m)
            out.append(f"  {m}: candidate {c:.4f} vs {'published ' + str(self.published) if self.published else 'base'} "
                       f"{p:.4f} (margin {self.margin}) on {self.candidate_metrics.get('rows', 0)} held-out rows"
                       if c is not None and p is not None else f"  {m}: not available")
        if self.command:
            out.append(f"  command exit {self.command.get('exit')}: {self.command.get('summary', '')}")
        return out


def _score(cfg: TrainConfig, adapter: str | None, features: list[dict], tok, kind: str) -> dict:
    from .evaluate import evaluate
    from .model import load_base, on_gpu, packed

    if adapter and kind == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(adapter)
    else:
        model = load_base(cfg)
        if adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
    if on_gpu():
        model.to("cuda")
    out = evaluate(model, features, tok.pad_token_id, cfg.eval_batch_size, packed(cfg))
    del model
    return out


def _command(settings: GateSettings, candidate: str, published: str | None, base: str) -> dict:
    env = {**os.environ, "NIGHTSHIFT_CANDIDATE": candidate, "NIGHTSHIFT_PUBLISHED": published or "",
           "NIGHTSHIFT_BASE_MODEL": base}
    try:
        p = subprocess.run(settings.command, shell=True, env=env, capture_output=True, text=True, timeout=settings.timeout)
    except subprocess.TimeoutExpired:
        return {"exit": None, "summary": f"timed out after {settings.timeout:.0f} s", "passed": False}
    result: dict = {"exit": p.returncode, "passed": p.returncode == 0}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        result["result"] = json.loads(last)
    except json.JSONDecodeError:
        pass
    tail = (p.stderr.strip() or p.stdout.strip())[-300:]
    result["summary"] = json.dumps(result.get("result")) if "result" in result else tail
    return result


def gate(candidate: str, published: str | None, train_cfg: TrainConfig, settings: GateSettings,
         log_dir: str | None = None) -> GateDecision:
    """Decide whether `candidate` (a local version folder) may replace `published`
    (a version folder, or None: the base model is serving)."""
    from .checkpoint import read_manifest
    from .examples import pg_features, prepare
    from .model import load_tokenizer
    from .select import TrainDataError, select

    if settings.metric not in METRICS:
        raise ValueError(f"gate.metric must be one of {', '.join(METRICS)}, got {settings.metric!r}")
    man = read_manifest(candidate)
    cfg = copy.deepcopy(train_cfg)
    cfg.base_model = man.get("base_model") or cfg.base_model
    ds = man.get("dataset", {})
    cfg.select.since, cfg.select.until = ds.get("since") or "", ds.get("until") or ""
    cfg.eval_fraction = man.get("config", {}).get("eval_fraction", cfg.eval_fraction)
    decision = GateDecision(True, "", candidate, published, settings.metric, settings.margin)
    try:
        sel = select(cfg)
        tok = load_tokenizer(cfg)
        feats = pg_features(prepare(cfg, tok, sel).eval)
    except TrainDataError as e:
        feats, decision.reason = [], f"no held-out transitions ({e})"
    higher = METRICS[settings.metric]
    if len(feats) >= max(settings.min_rows, 1):
        pub_kind = read_manifest(published).get("kind", "lora") if published else "lora"
        decision.candidate_metrics = _score(cfg, candidate, feats, tok, man.get("kind", "lora"))
        decision.published_metrics = _score(cfg, published, feats, tok, pub_kind)
        c = decision.candidate_metrics.get(settings.metric)
        p = decision.published_metrics.get(settings.metric)
        if c is None or p is None:
            decision.reason = f"{settings.metric} not available on the held-out rows (no advantages): not compared"
        else:
            delta = (c - p) if higher else (p - c)
            decision.passed = delta >= -settings.margin
            better = "better" if delta > 0 else ("no worse" if delta == 0 else "worse")
            decision.reason = (f"{settings.metric} {better} by {abs(delta):.4f} "
                               f"({'within' if decision.passed else 'beyond'} the margin {settings.margin})")
    elif not decision.reason:
        decision.reason = f"{len(feats)} held-out row(s), fewer than gate.min_rows={settings.min_rows}: not compared"
    if settings.command:
        decision.command = _command(settings, candidate, published, cfg.base_model)
        if not decision.command["passed"]:
            decision.passed = False
            decision.reason += f"; the evaluation command failed (exit {decision.command['exit']})"
        else:
            decision.reason += "; the evaluation command passed"
    decision.reason = decision.reason.lstrip("; ")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / "gate-log.jsonl", "a") as f:
            f.write(json.dumps(asdict(decision), default=str) + "\n")
    log.info("gate %s: %s", "passed" if decision.passed else "blocked", decision.reason)
    return decision
