"""`experiments: both` takes turns (issue 27 item 7): one experiment per agent at a
time, and the kind that did not go last goes; when it has nothing to try, the other
goes instead; the decision, taken in the prompt stage, outlives a crash before the
publish. The turns are read from the trials record and the registry alone, so the
order is checked on records first (milliseconds), then over nights of the real job
on loopback (a route process, the stand-in proposer; the adapter's side has nothing
to train on or fails, which is what these tests need of it, so no model loads)."""

from __future__ import annotations

import datetime as dt

from support.proposer_standin import Standin
from test_nightly_prompts import _spans
from test_prompt_canary import upstream  # noqa: F401  (the fixture: a stand-in hosted API)
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)

from nightshift.nightly import experiments
from nightshift.nightly.run import EXIT_FAILED, NightlyConfig, run
from nightshift.prompts.config import ApoConfig
from nightshift.publish import prompt_canary as trials
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient
from nightshift.trainer.config import TrainConfig
from nightshift.transform.config import TransformConfig

URL, NAME = "http://127.0.0.1:8000", "agent"


def _trial(version: str, time: str, role: str = "canary", agent: str = "solver") -> dict:
    return {"agent": agent, "role": role, "match": "a" * 12, "candidate": "b" * 12, "version": version, "time": time,
            **({"outcome": "stopped"} if role == "canary_end" else {})}


def _adapter(version: str, time: str, **extra) -> dict:
    return {"version": version, "name": f"{NAME}@{version}", "endpoint": URL, "time": time, "mode": "lora", **extra}



def _nothing_to_train(tmp_path, spans: int):
    """A lake of agent a's spans, its build settings, and a trainer with nothing to train
    (selects agent "nobody"): the cheapest adapter that has "nothing to try"."""
    data = tmp_path / "data"
    _spans(data, spans, "a")
    tcfg = TransformConfig()
    tcfg.data, tcfg.settle = str(data), 0
    trcfg = TrainConfig()
    trcfg.output, trcfg.base_model = str(tmp_path / "ck"), str(tmp_path / "no-such-model")
    trcfg.select.agents = "nobody"
    return data, tcfg, trcfg

def test_the_two_kinds_take_turns_over_nights_read_from_the_records():
    prompts, adapters = [], []

    def now():
        return experiments.turn("solver", prompts, adapters, URL, NAME)

    assert now().kind == experiments.FIRST == "prompts" and "nothing was tried" in now().why
    prompts += [_trial("v0001", "2026-11-01T02:00:00+00:00"), _trial("v0001", "2026-11-03T02:00:00+00:00",
                                                                      "canary_end")]
    assert (now().kind, now().why) == ("weights", "prompt candidate v0001 went last, on 2026-11-01 02:00")
    adapters.append(_adapter("v0001", "2026-11-04T02:00:00+00:00", role="canary"))
    assert (now().kind, now().why) == ("prompts", "adapter v0001 went last, on 2026-11-04 02:00")
    prompts += [_trial("v0002", "2026-11-05T02:00:00+00:00")]
    assert now().kind == "weights"
    # the adapter canary's promotion (a serving entry of the same version) and a rollback start nothing
    adapters += [_adapter("v0001", "2026-11-06T02:00:00+00:00"),
                 _adapter("v0000", "2026-11-07T02:00:00+00:00", rollback_of="v0001")]
    assert now().kind == "weights"
    adapters.append(_adapter("v0002", "2026-11-08T02:00:00+00:00"))
    assert now().kind == "prompts"
    # another agent's prompt trials are not this one's; another adapter name is another model
    assert experiments.turn("planner", prompts, adapters, URL, NAME).why.startswith("adapter v0002 went last")
    assert experiments.turn("solver", prompts, adapters, URL, "other").kind == "weights"


def test_an_agent_with_an_experiment_running_has_no_turn(tmp_path):
    store = str(tmp_path)
    trials.append(store, _trial("v0001", ""))
    agents = {"solver": "both", "hosted": "prompts"}
    assert experiments.turns(["solver", "hosted", "fresh"], "both", agents, store, [], URL, NAME, None).keys() == {
        "fresh"}
    assert experiments.turns(["fresh"], "both", {}, store, [], URL, NAME, {"version": "v0003"}) == {}


def test_both_takes_turns_falls_back_and_keeps_its_decision_through_a_crash(tmp_path, upstream,  # noqa: F811
                                                                             route_factory):  # noqa: F811
    r = route_factory(upstream).start()
    data, tcfg, trcfg = _nothing_to_train(tmp_path, 36)
    n = NightlyConfig(experiments="both", canary=CanarySettings(route_url=r.url))
    apo = ApoConfig(data=str(data), base_url="http://127.0.0.1:9", model="any", candidates=1, timeout=5.0, retries=0,
                    failures=200)  # every failure read: a new kind of failure makes a new candidate
    day = dt.datetime.now(dt.timezone.utc)

    # night 1, a fresh agent: the prompt's turn; its proposer is down, so the adapter may go (it trains)
    code, state = run(tcfg, trcfg, n, now=day, apo_cfg=apo)
    assert code == 0, state.get("error")
    assert state["prompts"][-1] == "solver: the prompt's turn had nothing to try tonight: the adapter may go instead"
    assert state["outcome"].startswith("nothing new to train on") and trials.read(apo.store()) == []

    # night 2 (new logs each night: a night without any reports only that): still nothing tried, so the
    # prompt's turn again; its candidate starts, and no adapter is trained
    _spans(data, 6, "b")
    with Standin() as proposer:
        apo.base_url = proposer.url
        code, state = run(tcfg, trcfg, n, now=day + dt.timedelta(days=1), apo_cfg=apo)
    assert code == 0, state.get("error")
    assert [x for x in state["prompts"] if "prompt candidate v0001" in x][0].endswith(
        "(the prompt's turn: nothing was tried on it yet: the prompt goes first)")
    assert state["outcome"].startswith("no adapter trained tonight: prompt canary v0001 of solver is being judged")
    assert "train" not in state
    # production ends it (what the watch does on its evidence)
    trials.stop(apo.store(), trials.running(trials.read(apo.store()), "solver")[0], RouteClient(r.url), "worse")

    # night 3: the prompt went last, so the adapter's turn; the train stage fails after the decision (exit 1:
    # its settings name no model) ...
    trcfg.base_model, model = "", trcfg.base_model
    _spans(data, 6, "c", error="error: calculator timed out")  # a failure v0001 did not read: a new candidate
    with Standin() as proposer:
        apo.base_url = proposer.url
        code, state = run(tcfg, trcfg, n, now=day + dt.timedelta(days=2), apo_cfg=apo)
        assert code == EXIT_FAILED and state["stage"] == "train" and state["deferred"] == ["solver"]
        assert state["prompts"] == ["solver: the adapter's turn tonight (prompt candidate v0001 went last, on "
                                    f"{trials.read(apo.store())[0]['time'][:16].replace('T', ' ')}); the prompt "
                                    "waits unless the adapter has nothing to try"]
        # ... and the resumed run keeps it: no second prompt round in the prompt stage; the adapter has
        # nothing to train on, so the agent that waited gets its prompt round after all
        trcfg.base_model = model
        code, state = run(tcfg, trcfg, n, now=day + dt.timedelta(days=2, hours=1), apo_cfg=apo)
    assert code == 0, state.get("error")
    assert state["resumed"] == 1 and state["prompts"][0].startswith("solver: the adapter's turn tonight")
    assert state["prompts"][1].startswith("solver: the adapter had nothing to try tonight (nothing new to train on")
    running = trials.running(trials.read(apo.store()))
    assert len(running) == 1 and running[0]["version"] != "v0001"
    assert state["prompts"][-1].startswith(f"solver: prompt candidate {running[0]['version']} (")


def test_a_fallback_night_says_why_the_prompt_cannot_go_once(tmp_path, monkeypatch):
    """An agent on `both` whose promoted prompt the route applies, on the adapter's
    turn, on a night the adapter has nothing to try: the prompt stage and the fallback
    both used to run its refusals, so the report said "promoted prompt ... is applied"
    twice. It waits in the prompt stage, and the fallback says why it cannot go, once.
    Nothing here reaches the route (the refusal comes before any call to it) and the
    watch is off, so no process starts."""
    from pathlib import Path

    from nightshift.judge.watch import WatchSettings
    from nightshift.prompts.versions import by_agent

    data, tcfg, trcfg = _nothing_to_train(tmp_path, 12)
    n = NightlyConfig(experiments="both", canary=CanarySettings(route_url="http://127.0.0.1:9"),
                      watch=WatchSettings(enabled=False))
    apo = ApoConfig(data=str(data), base_url="http://127.0.0.1:9", model="any", candidates=1, timeout=5.0, retries=0)
    day = dt.datetime.now(dt.timezone.utc)
    code, state = run(tcfg, trcfg, n, now=day, apo_cfg=apo)
    assert code == 0, state.get("error")
    # production promoted a candidate of solver's prompt: the prompt went last, so tonight is the adapter's turn
    match = by_agent(str(data), names=False).agent("solver").current.version.system_hash
    for role, extra in (("canary", {}), ("canary_end", {"outcome": "promoted"})):
        trials.append(apo.store(), {"agent": "solver", "role": role, "match": match, "candidate": "b" * 12,
                                    "version": "v0001", "time": (day - dt.timedelta(hours=1)).isoformat(), **extra})
    _spans(data, 6, "b")
    # the fallback fails once on the way (its prompt round raises) and is resumed: what it said before the
    # failure is not said twice either
    real = experiments.optimize_prompts

    def fails_in_the_fallback(*args, only=None, **kw):
        if only is not None:
            raise OSError("the disk went away")
        return real(*args, only=only, **kw)

    monkeypatch.setattr(experiments, "optimize_prompts", fails_in_the_fallback)
    code, state = run(tcfg, trcfg, n, now=day + dt.timedelta(days=1), apo_cfg=apo)
    assert code == EXIT_FAILED and state["stage"] == "fallback", state.get("error")
    monkeypatch.setattr(experiments, "optimize_prompts", real)
    code, state = run(tcfg, trcfg, n, now=day + dt.timedelta(days=1, hours=1), apo_cfg=apo)
    assert code == 0, state.get("error")
    assert sum("the adapter had nothing to try tonight" in x for x in state["prompts"]) == 1, state["prompts"]
    assert state["deferred"] == ["solver"] and state["outcome"].startswith("nothing new to train on")
    said = [x for x in state["prompts"] if "promoted prompt v0001 is applied" in x]
    assert len(said) == 1, state["prompts"]
    assert state["prompts"][0].startswith("solver: the adapter's turn tonight (prompt candidate v0001 went last")
    assert state["prompts"][1].startswith("solver: the adapter had nothing to try tonight (nothing new to train on")
    assert state["prompts"][2] == said[0]
    assert Path(state["report"]).read_text().count("promoted prompt v0001 is applied") == 1
