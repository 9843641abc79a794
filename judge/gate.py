"""The eval gate: may the new checkpoint replace the one serving?

A gate scored by the training objective passes its own candidate (a `pg` run
always raises the advantage-weighted likelihood it maximized, whether the agent
got better or not). So the gate asks two questions the loss never optimized,
on held-out trajectories (split off by a stable hash: neither model trained on
them), both models side by side:

- ranking: over pairs of held-out calls in the same or a similar state (the
  same agent, the same turn structure, the same side of a tool error) where one was rewarded more than the
  other, how often did the candidate raise the better action's likelihood more
  than the worse one's, relative to the serving model (log π_cand − log π_pub:
  DPO's implicit reward)? The serving model scores 50 % by construction; the
  lower confidence bound of the candidate's score (a bootstrap over held-out
  trajectories) may not fall below it by more than `ranking_margin`. A point
  estimate is not enough: on 15 held-out episodes, candidates 8 points worse
  in success scored 58 % on 45 pairs and passed. Comparing
  likelihood *changes* rather than raw likelihoods matters: across two
  different states a raw likelihood says how typical a completion is, not how
  good (a candidate trained on inverted rewards ranked raw pairs better than
  the base on the agent world, while its changes ranked them worse).
- generation: sample each model on the same `samples` held-out prompts with
  their tools (same seeds); the share of outputs that are a valid tool call
  (JSON that parses, a tool that was offered, its required arguments present)
  or clean text. This catches a policy whose format broke, which likelihoods
  alone can miss. It blocks when the samples SHOW a fall of more than
  `validity_margin`: the one-sided upper bound of the paired difference
  (candidate minus serving, prompt by prompt) below minus the margin. A point
  comparison blocked on noise: 83.0 % against 89.8 % on 88 samples (a fall the
  samples cannot tell from none) blocked a candidate the world's checker
  measured 23 points better on 100 paired tasks (benchmarks/learning.py,
  issue 27). A veto needs evidence of harm; the case for the candidate is the
  ranking's lower bound and the command's.

The held-out NLL of rewarded calls is reported, not decisive. Then the user's
own evaluation command runs if one is configured, and must pass too. Every
decision is appended, with its numbers, to `<checkpoints>/gate-log.jsonl`.

The command's statistical contract. A point comparison on fresh tasks with
margin 0 cannot tell 13 points apart on 100 unpaired episodes (it passed
candidates that much worse, issue 27), so the gate states what it asks and the
command answers in kind. It receives NIGHTSHIFT_GATE_SEED (the tasks to play:
candidate and what serves play the SAME ones, each call of both with the same
sampling seed), NIGHTSHIFT_GATE_CONFIDENCE (1 - alpha) and
NIGHTSHIFT_GATE_MIN_EFFECT (success points, candidate minus serving: 0 asks for
a candidate better with confidence, -0.02 tolerates two points worse, 0.05 asks
for five better). It prints, as its last stdout line, a JSON object with at
least `estimate` (the paired difference), `lower` (its one-sided lower bound at
that confidence) and `n` (tasks played by both); it exits 0 when `lower` is above
the minimum effect, 1 when not, anything else when it could not measure. A
command that exits 0 while its own `lower` does not clear the minimum effect is
a broken check, and the gate says so rather than passing the candidate.
`examples/agent_world/gate_check.py` honours it (paired Newcombe bound).
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import json
import logging
import math
import os
import subprocess
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist

from nightshift.settings import setting
from nightshift.trainer.config import TrainConfig

from . import gatelog

log = logging.getLogger("nightshift.gate")

#: The headline figure of a decision (the report plots it).
METRIC = "ranking_accuracy"


@dataclass
class GateSettings:
    """May a candidate replace what serves? Decided on held-out trajectories neither
    model trained on; the gate must be convinced, so a small or noisy held-out set
    blocks rather than lets a worse model through (a blocked night leaves every
    agent served as before)."""

    enabled: bool = setting(True, help="gate every candidate (off publishes whatever trained)")
    ranking_margin: float = setting(0.0, help="ranking passes when the lower bound of the candidate's held-out "
                                              "ranking accuracy is at least 50 % minus this", bounds="[0, 1]")
    ranking_confidence: float = setting(0.95, help="the confidence of that lower bound (a bootstrap over held-out "
                                                   "trajectories)", bounds="[0.5, 1)")
    min_pairs: int = setting(20, help="fewer rewarded-vs-failed pairs than this and ranking is reported, not "
                                      "decisive", bounds="[0, inf)")
    max_pairs: int = setting(5000, help="pairs scored at most", bounds="[1, inf)")
    samples: int = setting(64, help="held-out prompts sampled per model for the generation check (0 turns it off)",
                           bounds="[0, inf)")
    max_tokens: int = setting(96, help="tokens per sample", bounds="[1, inf)")
    validity_margin: float = setting(0.05, help="the fall in the share of valid outputs the generation check "
                                                "tolerates: it blocks when the samples show a larger one (the "
                                                "upper bound of the paired difference below minus this)",
                                     bounds="[0, 1]")
    validity_confidence: float = setting(0.95, help="the confidence of that upper bound", bounds="[0.5, 1)")
    command: str = setting("", help="your evaluation, run through the shell with NIGHTSHIFT_CANDIDATE, "
                                    "NIGHTSHIFT_PUBLISHED (empty for the base) and NIGHTSHIFT_BASE_MODEL set, and "
                                    "the contract's NIGHTSHIFT_GATE_SEED, NIGHTSHIFT_GATE_CONFIDENCE and "
                                    "NIGHTSHIFT_GATE_MIN_EFFECT; exit 0 passes, anything else blocks; a JSON object "
                                    "on its last stdout line is kept (estimate, lower, n)")
    confidence: float = setting(0.95, help="the command's one-sided bound on candidate minus serving success is at "
                                           "this confidence (NIGHTSHIFT_GATE_CONFIDENCE)", bounds="[0.5, 1)")
    min_effect: float = setting(0.0, help="that bound must be above this, in success points (0: better with "
                                          "confidence; -0.02: at most two points worse; NIGHTSHIFT_GATE_MIN_EFFECT)",
                                bounds="(-1, 1)")
    timeout: float = setting(3600.0, help="seconds the command may take", bounds="(0, inf)", metavar="DURATION")


@dataclass
class GateDecision:
    passed: bool
    reason: str
    candidate: str
    published: str | None
    metric: str = METRIC
    candidate_metrics: dict = field(default_factory=dict)
    published_metrics: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # signal -> {"decisive", "passed", "detail"}
    command: dict | None = None
    time: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    def lines(self) -> list[str]:
        out = [f"gate: {'PASSED' if self.passed else 'BLOCKED'}: {self.reason}"]
        vs = f"published {Path(self.published).name}" if self.published else "the base model"
        for name, c in self.checks.items():
            verdict = ("ok" if c["passed"] else "FAILED") if c["decisive"] else "reported"
            out.append(f"  {name} [{verdict}]: {c['detail']} (candidate vs {vs})")
        if self.command:
            out.append(f"  your evaluation command {command_verdict(self.command)} ({command_how(self.command)}): "
                       f"{self.command.get('said') or self.command.get('summary', '')}")
        return out


# --- held-out data ----------------------------------------------------------------------


def state_key(row: dict, errored: bool = False) -> tuple:
    """Calls in 'the same or a similar state': the same agent at the same point of
    the same kind of conversation (roles in order, tools already called), and on
    the same side of a tool error (`errored`: an earlier call of its trajectory
    came back as one). Without that bit a call after an error was paired with a
    call after a success that has the same turns: two states, where the
    comparison of likelihood changes says little, and where sft's anchor moves
    one on purpose (it read 0.79 against 1.0 without the anchor on one candidate)."""
    shape = tuple((m.get("role"), tuple(tc.get("name") for tc in m.get("tool_calls") or []))
                  for m in row.get("input_messages") or [])
    return (row.get("agent_name") or "", shape, errored)


def well_formed(row: dict, fallback: list[dict] | None = None) -> bool:
    """Whether a logged action is a choice at all: tool calls of offered tools, or
    text with no broken tool-call markup. Malformed actions are the generation
    check's business; left in the ranking they swamp it (a candidate that got
    sharper on any well-formed output ranks every garbage row down)."""
    from nightshift.trainer.render import tools_of

    out = row.get("output_message") or {}
    calls = out.get("tool_calls") or []
    if calls:
        offered = {(t.get("function") or t).get("name") for t in tools_of(row) or fallback or []}
        return all(c.get("name") in offered for c in calls)
    text = out.get("content") or ""
    return bool(text.strip()) and "tool_call>" not in text


def ranking_pairs(examples: list, max_pairs: int, fallback: list[dict] | None = None) -> list[tuple[int, int]]:
    """(better, worse) index pairs of well-formed actions within a state key (a
    tool error read from the transform's flags on the examples' own trajectories),
    rewards differing; a deterministic sample of at most `max_pairs`."""
    from nightshift.trainer.algorithms.sft import after_tool_error

    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (e, errored) in enumerate(zip(examples, after_tool_error(examples))):
        if e.row.get("reward") is not None and math.isfinite(e.row["reward"]) and well_formed(e.row, fallback):
            groups[state_key(e.row, errored)].append(i)
    pairs = [(a, b) if examples[a].row["reward"] > examples[b].row["reward"] else (b, a)
             for idx in groups.values() for k, a in enumerate(idx) for b in idx[k + 1:]
             if examples[a].row["reward"] != examples[b].row["reward"]]
    if len(pairs) > max_pairs:
        key = lambda p: hashlib.blake2b(f"{p[0]}:{p[1]}".encode(), digest_size=8).digest()  # noqa: E731
        pairs = sorted(pairs, key=key)[:max_pairs]
    return pairs


def lower_bound(hits: list[float], pairs: list[tuple[int, int]], trajectories: list[str], confidence: float,
                draws: int = 400) -> float:
    """The lower `confidence` bound of the mean of `hits` over `pairs`, by a
    bootstrap over trajectories (pairs share rows and rows share trajectories,
    so pairs are not independent draws): each resample weighs a pair by how
    often both its trajectories were drawn."""
    import numpy as np

    ids = {t: i for i, t in enumerate(dict.fromkeys(trajectories))}
    ta = np.array([ids[trajectories[a]] for a, _ in pairs])
    tb = np.array([ids[trajectories[b]] for _, b in pairs])
    h = np.asarray(hits)
    rng = np.random.default_rng(0)
    counts = rng.multinomial(len(ids), np.full(len(ids), 1.0 / len(ids)), size=draws).astype(float)
    w = counts[:, ta] * counts[:, tb]
    total = w.sum(axis=1)
    means = (w @ h)[total > 0] / total[total > 0]
    return float(np.quantile(means, 1.0 - confidence)) if means.size else 0.0


# --- scoring one model --------------------------------------------------------------------


def _mean_logps(model, features: list[dict], pad_id: int, plan) -> list[float]:
    """Each row's mean completion log-prob, in `features`' order. Rows go through the
    model as the trainer's held-out evaluation sends them: binned by length into
    micro-batches of the run plan's tokens, packed as it packs (a fixed number of
    rows per batch was 8 x 16k tokens on long agent calls, beyond what a 7B model
    had fitted in training), the head chunked (trainer/logprobs.py)."""
    import torch

    from nightshift.trainer.batching import micro_batches
    from nightshift.trainer.logprobs import completion_logprobs
    from nightshift.trainer.loop import collate, to_device, uses_boundaries

    out = [math.nan] * len(features)
    groups = micro_batches([len(f["input_ids"]) for f in features], plan.micro_batch_tokens, packed=plan.packed,
                           seed=0) if features else []
    with torch.no_grad():
        for idx in groups:
            chunk = [features[i] for i in idx]
            batch = to_device(collate(chunk, pad_id, plan.packed, uses_boundaries(plan)), plan.device)
            logp = completion_logprobs(model, batch).float()
            seq = batch["tok_seq"]
            n = torch.zeros(len(chunk), device=logp.device).index_add(0, seq, torch.ones_like(logp))
            means = torch.zeros(len(chunk), device=logp.device).index_add(0, seq, logp) / n.clamp(min=1)
            for i, m in zip(idx, means.tolist()):
                out[i] = m
    return out


def valid_output(text: str, tools: list[dict] | None) -> bool:
    """A valid tool call (every `<tool_call>` block JSON with an offered tool's name
    and its required arguments) or clean text (non-empty, no tool-call markup)."""
    from nightshift.trainer.render import parse_tool_calls

    content, calls = parse_tool_calls(text)
    if not calls:
        return bool(text.strip()) and "<tool_call>" not in text and "</tool_call>" not in text
    if text.count("<tool_call>") != len(calls) or (content and "<tool_call>" in content):
        return False  # a block that did not parse
    offered = {(t.get("function") or t).get("name"): (t.get("function") or t) for t in tools or []}
    for c in calls:
        spec = offered.get(c["function"]["name"])
        if spec is None:
            return False
        try:
            args = json.loads(c["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            return False
        required = (spec.get("parameters") or {}).get("required") or []
        if not isinstance(args, dict) or any(r not in args for r in required):
            return False
    return True


def _generate(model, tok, prompts: list[tuple[list[int], float]], max_tokens: int) -> list[tuple[str, bool]]:
    """Each prompt sampled once at its temperature with a seed of its own (the same
    for every model: common random numbers make the comparison tight); returns
    (text without the end token, ended by itself)."""
    import torch

    device = next(model.parameters()).device
    eos = tok.eos_token_id
    out = []
    with torch.no_grad():
        for i, (ids, temp) in enumerate(prompts):
            torch.manual_seed(1_000_003 + i)
            kw = dict(do_sample=True, temperature=temp, top_p=1.0, top_k=0) if temp > 0 else dict(do_sample=False)
            gen = model.generate(input_ids=torch.tensor([ids], device=device), max_new_tokens=max_tokens,
                                 pad_token_id=tok.pad_token_id, eos_token_id=eos, **kw)[0, len(ids):].tolist()
            ended = bool(gen) and gen[-1] == eos
            out.append((tok.decode(gen[:-1] if ended else gen, skip_special_tokens=False), ended))
    return out


#: Characters of a sample the gate log keeps.
SHOWN = 200
#: Samples where only the candidate broke that the gate log keeps.
BROKE_KEPT = 5


def asked(row: dict) -> str:
    """The prompt's last message, short: where a broken sample was produced. The
    generation check's share alone does not say whether a candidate broke
    everywhere or in one kind of state it never trained on (sft-s2 v0001: 10 of
    its 12 broken samples came after a tool error, a state no rewarded row holds),
    and finding that out took a re-run of the check."""
    last = (row.get("input_messages") or [{}])[-1]
    return f"{last.get('role') or '?'}: {(last.get('content') or '')[:80]}"


def _score(cfg: TrainConfig, folder: str | None, tok, features: list[dict], prompts, tools, settings, plan) -> dict:
    from nightshift.trainer.model import load_version

    model = load_version(cfg, folder, plan).to(plan.device).eval()
    out: dict = {"mean_logp": _mean_logps(model, features, tok.pad_token_id, plan)}
    if prompts:
        samples = _generate(model, tok, prompts, settings.max_tokens)
        out["valid"] = [ended and valid_output(text, t) for (text, ended), t in zip(samples, tools)]
        out["first_sample"] = samples[0][0][:200]
        out["samples"] = [text[:SHOWN] + ("" if ended else " [cut at max_tokens]") for text, ended in samples]
    del model
    return out


# --- the decision -------------------------------------------------------------------------


#: The evaluation command's contract: exit 0 passes the candidate, exit 1 says no
#: (a verdict, its last output lines the reason); any other code, a signal or the
#: timeout is the check failing, which also holds the candidate back but is no
#: opinion of it, and the report must not read as one (or the other way round: a
#: team's "no" reported as a broken command sends someone debugging a working check).
SAID_NO = 1


def command_verdict(command: dict) -> str:
    """`passed`, `said no` or `failed`, from a command result (older gate-log entries
    have no `verdict`: their exit code says it)."""
    if command.get("verdict") in ("passed", "said no", "failed"):
        return command["verdict"]
    code = command.get("exit")
    return "passed" if code == 0 else "said no" if code == SAID_NO else "failed"


def command_how(command: dict) -> str:
    """How the command ended, in a few words: `exit 1`, `killed by SIGKILL`, `timed out after 60 s`."""
    if command.get("timed_out") or command.get("exit") is None:
        return command.get("summary") if str(command.get("summary", "")).startswith("timed out") else "no exit code"
    code = command["exit"]
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _said(stdout: str, stderr: str, lines: int = 3) -> str:
    """What the command said last: its last non-empty stdout lines, else stderr's."""
    for text in (stdout, stderr):
        said = [line.strip() for line in (text or "").splitlines() if line.strip()][-lines:]
        if said:
            return " / ".join(said)[-500:]
    return "(it printed nothing)"


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def contract_env(settings: GateSettings, candidate: str, published: str | None) -> dict[str, str]:
    """What the command is asked (the module's contract): the tasks' seed, a hash of
    the two versions (each decision its own fresh tasks, the same ones if it is
    run again), the confidence and the minimum effect."""
    seed = int.from_bytes(hashlib.blake2b(f"{os.path.abspath(candidate)}|{published or ''}".encode(),
                                          digest_size=4).digest(), "big") % 2**31
    return {"NIGHTSHIFT_GATE_SEED": str(seed), "NIGHTSHIFT_GATE_CONFIDENCE": repr(settings.confidence),
            "NIGHTSHIFT_GATE_MIN_EFFECT": repr(settings.min_effect)}


def broken_contract(result: dict, settings: GateSettings) -> str:
    """Why a command's pass contradicts its own numbers ('' when it does not): exit 0
    with a stated `lower` that does not clear the minimum effect."""
    said = result.get("result")
    lower = said.get("lower") if isinstance(said, dict) else None
    if result.get("exit") != 0 or not isinstance(lower, (int, float)) or isinstance(lower, bool):
        return ""
    if lower > settings.min_effect:
        return ""
    return (f"it exited 0, but its lower bound {lower:+.3f} is not above gate.min_effect {settings.min_effect:+.3f} "
            "(the contract in judge/gate.py)")


def _command(settings: GateSettings, candidate: str, published: str | None, base: str) -> dict:
    contract = contract_env(settings, candidate, published)
    env = {**os.environ, "NIGHTSHIFT_CANDIDATE": candidate, "NIGHTSHIFT_PUBLISHED": published or "",
           "NIGHTSHIFT_BASE_MODEL": base, **contract}
    try:
        p = subprocess.run(settings.command, shell=True, env=env, capture_output=True, text=True, timeout=settings.timeout)
    except subprocess.TimeoutExpired as e:
        return {"exit": None, "verdict": "failed", "passed": False, "timed_out": True,
                "summary": f"timed out after {settings.timeout:.0f} s",
                "said": _said(_text(e.stdout), _text(e.stderr))}
    code = p.returncode
    result: dict = {"exit": code, "passed": code == 0,
                    "verdict": "passed" if code == 0 else "said no" if code == SAID_NO else "failed",
                    "said": _said(p.stdout, p.stderr)}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        result["result"] = json.loads(last)
    except json.JSONDecodeError:
        pass
    tail = (p.stderr.strip() or p.stdout.strip())[-300:]
    result["summary"] = json.dumps(result.get("result")) if "result" in result else tail
    result["seed"] = int(contract["NIGHTSHIFT_GATE_SEED"])
    broken = broken_contract(result, settings)
    if broken:
        result.update(passed=False, verdict="failed", said=broken)
    return result


def _held_out(cfg: TrainConfig):
    """The held-out examples of the candidate's own window and split, and the run
    plan the trainer would make for them (device, precision, attention, packing,
    max_length and micro-batch tokens): rows longer than its max_length are left
    out as training left them out (train.max_length 0 is the model's own limit,
    not no limit), and scoring fits the memory training fitted."""
    from nightshift.trainer.examples import load_fallback_tools, prepare
    from nightshift.trainer.model import load_tokenizer
    from nightshift.trainer.plan import work_out
    from nightshift.trainer.select import select

    tok = load_tokenizer(cfg)
    plan = work_out(cfg)
    held = prepare(cfg, tok, select(cfg), plan.max_length).eval
    if held:
        plan = plan.fitted(cfg, longest_row=max(len(e.r) for e in held),
                           completion_share=max(len(e.r.completion_ids) / len(e.r) for e in held))
    return tok, held, load_fallback_tools(cfg), plan


def gate(candidate: str, published: str | None, train_cfg: TrainConfig, settings: GateSettings,
         log_dir: str | None = None) -> GateDecision:
    """Decide whether `candidate` (a local version folder) may replace `published`
    (a version folder, or None: the base model is serving)."""
    from nightshift.trainer.checkpoint import read_manifest
    from nightshift.trainer.examples import pg_features
    from nightshift.trainer.render import tools_of
    from nightshift.trainer.select import TrainDataError

    man = read_manifest(candidate)
    cfg = copy.deepcopy(train_cfg)
    cfg.base_model = man.get("base_model") or cfg.base_model
    ds = man.get("dataset", {})
    cfg.select.since, cfg.select.until = ds.get("since") or "", ds.get("until") or ""
    cfg.eval_fraction = man.get("config", {}).get("eval_fraction", cfg.eval_fraction)
    cfg.algorithm = "sft"  # every rated row, whatever the candidate was trained with
    decision = GateDecision(True, "", candidate, published)
    try:
        tok, held, fallback, plan = _held_out(cfg)
    except TrainDataError as e:
        tok, held, fallback, plan = None, [], None, None
        decision.reason = f"no held-out transitions ({e})"
    if held:
        order = sorted(range(len(held)), key=lambda i: hashlib.blake2b(
            held[i].row["transition_id"].encode(), digest_size=8).digest())
        chosen = order[: settings.samples]
        temps = [held[i].row.get("temperature") for i in chosen]
        prompts = [(held[i].r.prompt_ids, 1.0 if t is None else float(t)) for i, t in zip(chosen, temps)]
        tools = [tools_of(held[i].row) or fallback for i in chosen]
        feats = pg_features(held)
        c = _score(cfg, candidate, tok, feats, prompts, tools, settings, plan)
        p = _score(cfg, published, tok, feats, prompts, tools, settings, plan)
        _judge(decision, held, c, p, settings, fallback, [asked(held[i].row) for i in chosen])
    if settings.command:
        decision.command = _command(settings, candidate, published, cfg.base_model)
        verdict = command_verdict(decision.command)
        if verdict == "passed":
            decision.reason += "; the evaluation command passed"
        else:
            decision.passed = False
            decision.reason += (f"; the evaluation command {verdict} ({command_how(decision.command)}): "
                                f"{decision.command['said']}")
    decision.reason = decision.reason.lstrip("; ") or "nothing to compare on"
    if log_dir:
        gatelog.append(log_dir, asdict(decision))
    log.info("gate %s: %s", "passed" if decision.passed else "blocked", decision.reason)
    return decision


def paired_upper_bound(candidate: list, serving: list, confidence: float) -> float:
    """One-sided upper bound of mean(candidate - serving) over paired 0/1 outcomes
    (the same prompt, the same seed), from the discordant pairs: a Wald bound
    with the variance floored at one discordant pair, so that a handful of
    samples with no disagreement does not read as certainty."""
    n = min(len(candidate), len(serving))
    if n == 0:
        return 0.0
    d = [float(a) - float(b) for a, b in zip(candidate, serving)]
    mean = sum(d) / n
    var = max(sum(x * x for x in d) / n - mean * mean, 1.0 / n)
    return mean + NormalDist().inv_cdf(confidence) * math.sqrt(var / n)


def _judge(decision: GateDecision, held: list, c: dict, p: dict, settings: GateSettings,
           fallback: list[dict] | None = None, prompts_asked: list[str] | None = None) -> None:
    """Fill the decision from both models' scores (`prompts_asked`: each sampled
    prompt's last message, `asked`, so the log shows where the candidate broke)."""
    pairs = ranking_pairs(held, settings.max_pairs, fallback)
    reasons, failed = [], []
    for who, scores, metrics in (("candidate", c, decision.candidate_metrics), ("published", p, decision.published_metrics)):
        lp = scores["mean_logp"]
        metrics["rows"] = len(held)
        metrics["pairs"] = len(pairs)
        if pairs:
            metrics["raw_ranking"] = sum(lp[a] > lp[b] for a, b in pairs) / len(pairs)
        good = [i for i, e in enumerate(held) if (e.row.get("reward") or 0) > 0]
        if good:
            metrics["nll_rewarded"] = -sum(lp[i] for i in good) / len(good)
        if "valid" in scores:
            metrics["valid_share"] = sum(scores["valid"]) / len(scores["valid"])
            metrics["samples"] = len(scores["valid"])
            metrics["first_sample"] = scores["first_sample"]
    cm, pm = decision.candidate_metrics, decision.published_metrics
    if pairs:
        d = [a - b for a, b in zip(c["mean_logp"], p["mean_logp"])]
        hits = [1.0 if d[a] > d[b] else 0.5 if d[a] == d[b] else 0.0 for a, b in pairs]
        acc = sum(hits) / len(pairs)
        low = lower_bound(hits, pairs, [e.row["trajectory_id"] for e in held], settings.ranking_confidence)
        cm["ranking_accuracy"], pm["ranking_accuracy"], cm["ranking_lower_bound"] = acc, 0.5, low
        decisive = len(pairs) >= settings.min_pairs
        ok = low >= 0.5 - settings.ranking_margin
        decision.checks["ranking"] = {
            "decisive": decisive, "passed": ok,
            "detail": f"moved the rewarded action up more than the failed one in {100 * acc:.1f} % of {len(pairs)} "
                      f"held-out pairs, {100 * settings.ranking_confidence:.0f} % lower bound {100 * low:.1f} % "
                      f"(50 % = no change; margin {100 * settings.ranking_margin:.0f} points; raw likelihood ranking "
                      f"{100 * cm['raw_ranking']:.1f} % vs {100 * pm['raw_ranking']:.1f} %)"
                      + ("" if decisive else f"; fewer than gate.min_pairs={settings.min_pairs}: not decisive")}
        if decisive and not ok:
            failed.append("ranks rewarded actions worse" if acc < 0.5 else
                          "not convinced it ranks rewarded actions no worse (too few or too noisy held-out pairs)")
        elif decisive:
            reasons.append("ranks rewarded actions " + ("better" if low > 0.5 else "no worse than the margin"))
    else:
        decision.checks["ranking"] = {"decisive": False, "passed": True,
                                      "detail": "no held-out pairs of calls in a similar state with different rewards"}
    if "valid_share" in cm:
        upper = paired_upper_bound(c["valid"], p["valid"], settings.validity_confidence)
        cm["valid_fall_upper"] = upper
        ok = upper >= -settings.validity_margin
        decision.checks["generation"] = {
            "decisive": True, "passed": ok,
            "detail": f"{100 * cm['valid_share']:.1f} % of {cm['samples']} sampled outputs valid (tool call or text) vs "
                      f"{100 * pm['valid_share']:.1f} % on the same prompts, "
                      f"{100 * settings.validity_confidence:.0f} % upper bound of the difference "
                      f"{100 * upper:+.1f} points (blocks below -{100 * settings.validity_margin:.0f})"}
        broke = [k for k, (a, b) in enumerate(zip(c["valid"], p["valid"])) if b and not a]
        if broke and "samples" in c and "samples" in p:
            cm["broke"] = [{"after": prompts_asked[k] if prompts_asked else "", "candidate": c["samples"][k],
                            "serving": p["samples"][k]} for k in broke[:BROKE_KEPT]]
            first = cm["broke"][0]
            roles = Counter(prompts_asked[k].split(":", 1)[0] for k in broke) if prompts_asked else Counter()
            where = ", ".join(f"{n} after a {r} message" for r, n in roles.most_common())
            decision.checks["generation"]["detail"] += (
                f"; {len(broke)} where only the candidate's was not" + (f" ({where})" if where else "") + ", e.g. "
                + (f"after {first['after']!r}: " if first["after"] else "") + f"{first['candidate'][:80]!r}")
        (reasons if ok else failed).append("valid outputs held" if ok else "breaks the output format")
    if "nll_rewarded" in cm and "nll_rewarded" in pm:
        decision.checks["nll of rewarded calls"] = {
            "decisive": False, "passed": True,
            "detail": f"{cm['nll_rewarded']:.4f} vs {pm['nll_rewarded']:.4f} per token"}
    decision.passed = not failed
    decision.reason = "; ".join(failed or reasons) or "no decisive offline signal"
