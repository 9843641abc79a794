"""The nightly job's prompt optimization (issue 27 item 7), end to end on loopback:
spans built into transitions, an APO round against the stand-in proposer
(tests/support/proposer_standin.py: it knows nothing but what it is sent), its
candidate started as a prompt canary on a real `nightshift route` process, the next
night's watch judging it, and the report; and never two experiments on one agent."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from support.proposer_standin import Standin
from test_prompt_canary import upstream  # noqa: F401  (the fixture: a stand-in hosted API)
from test_route import route_factory  # noqa: F401  (the fixture: a real `nightshift route` process)
from traces import Trace, genai_call, write_spans

from nightshift.nightly import experiments
from nightshift.nightly.run import NightlyConfig, run
from nightshift.prompts.config import ApoConfig
from nightshift.publish import prompt_canary as trials
from nightshift.publish.canary import CanarySettings
from nightshift.route.client import RouteClient, prompt_name
from nightshift.schemas.prompt_identity import system_id
from nightshift.trainer.config import TrainConfig
from nightshift.transform.config import TransformConfig

PROMPT = "Use one tool, then reply: The answer is X."
TOOL_ERROR = "error: calculator cannot read a colour question"


def _spans(data: Path, n: int, prefix: str, error: str = TOOL_ERROR) -> None:
    """An agent whose failed runs called the calculator on a colour question (the tool
    said so, in `error`); one reward per run."""
    traces = []
    for i in range(n):
        t = Trace(f"{prefix}{i}")
        root = t.span("invoke_agent solver", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "solver"},
                      start=0, end=10)
        fail = i % 3 == 0
        hist = [{"role": "system", "parts": [{"type": "text", "content": PROMPT}]},
                {"role": "user", "parts": [{"type": "text", "content": "What colour is the lamp today?"}]},
                {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "calculator" if fail else
                                                 "lookup", "arguments": {}}]},
                {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1",
                                            "response": error if fail else "result: red"}]}]
        t.span("chat m1", genai_call("go on", "The answer is zero." if fail else "The answer is red.", history=hist),
               parent=root, start=1, end=2)
        t.span("agentlightning.annotation", {"agentlightning.reward.0.name": "primary",
                                             "agentlightning.reward.0.value": 0.0 if fail else 1.0},
               parent=root, start=5, end=5.1)
        traces.append(t)
    write_spans(str(data), traces, batch=prefix)


def _night(tmp_path: Path, trajectories: int) -> tuple[Path, TransformConfig, TrainConfig]:
    """A lake of `trajectories` solver runs and the build and train settings a night reads it with."""
    data = tmp_path / "data"
    _spans(data, trajectories, "a")
    tcfg = TransformConfig()
    tcfg.data, tcfg.settle = str(data), 0
    trcfg = TrainConfig()
    trcfg.output = str(tmp_path / "ck")
    return data, tcfg, trcfg


def test_prompt_optimization_nights_propose_try_on_the_route_judge_and_report(tmp_path, upstream,  # noqa: F811
                                                                             route_factory):  # noqa: F811
    r = route_factory(upstream).start()
    data, tcfg, trcfg = _night(tmp_path, 36)
    n = NightlyConfig(experiments="prompts", canary=CanarySettings(route_url=r.url))
    with Standin() as proposer:
        apo = ApoConfig(data=str(data), base_url=proposer.url, model="any", candidates=2, timeout=5.0, retries=0)
        code, state = run(tcfg, trcfg, n, apo_cfg=apo)
    assert code == 0, state.get("error")
    assert state["outcome"].startswith("prompt optimization only") and "train" not in state
    started = [x for x in state["prompts"] if "solver: prompt candidate v0001" in x]
    assert started and "on 10 % of its conversations" in started[0], state["prompts"]
    route = RouteClient(r.url).get(prompt_name(system_id([PROMPT])))
    assert route["kind"] == "prompt" and route["share"] == 0.1 and route["agent"] == "solver"
    report = Path(state["report"]).read_text()
    assert "## Prompt optimization" in report and "## Reward by prompt version" in report
    assert "solver" in "\n".join(state["prompt_versions"])
    png = Path(state["plot"]).read_bytes()  # a fourth panel, reward by prompt version: 13 inches at 110 dpi
    assert int.from_bytes(png[20:24], "big") == 13 * 110

    # the next night: the watch judges the canary first (too few of its trajectories yet), and no second
    # candidate starts on the same agent
    _spans(data, 6, "b")
    with Standin() as proposer:
        apo.base_url = proposer.url
        code, state = run(tcfg, trcfg, n, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1), apo_cfg=apo)
    assert code == 0, state.get("error")
    assert any(x.startswith("watch: prompt canary v0001 of solver") and "too_few" in x for x in state["prompt_watch"])
    assert state["prompts"] == ["solver: prompt canary v0001 is still being judged (see the watch): no new "
                                "candidate tonight"]
    assert len(trials.read(apo.store())) == 1
    assert "## Prompt canaries: the watch" in Path(state["report"]).read_text()


def test_never_two_experiments_on_one_agent(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    apo = ApoConfig(data=str(tmp_path / "data"), candidates_dir=str(store))

    class Table(list):  # `prompts.versions.PromptTable`'s shape: agents, each with the version it sends now
        def agent(self, name):
            return next(a for a in self if a.agent == name)

    def agent(name, shared=()):
        version = type("P", (), {"system_hash": "d" * 12})
        return type("A", (), {"agent": name, "current": type("V", (), {"id": "c0ffee", "shared_with": list(shared),
                                                                      "version": version})})

    table = Table([agent("both-agent"), agent("hosted-agent")])
    agents = {"both-agent": "both", "hosted-agent": "prompts"}
    # an adapter canary runs on the team's model: the agent that is also on weights gets no prompt canary
    out = experiments.optimize_prompts(apo, Table(table[:1]), "weights", agents, "http://127.0.0.1:9", "", 0.1,
                                       {"version": "v0003"})
    assert out == ["both-agent: refused a prompt canary: adapter canary v0003 is being judged on the model it "
                   "calls; one experiment per agent at a time"]
    # two agents sending one prompt: a prompt route would rewrite both, so neither gets a canary
    out = experiments.optimize_prompts(apo, Table([agent("hosted-agent", ["billing-agent"])]), "weights", agents,
                                       "http://127.0.0.1:9", "", 0.1, None)
    assert out == ["hosted-agent: no prompt canary: its prompt c0ffee is also sent by billing-agent, whose "
                   "conversations the route would rewrite too"]
    # a promoted prompt the route applies in place of the agent's own: no trial on top of it
    trials.append(str(store), {"role": "canary_end", "outcome": "promoted", "agent": "hosted-agent", "match": "d" * 12,
                               "candidate": "e" * 12, "version": "v0007"})
    out = experiments.optimize_prompts(apo, Table([agent("hosted-agent")]), "weights", agents, "http://127.0.0.1:9",
                                       "", 0.1, None)
    assert out == ["hosted-agent: promoted prompt v0007 is applied by the route in place of the agent's own: put it "
                   "in the agent's code to try the next one (the route holds one candidate per prompt)"]
    # a prompt canary runs on an agent also on weights: it holds a new adapter back; a hosted agent's does not
    for agent in ("both-agent", "hosted-agent"):
        trials.append(str(store), {"role": "canary", "agent": agent, "match": "a" * 12, "candidate": "b" * 12,
                                   "version": "v0001"})
    assert experiments.weights_held_by(str(store), "weights", agents).startswith(
        "prompt canary v0001 of both-agent is being judged on the model this version would replace")
    assert experiments.weights_held_by(str(store), "prompts", {}) == ""  # agents on prompts only hold nothing
    # a trials record that cannot be read starts no prompt canary and holds the adapter back, said in a sentence
    (store / "trials.json").write_text("{torn")
    assert "trials.json is not JSON" in experiments.weights_held_by(str(store), "weights", agents)
    out = experiments.optimize_prompts(apo, Table(table[1:]), "weights", agents, "http://127.0.0.1:9", "", 0.1, None)
    assert out[0].startswith("prompt optimization for hosted-agent: no candidate started:") and "not JSON" in out[0]
    assert not experiments.trains_weights("prompts", {"hosted-agent": "prompts"})
    assert experiments.trains_weights("prompts", agents)


def test_an_agent_given_an_experiment_that_is_none_is_refused_in_one_sentence(tmp_path):
    import pytest

    from nightshift.settings import SettingsError, load

    cfg = tmp_path / "n.yaml"
    cfg.write_text("nightly:\n  experiments: prompts\n  agents: {solver: both, planner: sometimes}\n")
    with pytest.raises(SettingsError, match=r"^nightly\.agents\.planner: must be one of weights, prompts, both, off, "
                                            r"got 'sometimes'$"):
        load(NightlyConfig, "nightly", str(cfg), {}, env={})
    cfg.write_text("nightly:\n  agents: {solver: both}\n  prompts: {share: 0.2}\n")
    n = load(NightlyConfig, "nightly", str(cfg), {}, env={})
    assert (n.experiments, n.agents, n.prompts.share) == ("weights", {"solver": "both"}, 0.2)


def test_a_prompt_stage_resumed_after_a_failure_says_its_lines_once(tmp_path, monkeypatch):
    """The prompt stage said "the prompt versions could not be read" by adding to the
    state's lines; a failure later in the stage saved them, and every resumed attempt
    added the sentence again. No route or proposer is reached (the table is what fails)
    and the watch is off, so no process starts."""
    import nightshift.nightly.run as nightly_run
    from nightshift.judge.watch import WatchSettings
    from nightshift.nightly.run import EXIT_FAILED
    from nightshift.prompts import versions

    data, tcfg, trcfg = _night(tmp_path, 6)
    n = NightlyConfig(experiments="prompts", canary=CanarySettings(route_url="http://127.0.0.1:9"),
                      watch=WatchSettings(enabled=False))
    apo = ApoConfig(data=str(data))

    def unreadable(*a, **kw):
        raise ValueError("the lake is being rewritten")

    real, calls = nightly_run._canary, []

    def fails_once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("published.json could not be read")
        return real(*a, **kw)

    monkeypatch.setattr(versions, "by_agent", unreadable)
    monkeypatch.setattr(nightly_run, "_canary", fails_once)
    code, state = run(tcfg, trcfg, n, apo_cfg=apo)
    assert code == EXIT_FAILED and state["stage"] == "prompts", state.get("error")
    code, state = run(tcfg, trcfg, n, apo_cfg=apo)
    assert code == 0, state.get("error")
    assert state["prompts"] == ["prompt optimization: the prompt versions could not be read: the lake is being "
                                "rewritten"]
