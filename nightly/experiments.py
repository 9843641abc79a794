"""Which experiment each agent gets tonight: prompt optimization, weight training,
or both; and never two at once on one agent.

An agent on a hosted model can only learn through its prompt; an agent on the
team's vLLM can learn through its weights too. `nightly.experiments` says what
every agent gets, `nightly.agents` overrides it per agent (docs/nightly.md).
Both experiments end in a canary judged by the watch; two canaries on one agent
at once (its prompt on the route and the adapter it calls) would each be judged
against a baseline the other one moves, so a second is refused and the report
says which one waits and why.

An agent on `both` takes turns (`turn`): when neither of its experiments runs,
the kind that did not go last goes, and the other goes instead when that one has
nothing to try tonight. Which went last is read from the records the two kinds
already keep (the trials record, the registry), so a crash or a resume cannot
lose it; a prompt that always went first would hold every adapter back.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from nightshift.publish import prompt_canary as trials
from nightshift.publish import registry
from nightshift.route.client import RouteClient
from nightshift.settings import setting

log = logging.getLogger("nightshift.nightly")

KINDS = ("weights", "prompts", "both", "off")


@dataclass
class PromptTrialSettings:
    """A prompt candidate's first trial: the share of one agent's conversations the
    route gives it (the watch then stops, promotes or expires it, as an adapter canary)."""

    share: float = setting(0.1, help="the share of an agent's conversations a new prompt candidate gets",
                           bounds="(0, 1)")


def kind_of(agent: str, default: str, agents: dict) -> str:
    """What `agent` gets: its own entry in `nightly.agents`, else `nightly.experiments`."""
    return str(agents.get(agent, default))


def wants(kind: str, what: str) -> bool:
    return kind == what or kind == "both"


def trains_weights(default: str, agents: dict) -> bool:
    """Whether any agent is on weight training: with none, the nightly trains nothing."""
    return wants(default, "weights") or any(wants(str(k), "weights") for k in agents.values())


#: What a fresh agent on `both` tries first. The prompt: its trial is the slower
#: to judge (the watch needed 2 nights of 200 conversations at a 50 % share to
#: promote the stand-in's candidate; an adapter's +30 points showed after one), and
#: its proposer reads the failures of what serves: proposed after an adapter has
#: taken the agent near the world's ceiling, a candidate has few failures to read
#: and a lift too small to tell within its trial. An adapter loses nothing by
#: waiting: the default window (nightly.train_window_days: 0, nightly/window.py)
#: starts where the serving adapter's data ended, so it holds the waiting nights' logs.
FIRST = "prompts"


@dataclass
class Turn:
    """Whose turn it is on one agent on `both`, and why, in words for the report."""

    kind: str  # "weights" or "prompts"
    why: str


def _when(entry: dict) -> dt.datetime:
    try:
        t = dt.datetime.fromisoformat(str(entry.get("time")))
    except ValueError:  # the records' readers check their entries; an odd time counts as the oldest
        return dt.datetime.min.replace(tzinfo=dt.timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


def last_started(agent: str, trial_entries: list[dict], registry_entries: list[dict], endpoint: str,
                 name: str) -> tuple[str, str, dt.datetime] | None:
    """The experiment last put in front of `agent`: ("prompts" | "weights", its
    version, when), or None when neither ever was. An adapter's start is its first
    entry in the registry (a canary's start, or a publication): a promotion repeats
    the version and a rollback starts nothing."""
    prompt = [e for e in trial_entries if e["agent"] == agent and e["role"] == "canary"]
    seen: set[str] = set()
    adapters = []
    for e in registry.lane(registry_entries, endpoint, name):
        version = str(e.get("version"))
        if e.get("role") == "canary_end" or e.get("rollback_of") or version in seen:
            continue
        seen.add(version)
        adapters.append(e)
    last = [(_when(e), kind, str(e.get("version"))) for kind, es in (("weights", adapters), ("prompts", prompt))
            for e in es[-1:]]
    if not last:
        return None
    when, kind, version = max(last, key=lambda x: (x[0], x[1] == "prompts"))
    return kind, version, when


def turn(agent: str, trial_entries: list[dict], registry_entries: list[dict], endpoint: str, name: str) -> Turn:
    """Which kind goes tonight on an agent on `both` with no experiment running: the
    one that did not go last (a fresh agent: `FIRST`)."""
    last = last_started(agent, trial_entries, registry_entries, endpoint, name)
    if last is None:
        return Turn(FIRST, "nothing was tried on it yet: the prompt goes first")
    kind, version, when = last
    what = f"prompt candidate {version}" if kind == "prompts" else f"adapter {version}"
    return Turn("weights" if kind == "prompts" else "prompts", f"{what} went last, on {when:%Y-%m-%d %H:%M}")


def turns(agent_names: list[str], default: str, agents: dict, store: str, registry_entries: list[dict],
          endpoint: str, name: str, adapter_canary: dict | None) -> dict[str, Turn]:
    """Tonight's turn of every agent on `both` that has no experiment running (an
    agent with one waits for its verdict, and has no turn)."""
    mine = [a for a in agent_names if kind_of(a, default, agents) == "both"]
    if not mine or adapter_canary is not None:
        return {}
    try:
        entries = trials.read(store)
    except trials.TrialError:  # optimize_prompts says it, and starts nothing
        return {}
    return {a: turn(a, entries, registry_entries, endpoint, name) for a in mine if not trials.running(entries, a)}


def seen_prompts(store: str) -> dict:
    """Every prompt candidate ever put on the route, by the version id the route marks
    its answers with (`prompt_seen`) -> its system text: the trainer trains on those
    answers with the prompt the model saw (`train.select.seen_prompts`). Without it,
    an adapter trained after a promotion learns only the agent's own prompt and serves
    under the promoted one (the agent world: 95 % under its own, 0 % under the
    promoted prompt). A record that cannot be read gives none: the rows are left out."""
    from nightshift.prompts import store as candidates

    try:
        entries = trials.read(store)
    except trials.TrialError:
        return {}
    return {c.version_id: c.system for agent in sorted({e["agent"] for e in entries if e["role"] == "canary"})
            for c in candidates.candidates(store, agent)}


def weights_held_by(store: str, default: str, agents: dict) -> str:
    """Why a new adapter may not be published tonight ("" when it may): a prompt
    canary runs on an agent that also gets weight training, and a new adapter would
    change the model under it. A trials record that cannot be read holds it too:
    which trials run is then unknown."""
    try:
        running = trials.running(trials.read(store))
    except trials.TrialError as e:
        return f"the prompt trials cannot be told ({e})"
    mine = [t for t in running if wants(kind_of(t["agent"], default, agents), "weights")]
    if not mine:
        return ""
    t = mine[0]
    return (f"prompt canary {t.get('version')} of {t['agent']} is being judged on the model this version would "
            "replace (one experiment per agent at a time)")


def optimize_prompts(apo_cfg, table, default: str, agents: dict, route_url: str, route_token: str,
                     share: float, adapter_canary: dict | None, tonight: dict[str, Turn] | None = None,
                     only: list[str] | None = None) -> list[str]:
    """For each agent on prompt optimization: one APO round (propose, then screen with
    `apo.gate.command` when set), and the best candidate that passed on the route as
    a prompt canary. `table`: every agent's prompt versions (`prompts.versions.by_agent`).
    `tonight`: the turns of the agents on `both` (`turns`): one whose turn is the
    adapter's waits. `only`: these agents alone (the ones that waited, when the
    adapter had nothing to try). Each agent's failure is said and the others go on."""
    from nightshift.prompts.client import ProposerError
    from nightshift.judge.screen import screener
    from nightshift.prompts.propose import ApoError, propose

    out: list[str] = []
    mine = [a.agent for a in table if wants(kind_of(a.agent, default, agents), "prompts")
            and (only is None or a.agent in only)]
    if not mine:
        return out
    if not route_url:
        return [f"prompt optimization for {', '.join(mine)}: no routing proxy to try candidates on (set "
                "nightly.canary.route_url to the `nightshift route` the agents call)"]
    store = apo_cfg.store()
    client = RouteClient(route_url, route_token)
    try:
        entries = trials.read(store)
    except trials.TrialError as e:  # which trials run is unknown: starting one could make two on an agent
        return [f"prompt optimization for {', '.join(mine)}: no candidate started: {e}"]
    for agent in mine:
        busy = trials.running(entries, agent)
        if busy:
            out.append(f"{agent}: prompt canary {busy[0].get('version')} is still being judged (see the watch): no "
                       "new candidate tonight")
            continue
        t = (tonight or {}).get(agent)
        if t is not None and t.kind == "weights":
            # said before any reason the prompt could not go: the fallback (`only`) runs this agent again and
            # says that reason then, once, if the adapter has nothing to try
            out.append(f"{agent}: the adapter's turn tonight ({t.why}); the prompt waits unless the adapter has "
                       "nothing to try")
            continue
        current = getattr(table.agent(agent), "current", None)
        if current is not None and current.shared_with:
            # the route matches a prompt, not an agent: a candidate would reach the others' conversations too
            out.append(f"{agent}: no prompt canary: its prompt {current.id} is also sent by "
                       f"{', '.join(current.shared_with)}, whose conversations the route would rewrite too")
            continue
        kept = [p for p in trials.applied(entries, agent)
                if current is not None and p["match"] == current.version.system_hash]
        if kept:
            out.append(f"{agent}: promoted prompt {kept[0].get('version')} is applied by the route in place of the "
                       "agent's own: put it in the agent's code to try the next one (the route holds one candidate "
                       "per prompt)")
            continue
        if adapter_canary is not None and wants(kind_of(agent, default, agents), "weights"):
            out.append(f"{agent}: refused a prompt canary: adapter canary {adapter_canary.get('version')} is being "
                       "judged on the model it calls; one experiment per agent at a time")
            continue
        turn_why = f" (the prompt's turn: {t.why})" if t is not None else ""
        try:
            rnd = propose(apo_cfg, agent, table=table, screen=screener(apo_cfg))
        except (ApoError, ProposerError, OSError, ValueError) as e:  # its own sentence each
            out.append(f"{agent}: no prompt candidate: {e}")
            continue
        pick = best(rnd.stored)
        if pick is None:
            why = "none was stored" if not rnd.stored else "none passed screening (apo.gate.command)"
            out.append(f"{agent}: {len(rnd.stored)} prompt candidate(s) proposed; {why}")
            continue
        try:
            trials.start(store, pick, client, share, agent=agent,
                         match=current.version.system_hash if current is not None else "")
        except trials.TrialError as e:
            out.append(f"{agent}: prompt candidate {pick.version} not started: {e}")
            continue
        out.append(f"{agent}: prompt candidate {pick.version} ({pick.version_id}) on {100 * share:.0f} % of its "
                   f"conversations (of {len(rnd.stored)} proposed){turn_why}")
    return out


def best(stored: list) -> object | None:
    """The candidate to try: screened ones that passed, the highest score first;
    without screening, the first stored (the proposer's order)."""
    screened = [c for c in stored if c.screen is not None]
    if not screened:
        return stored[0] if stored else None
    passed = [c for c in screened if c.screen.get("passed")]
    return max(passed, key=lambda c: c.screen.get("score", float("-inf"))) if passed else None
