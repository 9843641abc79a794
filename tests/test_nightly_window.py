"""The training window after nights that did not train (issue 27): `train_window_days: 0`
trains on what the serving adapter has not learned, however many nights since trained
nothing (a prompt canary held the adapter back) or trained a version that never served
(the gate blocked it, publishing was off). Before, the window started at the night
before tonight, and the logs of such nights were never trained on again.

A history of nights of the real job (spans built into transitions, the real state
file, the registry, the prompt trials record), in which the trainer is the real row
selection (`trainer.select.select`) and a version folder written with the real
commit: the rows each night selects are what is asserted, not a model, so no model
loads. The gate and the publication are stand-ins that say what the history needs
(pass or block; an entry in the registry as `publish` writes it). A few seconds."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re

import pytest

from traces import T0, Trace, genai_call, write_spans

from nightshift.judge import gate as gate_mod
from nightshift.judge.gate import GateDecision
from nightshift.judge.watch import WatchSettings
from nightshift.nightly.run import EXIT_FAILED, NightlyConfig, run
from nightshift.prompts.config import ApoConfig
from nightshift.publish import prompt_canary as trials
from nightshift.publish import publish as publish_mod
from nightshift.publish import registry
from nightshift.trainer import checkpoint as ckpt
from nightshift.trainer import run as train_mod
from nightshift.trainer.config import TrainConfig
from nightshift.trainer.select import select
from nightshift.transform.config import TransformConfig

URL, NAME = "http://127.0.0.1:9", "agent"
DAY0 = dt.datetime.fromtimestamp(T0 / 1e9, dt.timezone.utc).replace(hour=0, minute=0, second=0)
NIGHT_NS = 86_400 * 10**9


def _night_spans(data, night: int, n: int = 4) -> None:
    """`n` rated runs of one agent on day `night`, each asking a question that names its night."""
    traces = []
    for i in range(n):
        t = Trace(f"night{night}-{i}")
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=0, end=10)
        t.span("chat m1", genai_call(f"Night {night}, question {i}?", f"Answer {i}."), parent=root, start=1,
               end=2)
        t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                             "agentlightning.reward.0.value": float(i % 2)}, parent=root, start=5, end=5.1)
        traces.append(t)
    write_spans(str(data), traces, batch=f"night{night}", base_ns=T0 + night * NIGHT_NS)


@dataclasses.dataclass
class _Trained:
    version: str

    def lines(self) -> list[str]:
        return [f"trained {self.version} (the test's stand-in: rows selected, no model)"]


@dataclasses.dataclass
class _Published:
    version: str

    def lines(self) -> list[str]:
        return [f"published {self.version} (the test's stand-in: registered, nothing loaded)"]


def test_the_window_starts_where_the_serving_adapters_data_ended(tmp_path, monkeypatch):
    data, ck = tmp_path / "data", tmp_path / "ck"
    trained: list[dict] = []  # per call of the trainer: the nights its rows came from, and what it continued
    verdicts: dict[int, bool] = {}  # night -> the gate's verdict
    crash = {"train": False, "after_commit": False}

    def train(cfg, progress=False):
        sel = select(cfg)  # the real selection: raises TrainDataError as training would
        trained.append({"nights": sorted({int(m) for r in sel.rows for m in re.findall(r"Night (\d+),",
                                                                                        json.dumps(r["input_messages"]))}),
                        "from": (cfg.init_adapter or "").rsplit("/", 1)[-1] or None})
        if crash["train"]:
            raise RuntimeError("the node was preempted")
        staged = ckpt.staging_dir(cfg.output, tmp_path / "work")
        (staged / "adapter_model.safetensors").write_bytes(b"stand-in")
        ckpt.commit(staged, {"kind": "lora", "config": dataclasses.asdict(cfg), "dataset": {"since": sel.since or None}},
                    cfg.output)
        if crash["after_commit"]:
            raise RuntimeError("the node was preempted after the version was written")
        return _Trained(ckpt.versions(cfg.output)[-1])

    def gate(candidate, published, train_cfg, settings, log_dir=None):
        night = (dt.date.fromisoformat(state_now["date"]) - DAY0.date()).days
        ok = verdicts.get(night, True)
        return GateDecision(ok, "the test's verdict" if ok else "the test blocks it", candidate, published)

    def publish(candidate, endpoint, **kw):
        version = candidate.rsplit("/", 1)[-1]
        registry.append(str(ck), {"version": version, "name": f"{NAME}@{version}", "endpoint": endpoint,
                                  "mode": "lora", "checkpoint": candidate})
        return _Published(version)

    monkeypatch.setattr(train_mod, "train", train)
    monkeypatch.setattr(gate_mod, "gate", gate)
    monkeypatch.setattr(publish_mod, "publish", publish)
    state_now = {"date": ""}

    tcfg = TransformConfig()
    tcfg.data, tcfg.settle = str(data), 0
    trcfg = TrainConfig()
    trcfg.data, trcfg.output, trcfg.base_model = str(data), str(ck), str(tmp_path / "no-such-model")
    # an agent on both, so that a prompt canary can hold the adapter back; no route: no prompt candidate starts
    apo = ApoConfig(data=str(data))
    store = apo.store()

    def night(k: int, *, publish_on: bool = True, hours: int = 23) -> tuple[int, dict]:
        when = DAY0 + dt.timedelta(days=k, hours=hours)
        state_now["date"] = when.date().isoformat()
        n = NightlyConfig(vllm_url=URL, name=NAME, experiments="both", publish=publish_on,
                          watch=WatchSettings(enabled=False))
        return run(tcfg, trcfg, n, now=when, apo_cfg=apo)

    def last():
        return trained[-1]["nights"], trained[-1]["from"]

    # night 1: nothing serves: all of the data; published
    _night_spans(data, 1)
    code, state = night(1)
    assert code == 0 and state["outcome"] == "published v0001", state
    assert last() == ([1], None)
    # night 2: a prompt canary on the agent holds the adapter back: nothing is trained
    trials.append(store, {"agent": "solver", "role": "canary", "match": "a" * 12, "candidate": "b" * 12,
                          "version": "v0001", "time": (DAY0 + dt.timedelta(days=2)).isoformat()})
    _night_spans(data, 2)
    code, state = night(2)
    assert code == 0 and state["outcome"].startswith("no adapter trained tonight"), state
    assert len(trained) == 1
    # night 3: the canary ended; the window starts at v0001's data (night 1, less a day): night 2's logs are in;
    # the gate blocks the candidate
    trials.append(store, {"agent": "solver", "role": "canary_end", "outcome": "stopped", "match": "a" * 12,
                          "candidate": "b" * 12, "version": "v0001", "time": (DAY0 + dt.timedelta(days=3)).isoformat()})
    _night_spans(data, 3)
    verdicts[3] = False
    code, state = night(3)
    assert code == 0 and state["outcome"].startswith("held back by the gate"), state
    assert last() == ([1, 2, 3], "v0001")
    # night 4: publishing is off: v0003 is trained, never served
    _night_spans(data, 4)
    code, state = night(4, publish_on=False)
    assert code == 0 and state["outcome"].endswith("publishing is off"), state
    assert last() == ([1, 2, 3, 4], "v0001")  # before: nights 2-4 (the night before, less a day)
    # night 5: still from v0001, whose data ended on night 1: the nights nothing that serves learned are in
    _night_spans(data, 5)
    code, state = night(5)
    assert code == 0 and state["outcome"] == "published v0004", state
    assert last() == ([1, 2, 3, 4, 5], "v0001")  # before: nights 3-5; night 2 was never trained on by what served
    assert state["train"][0] == (f"window: since {(DAY0 + dt.timedelta(days=0)).date()}: serving adapter v0001, "
                                 f"which this run continues, learned the data up to {(DAY0 + dt.timedelta(days=1)).date()}"
                                 "; less overlap_days 1, for trajectories that settled later")
    # night 6: v0004 serves, its data ended on night 5; the run dies in training and is resumed the next day:
    # the same window, kept in the state
    _night_spans(data, 6)
    crash["train"] = True
    code, state = night(6)
    assert code == EXIT_FAILED and state["stage"] == "train", state
    assert last() == ([4, 5, 6], "v0004")
    crash["train"] = False
    verdicts[7] = False  # the resumed run's candidate is blocked: v0004 still serves
    code, state = night(7, hours=1)
    assert code == 0 and state["resumed"] == 1 and state["outcome"].startswith("held back by the gate"), state
    assert last() == ([4, 5, 6], "v0004")
    # night 7: it dies in training again, and a person rolls v0004 back meanwhile: nothing trains from a version
    # production judged worse, so the resumed run decides its window again, from v0001 (data to night 1)
    _night_spans(data, 7)
    crash["train"] = True
    code, state = night(7)
    assert code == EXIT_FAILED and last() == ([4, 5, 6, 7], "v0004")
    registry.append(str(ck), {"version": "v0001", "name": f"{NAME}@v0001", "endpoint": URL, "mode": "lora",
                              "checkpoint": str(ck / "v0001"), "rollback_of": "v0004"})
    crash["train"] = False
    code, state = night(8, hours=1)
    assert code == 0 and last() == ([1, 2, 3, 4, 5, 6, 7], "v0001")
    assert state["train"][0].startswith(f"window decided again: v0004, which it continued when this run was "
                                        "interrupted, no longer serves")
    assert state["outcome"] == "published v0006", state
    # night 9: the run dies after its version was written, and v0006 is rolled back meanwhile: the version is
    # what the resumed run judges, so its window stays as it was (from v0006, whose data ended on night 7)
    _night_spans(data, 9)
    crash["after_commit"] = True
    code, state = night(9)
    assert code == EXIT_FAILED and last() == ([6, 7, 9], "v0006")
    registry.append(str(ck), {"version": "v0001", "name": f"{NAME}@v0001", "endpoint": URL, "mode": "lora",
                              "checkpoint": str(ck / "v0001"), "rollback_of": "v0006"})
    crash["after_commit"], calls = False, len(trained)
    code, state = night(10, hours=1)
    assert code == 0 and len(trained) == calls, state
    assert state["train"] == [f"window: since {(DAY0 + dt.timedelta(days=6)).date()}: serving adapter v0006, which "
                              f"this run continues, learned the data up to {(DAY0 + dt.timedelta(days=7)).date()}; "
                              "less overlap_days 1, for trajectories that settled later",
                              "reused v0007, trained by this run before an interruption"]


@pytest.mark.parametrize("serving, init_from_published, why", [
    (None, True, "all of the data: training starts from the base model (nothing serves yet), which learned none of it"),
    ({"version": "v0002", "mode": "lora", "checkpoint": "/nowhere/v0002"}, False,
     "all of the data: training starts from the base model (nightly.init_from_published is false), which "
     "learned none of it"),
    ({"version": "v0002", "mode": "full", "checkpoint": "/nowhere/v0002"}, True,
     "all of the data: training starts from the base model (what serves, v0002, is not an adapter it "
     "continues), which learned none of it"),
])
def test_a_run_from_the_base_model_takes_all_of_the_data(serving, init_from_published, why):
    from nightshift.nightly import window

    n = NightlyConfig(init_from_published=init_from_published)
    w = window.choose(n, serving, DAY0, full_finetune=False)
    assert (w.since, w.init_adapter, w.why) == ("", "", why)


def test_an_adapter_whose_data_end_cannot_be_told_takes_all_of_the_data(tmp_path):
    from nightshift.nightly import window

    w = window.choose(NightlyConfig(), {"version": "v0002", "mode": "lora", "checkpoint": str(tmp_path / "v0002")},
                      DAY0, full_finetune=False)
    assert w.since == "" and w.init_adapter == str(tmp_path / "v0002")
    assert w.why.startswith("all of the data: where the data of serving adapter v0002 ended cannot be told (")


def test_a_state_whose_window_is_not_text_is_refused_in_a_sentence():
    """The window and the adapter it continues are read back on resume: one that is not
    text would reach the trainer (a traceback, exit 1 every night) rather than be named."""
    from nightshift.nightly.run import state_problem

    good = {"run_id": "2026-11-23T02:15:00+00:00", "run_date": "2026-11-23", "stage": "train", "since": "2026-11-21",
            "window": "since 2026-11-21: ...", "init_adapter": "/ck/v0003"}
    assert state_problem(good) is None
    assert state_problem({**good, "init_adapter": ["/ck/v0003"]}) == "has 'init_adapter' that is not text"
    assert state_problem({**good, "window": 3}) == "has 'window' that is not text"
