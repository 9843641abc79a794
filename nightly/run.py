"""`nightshift nightly`: build → train → gate → publish → report, once a night,
from a scheduler (cron, a systemd timer, a Kubernetes CronJob).

A lock keeps two runs from proceeding at once. A state file records the run and
the stage it reached, written after each stage's work; a run that dies anywhere
is resumed by the next invocation from that stage, and every stage is safe to
repeat: the build rewrites the same partitions, training resumes its trainer
checkpoint or finds the version it already wrote (tagged with the run id),
the gate recomputes, and publishing skips what is already loaded and
registered. Nothing is published twice.

Exit codes: 0 done (published, held back by the gate, a canary the routing
proxy could not take, or nothing new: the report says which); 1 a stage failed
(the next run resumes it); 2 bad settings, a state file this job cannot
resume from, or a dataset this version cannot read (schemas/layout.py); 75 another nightly run holds the lock (EX_TEMPFAIL: try later).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import fcntl
import json
import logging
import os
import signal
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from nightshift.publish import registry
from nightshift.judge.gatelog import append_line
from nightshift.schemas.layout import LayoutError
from nightshift.settings import invalid, setting, validate
from nightshift.storage import write_atomic
from nightshift.trainer.checkpoint import is_local, read_manifest, versions
from nightshift.trainer.config import TrainConfig
from nightshift.judge.gate import GateSettings
from nightshift.publish.canary import CanarySettings
from nightshift.publish.publish import PublishSettings, RouteUnavailable
from nightshift.judge.watch import WatchSettings

from . import experiments, window
from .experiments import KINDS, PromptTrialSettings

log = logging.getLogger("nightshift.nightly")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_LOCKED = 0, 1, 2, 75
STAGES = ("build", "prompts", "train", "gate", "publish", "fallback", "report", "done")
FAULT_ENV = "NIGHTSHIFT_FAULT_KILL_AFTER"  # fault injection for tests and drills: SIGKILL after a stage's work


@dataclass
class NightlyConfig(PublishSettings):
    """The job's settings: its own from YAML section `nightly:`, and the publishing
    settings (`PublishSettings`: `vllm_url`, `name`, `stable_name`, `adapter_root`,
    `keep`, `mode`, ...; the base model for `mode: full` is `train.base_model`)
    from their own section `publish:`, which publish, rollback and watch read too
    (loaded with `publish.MOVED`: given under `nightly:`, their old place, they
    still work, with a note)."""

    init_from_published: bool = setting(True, help="continue training the serving adapter rather than start from "
                                                   "the base")
    train_window_days: int = setting(0, help="0 trains on what the serving adapter has not learned: the data since "
                                             "the night that trained it (less overlap_days, for trajectories that "
                                             "settled after it), however many nights since trained nothing or a "
                                             "version that never served; all of it when training starts from the "
                                             "base; N on the last N days",
                                     bounds="[0, inf)")
    overlap_days: int = setting(1, help="days before the serving adapter's last day of data that a window of 0 "
                                        "takes in again",
                                bounds="[0, inf)")
    publish: bool = setting(True, help="publish a candidate the gate passes (false stops after the gate)")
    state_dir: str = setting("", help="the run state and lock (default <train.output>/.nightly)", metavar="DIR")
    reports: str = setting("", help="where reports go (default <train.output>/reports)", metavar="DIR")
    gate: GateSettings = setting(factory=GateSettings, help="the gate")
    watch: WatchSettings = setting(factory=WatchSettings, help="the production watch")
    canary: CanarySettings = setting(factory=CanarySettings, help="canary publishing")
    experiments: str = setting("weights", help="what every agent gets: weights (train the team's model), prompts "
                                               "(optimize its prompt: agents on hosted models), both, or off",
                               choices=KINDS)
    agents: dict = setting(factory=dict, help="per agent, overriding experiments: {agent: weights|prompts|both|off}")
    prompts: PromptTrialSettings = setting(factory=PromptTrialSettings, help="prompt canaries")

    def rules(self) -> None:
        for agent, kind in self.agents.items():
            if kind not in KINDS:
                raise invalid(f"agents.{agent}", f"must be one of {', '.join(KINDS)}, got {str(kind)[:40]!r}")
        if self.canary.share > 0:
            if not self.canary.route_url:
                raise invalid("canary.route_url", "canary.share > 0 needs the routing proxy's address (nightshift "
                                                  "route), which the agents' base URL points at")
            if not self.stable_name:
                raise invalid("stable_name", "canary publishing needs a stable_name: the name the agents ask for, "
                                             "which the proxy routes")
            if self.keep < 2:
                raise invalid("keep", "canary publishing keeps the serving version and the candidate loaded: keep >= 2")
            if self.mode != "lora":
                raise invalid("mode", "a canary is an adapter loaded beside the serving one: canary publishing needs "
                                      "mode lora (full weights replace what serves for every conversation)")

    def check(self) -> None:
        validate(self, "nightly")


class Locked(RuntimeError):
    pass


@contextmanager
def run_lock(state_dir: Path):
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "nightly.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            raise Locked(f"another nightly run holds {state_dir / 'nightly.lock'} (pid {holder or '?'})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock; a killed process releases it too


def _save(state_dir: Path, state: dict) -> None:
    write_atomic(state_dir / "state.json", json.dumps(state, indent=2, default=str))


class StateError(ValueError):
    """The run state cannot be read: the message names the file and what is wrong."""


def _load(state_dir: Path) -> dict | None:
    """The last run's state, checked: resuming from a state that is not what this
    job wrote could skip a stage or publish twice, so one it cannot read is refused
    with what is wrong and what to do, and nothing runs."""
    p = state_dir / "state.json"
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StateError(f"{p} cannot be read ({e.strerror or e})") from None
    try:
        state = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        why = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else "is not JSON"
        raise StateError(f"{p} {why}: move it aside to start a fresh run (nothing was run)") from None
    why = state_problem(state)
    if why:
        raise StateError(f"{p} {why}: move it aside to start a fresh run (nothing was run)")
    return state


def state_problem(state) -> str | None:
    """Why a run state cannot be resumed from (None: it can)."""
    if not isinstance(state, dict):
        return "does not hold a run's state (a JSON object)"
    if not isinstance(state.get("run_id"), str) or not state["run_id"]:
        return "has no run_id"
    if state.get("stage") not in STAGES:
        return f"has stage {str(state.get('stage'))[:40]!r} (known: {', '.join(STAGES)})"
    for key in ("run_date", "since"):
        value = state.get(key)
        if value in (None, ""):
            continue
        try:
            dt.date.fromisoformat(value)
        except (TypeError, ValueError):
            return f"has {key} {str(value)[:40]!r}, not a date (YYYY-MM-DD)"
    if not isinstance(state.get("resumed", 0), int) or isinstance(state.get("resumed"), bool) or state.get(
            "resumed", 0) < 0:
        return "has a 'resumed' count that is not a whole number"
    if state.get("version") is not None and (not isinstance(state["version"], str) or "/" in state["version"]):
        return "has a 'version' that is not a version folder's name"
    for key in ("window", "init_adapter"):
        if state.get(key) is not None and not isinstance(state[key], str):
            return f"has {key!r} that is not text"
    for key in ("build", "watch", "train", "gate_lines", "publish_lines", "versions", "prompt_watch", "prompts",
                "prompt_versions", "deferred"):
        value = state.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(x, str) for x in value)):
            return f"has {key!r} that is not a list of lines"
    for key in ("gate",):
        if state.get(key) is not None and not isinstance(state[key], dict):
            return f"has {key!r} that is not an object"
    if state.get("stage") in ("gate", "publish") and not state.get("version"):
        return f"is at stage {state['stage']} with no version to {state['stage']}"
    return None


def _fault(stage: str) -> None:
    if os.environ.get(FAULT_ENV) == stage:
        log.warning("fault injection: killing this run after the %s stage's work (%s=%s)", stage, FAULT_ENV, stage)
        os.kill(os.getpid(), signal.SIGKILL)


def _serving(checkpoints: str, n: NightlyConfig) -> dict | None:
    """The registry entry now serving this name on this endpoint."""
    return registry.serving(registry.read(checkpoints), n.vllm_url, n.name)


def _canary(checkpoints: str, n: NightlyConfig) -> dict | None:
    """The canary running for this name on this endpoint, if one is."""
    return registry.canary(registry.read(checkpoints), n.vllm_url, n.name)


def _watch(data: str, checkpoints: str, n: NightlyConfig) -> list[str]:
    """The production watch, before training starts from what serves: a version
    that turned out worse is rolled back first, a canary stopped or promoted.
    Never stops the night: a failed watch is reported and the version stays."""
    from nightshift.judge.watch import watch

    try:
        _, out = watch(data, checkpoints, n, n.watch, n.canary)
    except Exception as e:  # noqa: BLE001 - the server down, a registry unreadable: said, not fatal
        log.warning("production watch failed: %s", e)
        return [f"watch failed: {e}"]
    return out


def _version_tagged(checkpoints: str, tag: str) -> str | None:
    for v in reversed(versions(checkpoints)):
        if read_manifest(f"{checkpoints.rstrip('/')}/{v}").get("config", {}).get("tag") == tag:
            return v
    return None


def run(transform_cfg, train_cfg: TrainConfig, n: NightlyConfig, now: dt.datetime | None = None,
        progress: bool = False, apo_cfg=None, retention_cfg=None, compaction_cfg=None) -> tuple[int, dict]:
    """One nightly run (or the rest of an interrupted one). Returns (exit code, state).
    `apo_cfg`: the `apo:` settings (`prompts.config.ApoConfig`) for the agents on
    prompt optimization; its defaults, on the transform's data, when not given.
    `retention_cfg`: the `retention:` settings (`transform.retention.RetentionConfig`);
    with `days` set, the lake is pruned to them before the build. `compaction_cfg`:
    the `compaction:` settings (`transform.compaction.CompactionConfig`, its defaults
    when not given: the small files of past dates merged before the build)."""
    checkpoints = train_cfg.output.rstrip("/")
    if not is_local(checkpoints):
        raise ValueError("nightly keeps its state and lock beside the checkpoints: train.output must be a local folder "
                         "(put the checkpoints on a shared volume, or publish from a synced copy)")
    state_dir = Path(n.state_dir or f"{checkpoints}/.nightly")
    reports = Path(n.reports or f"{checkpoints}/reports")
    now = now or dt.datetime.now(dt.timezone.utc)
    try:
        with run_lock(state_dir):
            return _run_locked(transform_cfg, train_cfg, n, checkpoints, state_dir, reports, now, progress,
                               _apo(apo_cfg, transform_cfg), retention_cfg, compaction_cfg)
    except Locked as e:
        log.warning("%s: not running", e)
        return EXIT_LOCKED, {"outcome": str(e)}


def _apo(apo_cfg, transform_cfg):
    from nightshift.prompts.config import ApoConfig

    if apo_cfg is None:
        apo_cfg = ApoConfig()
        apo_cfg.data, apo_cfg.storage_options = transform_cfg.data, dict(transform_cfg.storage_options)
    return apo_cfg


def _prompting(n: NightlyConfig) -> bool:
    return experiments.wants(n.experiments, "prompts") or any(experiments.wants(str(k), "prompts")
                                                               for k in n.agents.values())


def _watch_prompts(data: str, store: str, checkpoints: str, n: NightlyConfig) -> list[str]:
    """The prompt canaries' watch: judged like the adapter's, never stops the night."""
    from nightshift.judge.prompt_watch import watch_prompts
    from nightshift.publish import prompt_canary

    try:  # a prompt change a killed process left half-done is settled before the look
        done = prompt_canary.reconcile(store, n.canary.route_token)
        _, out = watch_prompts(data, store, n.watch, n.canary, checkpoints=checkpoints)
        out = done + out
    except Exception as e:  # noqa: BLE001 - a record unreadable, the route down: said, not fatal
        log.warning("prompt watch failed: %s", e)
        return [f"prompt watch failed: {e}"]
    return out


def _prompt_table(apo_cfg):
    """Every agent's prompt versions and "", or None and why, in a sentence for the
    report (returned, not added to the state: a stage resumed after a failure says
    it once)."""
    from nightshift.prompts.versions import by_agent

    try:
        return by_agent(apo_cfg.data, apo_cfg.since, apo_cfg.storage_options,
                        min_trajectories=apo_cfg.min_trajectories), ""
    except Exception as e:  # noqa: BLE001 - no transitions yet, a lake it cannot read: said, not fatal
        return None, f"prompt optimization: the prompt versions could not be read: {e}"


def _prompt_stage(n: NightlyConfig, apo_cfg, checkpoints: str, state: dict) -> None:
    """Prompt optimization for the agents on it, and reward by prompt version for the
    report. An agent on `both` whose turn tonight is the adapter's waits, named in
    `state["deferred"]`: saved with the stage, the decision outlives a crash, and
    the fallback stage gives it its prompt round if the adapter has nothing to try."""
    from nightshift.prompts.versions import lines

    table, why = _prompt_table(apo_cfg)
    if table is None:
        state["prompts"] = [why]
        return
    state["prompt_versions"] = lines(table, apo_cfg.min_trajectories)
    trial = _canary(checkpoints, n) if n.publish else None
    tonight = experiments.turns([a.agent for a in table], n.experiments, n.agents, apo_cfg.store(),
                                registry.read(checkpoints), n.vllm_url, n.name, trial)
    state["deferred"] = sorted(a for a, t in tonight.items() if t.kind == "weights")
    out = experiments.optimize_prompts(apo_cfg, table, n.experiments, n.agents, n.canary.route_url,
                                       n.canary.route_token, n.prompts.share, trial, tonight)
    started = {a for a in tonight if any(x.startswith(f"{a}: prompt candidate ") and "% of its conversations" in x
                                    for x in out)}
    out += [f"{a}: the prompt's turn had nothing to try tonight: the adapter may go instead"
            for a, t in sorted(tonight.items()) if t.kind == "prompts" and a not in started]
    state["prompts"] = out


def _prompt_fallback(n: NightlyConfig, apo_cfg, checkpoints: str, state: dict) -> None:
    """The agents that waited for the adapter's turn get their prompt round when the
    adapter had nothing to try tonight (nothing to train on, the gate held it, a
    prompt canary on another agent held it, the route refused it)."""
    waited = state.get("deferred") or []
    if not waited or state.get("published"):
        return
    why = state.get("outcome") or "no adapter was published"
    said = [f"{a}: the adapter had nothing to try tonight ({why}): the prompt goes instead" for a in waited]
    table, unread = _prompt_table(apo_cfg)
    if table is None:
        said.append(unread)
    else:
        said += experiments.optimize_prompts(apo_cfg, table, n.experiments, n.agents, n.canary.route_url,
                                             n.canary.route_token, n.prompts.share, _canary(checkpoints, n),
                                             only=waited)
    # added to the state in one step: a failure on the way saves it as it was, and the resumed stage says it once
    state["prompts"] = [*state.get("prompts", []), *said]


def _prune(transform_cfg, retention_cfg, n: NightlyConfig, now: dt.datetime) -> list[str]:
    """The lake pruned to its retention before the build (transform/retention.py), in
    the report's words. One that cannot run tonight (a build by hand holds the lake, a
    partition named with no date) is said and retried the next night: it never stops
    the build. A crash part way is finished by the next run (each step is repeatable)."""
    from nightshift.transform.retention import RetentionError, prune

    days = retention_cfg.days if retention_cfg is not None else 0
    if days <= 0:
        return []
    try:
        lines = prune(transform_cfg.data, days, now=now, storage_options=transform_cfg.storage_options).lines()
    except RetentionError as e:
        log.warning("retention: %s", e)
        return [f"retention: not pruned tonight: {e}"]
    if n.train_window_days > days:
        lines.append(f"  nightly.train_window_days {n.train_window_days} reaches past the {days} day(s) kept: training "
                     f"sees {days} day(s) besides today")
    return lines


def _compact(transform_cfg, compaction_cfg, now: dt.datetime) -> list[str]:
    """The small files of past dates merged before the build (transform/compaction.py).
    A failure is said and left to the next night: the build reads the files as they
    are (a merge a crash stopped leaves every row readable, and the next run finishes it)."""
    from nightshift.transform.compaction import compact
    from nightshift.transform.config import CompactionConfig
    from nightshift.transform.output import Busy

    how = compaction_cfg if compaction_cfg is not None else CompactionConfig()
    if not how.enabled:
        return []
    try:
        result = compact(transform_cfg.data, target_bytes=how.target_bytes, before=now.astimezone(dt.timezone.utc).date(),
                         storage_options=transform_cfg.storage_options)
    except (Busy, OSError, ValueError) as e:
        log.warning("compaction: %s", e)
        return [f"compaction: not done tonight: {e}"]
    return result.lines() if any(result.dates.values()) or result.finished else []


def _run_locked(transform_cfg, train_cfg, n, checkpoints, state_dir, reports, now, progress,
                apo_cfg, retention_cfg=None, compaction_cfg=None) -> tuple[int, dict]:
    from nightshift.transform.build import BuildError, build

    from nightshift.judge.gate import gate
    from nightshift.publish.publish import publish
    from nightshift.trainer.run import train
    from nightshift.trainer.select import TrainDataError

    prev = _load(state_dir)
    if prev is None or prev.get("stage") == "done":
        # the training window is decided in the train stage, from the adapter training continues (window.py)
        state = {"run_id": now.isoformat(timespec="seconds"), "run_date": now.date().isoformat(), "stage": "build",
                 "resumed": 0}
        log.info("nightly run %s: building", state["run_id"])
    else:
        state = prev
        state.pop("error", None)
        state.pop("traceback", None)
        state["resumed"] = state.get("resumed", 0) + 1
        log.warning("resuming nightly run %s at stage %s (attempt %d)", state["run_id"], state["stage"],
                    state["resumed"] + 1)
    _save(state_dir, state)
    try:
        if state["stage"] == "build":
            pruned = _prune(transform_cfg, retention_cfg, n, now) + _compact(transform_cfg, compaction_cfg, now)
            tcfg = copy.deepcopy(transform_cfg)
            # only the dates with new or late spans or feedback, however late; `since`
            # still bounds what is trained on
            tcfg.since, tcfg.until, tcfg.incremental = "", "", True
            try:
                summary = build(tcfg, progress=progress)
                state["build"] = [*pruned, *summary.lines()]
                next_stage = "train"
                if not summary.partitions and not state["resumed"]:  # a resumed run's build was done before
                    state["outcome"] = "nothing to build: no new spans or feedback since the last build"
                    next_stage = "report"
            except BuildError as e:
                state["build"] = [*pruned, str(e)]
                state["outcome"] = f"nothing to build: {e}"
                next_stage = "report"
            if n.watch.enabled and n.publish:
                state["watch"] = _watch(transform_cfg.data, checkpoints, n)
                if _prompting(n):
                    state["prompt_watch"] = _watch_prompts(transform_cfg.data, apo_cfg.store(), checkpoints, n)
            _fault("build")
            state["stage"] = "prompts" if next_stage == "train" else next_stage
            _save(state_dir, state)

        if state["stage"] == "prompts":
            if _prompting(n) and n.publish:
                _prompt_stage(n, apo_cfg, checkpoints, state)
            next_stage = "train"
            trial = _canary(checkpoints, n) if n.publish else None
            if not experiments.trains_weights(n.experiments, n.agents):
                state["outcome"] = ("prompt optimization only: no agent is on weight training (nightly.experiments, "
                                    "nightly.agents)")
                next_stage = "report"
            elif trial is not None:
                # one experiment at a time: a new candidate would be judged against a moving target
                state["outcome"] = (f"canary {trial['version']} is still being judged (see the watch): no new "
                                    "candidate tonight")
                next_stage = "report"
            else:
                # an adapter that could not be published tonight is not trained: the next night's trains
                # on these logs too (its window starts where the serving adapter's data ended: window.py)
                held = experiments.weights_held_by(apo_cfg.store(), n.experiments, n.agents) if (
                    n.publish and _prompting(n)) else ""
                if held:
                    state["outcome"] = f"no adapter trained tonight: {held}"
                    next_stage = "fallback"
            _fault("prompts")
            state["stage"] = next_stage
            _save(state_dir, state)

        if state["stage"] == "train":
            tcfg = copy.deepcopy(train_cfg)
            tcfg.tag = state["run_id"]
            if _prompting(n):  # answers a route gave under a prompt candidate train with the prompt they saw
                tcfg.select.seen_prompts = {**experiments.seen_prompts(apo_cfg.store()), **tcfg.select.seen_prompts}
            # decided once, kept in the state: a resumed run trains on the same rows from the same adapter; again
            # only when that adapter no longer serves (rolled back meanwhile: nothing trains from it) and this run
            # has not written its version yet (one it did write is what the gate judges)
            version = _version_tagged(checkpoints, state["run_id"])
            w = window.choose(n, _serving(checkpoints, n), now, tcfg.full_finetune)
            said = []
            if (state.get("window") is not None and not version
                    and (w.init_adapter or None) != state.get("init_adapter")):
                was = (state.get("init_adapter") or "").rstrip("/").rsplit("/", 1)[-1] or "the base model"
                said.append(f"window decided again: {was}, which it continued when this run was interrupted, no "
                            "longer serves")
                state["window"] = None
            if state.get("window") is None:
                state.update(since=w.since, init_adapter=w.init_adapter or None, window=w.why)
                _save(state_dir, state)
            if state.get("since"):
                tcfg.select.since = state["since"]
            if state.get("init_adapter"):
                tcfg.init_adapter = state["init_adapter"]
            said.append(f"window: {state['window']}")
            next_stage = "gate"
            if version:
                log.warning("version %s was already trained by this run before it was interrupted: using it", version)
                state["train"] = [*said, f"reused {version}, trained by this run before an interruption"]
            else:
                try:
                    result = train(tcfg, progress=progress)
                    version = result.version
                    state["train"] = [*said, *result.lines()]
                except TrainDataError as e:
                    state["train"] = [*said, str(e)]
                    state["outcome"] = f"nothing new to train on: {e}"
                    next_stage = "fallback"
            state["version"] = version
            state["init_adapter"] = tcfg.init_adapter or None
            _fault("train")
            state["stage"] = next_stage
            _save(state_dir, state)

        if state["stage"] == "gate":
            candidate = f"{checkpoints}/{state['version']}"
            serving = _serving(checkpoints, n)
            published = serving.get("checkpoint") if serving else None
            if not n.gate.enabled:
                state["gate"] = None
                state["gate_lines"] = ["gate: disabled (nightly.gate.enabled: false)"]
                passed = True
            else:
                decision = gate(candidate, published, train_cfg, n.gate, log_dir=checkpoints)
                state["gate"] = dataclasses.asdict(decision)
                state["gate_lines"] = decision.lines()
                passed = decision.passed
            if not passed:
                state["outcome"] = f"held back by the gate: {state['gate']['reason']}"
            held = (experiments.weights_held_by(apo_cfg.store(), n.experiments, n.agents)
                    if passed and n.publish and _prompting(n) else "")
            if held:
                state["outcome"] = f"trained {state['version']}; the gate passed it; not published: {held}"
                passed = False
            _fault("gate")
            state["stage"] = "publish" if passed and n.publish else "fallback"
            if passed and not n.publish:
                state["outcome"] = f"trained {state['version']}; the gate passed it; publishing is off"
            _save(state_dir, state)

        if state["stage"] == "publish":
            entries = registry.read(checkpoints)
            serving, trial = registry.serving(entries, n.vllm_url, n.name), registry.canary(entries, n.vllm_url, n.name)
            candidate = f"{checkpoints}/{state['version']}"
            if (serving and serving.get("version") == state["version"]
                    or trial and trial.get("version") == state["version"]):
                log.warning("%s is already published (registry): not publishing again", state["version"])
                state["publish_lines"] = [f"{state['version']} was already published before an interruption"]
            elif n.canary.share > 0:
                from nightshift.publish import canary

                try:
                    state["publish_lines"] = canary.start(candidate, checkpoints, n, n.canary,
                                                          train_cfg.served_name())
                except RouteUnavailable as e:
                    # nothing was loaded or recorded: the next night trains afresh rather than wait on the proxy
                    state["publish_lines"] = [str(e)]
                    state["published"] = False
            else:
                result = publish(candidate, n.vllm_url, **{**n.kwargs(), "base_model": n.base_model or train_cfg.base_model})
                state["publish_lines"] = result.lines()
            if state.get("published") is False:
                state["outcome"] = (f"not published: {state['version']} could not start as a canary (the routing "
                                    "proxy could not be used; nothing was loaded or recorded)")
            else:
                state["published"] = True
                state["outcome"] = (f"published {state['version']} as a canary ({100 * n.canary.share:.0f} % of "
                                    "conversations)" if n.canary.share > 0 else f"published {state['version']}")
            _fault("publish")
            state["stage"] = "fallback"
            _save(state_dir, state)

        if state["stage"] == "fallback":
            if n.publish and _prompting(n):
                _prompt_fallback(n, apo_cfg, checkpoints, state)
            state["stage"] = "report"
            _save(state_dir, state)

        if state["stage"] == "report":
            from . import report

            hist_path = state_dir / "runs.jsonl"
            history = report.read_history(hist_path)
            if not any(h["run_id"] == state["run_id"] for h in history):
                entry = report.history_entry(state)
                append_line(hist_path, entry)
                history.append(entry)
            state["versions"] = report.versions_lines(transform_cfg.data, checkpoints=checkpoints)
            md, png = report.write(state, history, transform_cfg.data, reports, checkpoints=checkpoints)
            state["report"] = str(md)
            state["plot"] = str(png)
            state["stage"] = "done"
            _save(state_dir, state)
            log.info("nightly run %s: %s (report %s)", state["run_id"], state.get("outcome"), md)
        return EXIT_OK, state
    except LayoutError:  # a dataset this version cannot read: its sentence and exit 2 (cli); resumed here next run
        _save(state_dir, state)
        raise
    except Exception as e:  # noqa: BLE001 - any stage failure: keep the state, say what broke, exit 1
        state["error"] = f"{type(e).__name__}: {e}"
        state["traceback"] = traceback.format_exc()[-4000:]
        _save(state_dir, state)
        log.error("nightly run %s failed at stage %s: %s (the next run resumes there)", state["run_id"],
                  state["stage"], state["error"])
        return EXIT_FAILED, state
