"""Canary publishing: a new version takes a share of the conversations beside the
one serving, through the routing proxy (`nightshift route`), until production has
judged it: the watch (publish/watch.py) then promotes it to all traffic or stops
it. Agents are not changed: they ask for the stable name, and the proxy sends
each conversation, stickily, to one version or the other.

Every step goes through the same verified paths as a whole-traffic publish: the
candidate is loaded under its versioned name (`agent@v0004`) and checked like any
publication, the route is written to the proxy (which persists it before it
answers), and `published.json` records a `canary` entry and, at the end, a
`canary_end` with the outcome (`promoted`, `stopped` when worse, `expired`). Each step is safe to repeat, so a run killed
half-way is finished by the next look.

Without a canary running the proxy has no route for the stable name: requests
pass through to the server, where the stable name serves the serving version.
Only while the base model serves (nothing published yet) does the route hold
it, since the server has no adapter under the stable name then.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from nightshift.route.client import RouteClient
from nightshift.settings import setting

from . import registry
from .publish import PublishError, publish
from .versions import BASE
from .vllm_client import VLLMClient, VLLMError

log = logging.getLogger("nightshift.publish.canary")


@dataclass
class CanarySettings:
    """Publish each new version to a share of the conversations first, through the
    routing proxy (`nightshift route`, which the agents' base URL points at); the
    watch promotes it or stops it. Off (share 0): a publish moves all traffic, and
    the watch rolls a worse version back."""

    share: float = setting(0.0, help="the share of conversations a new version gets first (0: off)", bounds="[0, 1)",
                           flag="--canary-share")
    route_url: str = setting("", help="the routing proxy (nightshift route) in front of the server", metavar="URL",
                             flag="--route-url")
    route_token: str = setting("", help="the proxy's admin token (route.admin_token)", metavar="TOKEN",
                               flag="--route-token")
    max_hours: float = setting(72.0, help="a canary production has not judged (better, worse, or no worse than "
                                          "the watch's margin) after this long expires: every conversation back on "
                                          "the serving version, and the next night trains a new candidate",
                               bounds="(0, inf)", metavar="HOURS", flag="--canary-max-hours")


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _stable(settings) -> str:
    return settings.stable_name or settings.name


def _client(canary: CanarySettings) -> RouteClient:
    if not canary.route_url:
        raise PublishError("a canary needs the routing proxy: set canary.route_url (nightshift route's address)")
    return RouteClient(canary.route_url, canary.route_token)


def start(checkpoint: str, checkpoints: str, settings, canary: CanarySettings, base_name: str,
          **publish_kw) -> list[str]:
    """Load `checkpoint` beside what serves and send it `canary.share` of the
    conversations that ask for the stable name. `settings`: `PublishSettings`;
    `base_name`: the base model's name on the server (what serves when no version
    does)."""
    endpoint = settings.vllm_url.rstrip("/")
    now = registry.serving(registry.read(checkpoints), endpoint, settings.name)
    serving_name, serving_version = (now["name"], now["version"]) if now else (base_name, BASE)
    stable = _stable(settings)
    res = publish(checkpoint, settings.vllm_url, **{**settings.kwargs(), **publish_kw,
                                                    "canary": {"share": canary.share, "route": canary.route_url,
                                                               "serving": serving_version,
                                                               "serving_name": serving_name, "stable": stable}})
    _client(canary).set(stable, serving_name, res.lora_name, canary.share)
    log.warning("canary: %s takes %.0f %% of the conversations asking for %r (the rest: %s)", res.lora_name,
                100 * canary.share, stable, serving_name)
    return [f"canary: {res.version} as {res.lora_name!r} takes {100 * canary.share:.0f} % of the conversations "
            f"asking for {stable!r} through {canary.route_url}; {serving_name} keeps the rest",
            *("  " + x for x in res.lines()[1:])]


def _end(checkpoints: str, entry: dict, outcome: str, why: str) -> None:
    registry.append(checkpoints, {"version": entry["version"], "name": entry["name"], "endpoint": entry["endpoint"],
                                  "role": "canary_end", "outcome": outcome, "why": why, "time": _now()})


def stop(entry: dict, checkpoints: str, settings, canary: CanarySettings, why: str,
         outcome: str = "stopped") -> list[str]:
    """Every conversation back to the serving version, the candidate unloaded, and
    the registry told: `stopped` (production judged it worse, so nothing returns
    to it) or `expired` (production could not tell)."""
    stable = entry.get("stable") or _stable(settings)
    client = _client(canary)
    if entry.get("serving") == BASE:
        client.set(stable, entry["serving_name"])  # the server has no adapter under the stable name yet
    else:
        client.delete(stable)  # the stable name on the server serves the serving version
    try:
        VLLMClient(settings.vllm_url, settings.api_key, timeout=settings.timeout, retries=settings.retries
                   ).unload_lora(entry["name"])
    except VLLMError as e:
        if e.status != 404:  # already gone is what we wanted; anything else is said, not fatal
            log.warning("canary %s: could not unload it: %s", entry["name"], e)
    _end(checkpoints, entry, outcome, why)
    log.warning("canary %s %s: %s", entry["name"], outcome, why)
    return [f"canary {outcome}: {entry['version']} ({why}); every conversation back on {entry['serving_name']}"]


def promote(entry: dict, checkpoints: str, settings, canary: CanarySettings, why: str, **publish_kw) -> list[str]:
    """The candidate to all traffic: published as any version (the stable name moves
    to it, verified), then the route removed so the stable name passes through."""
    stable = entry.get("stable") or _stable(settings)
    res = publish(entry["checkpoint"], settings.vllm_url, **{**settings.kwargs(), **publish_kw})
    _client(canary).delete(stable)
    _end(checkpoints, entry, "promoted", why)
    log.warning("canary %s promoted: %s", entry["name"], why)
    return [f"canary promoted: {entry['version']} now serves every conversation ({why})",
            *("  " + x for x in res.lines())]
