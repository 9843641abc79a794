"""Canary publishing: a new version takes a share of the conversations beside the
one serving, through the routing proxy (`nightshift route`), until production has
judged it: the watch (judge/watch.py) then promotes it to all traffic or stops
it. Agents are not changed: they ask for the stable name, and the proxy sends
each conversation, stickily, to one version or the other.

Every step goes through the same verified paths as a whole-traffic publish
(publish/change.py): the proxy is asked for its route before anything moves, the
candidate is loaded under its versioned name (`agent@v0004`) and checked like
any publication, the route is written to the proxy (which persists it before it
answers), and only then does `published.json` record a `canary` entry; at the
end, a `canary_end` with the outcome (`promoted`, `stopped` when worse,
`expired`). A canary the proxy cannot route is never recorded and its adapter
never left loaded, so it cannot hold up the next night's training. A run killed
between two steps is finished or undone by the next command (publish/recover.py).

Without a canary running the proxy has no route for the stable name: requests
pass through to the server, where the stable name serves the serving version.
Only while the base model serves (nothing published yet) does the route hold
it, since the server has no adapter under the stable name then.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from nightshift.route.client import RouteClient, RouteError
from nightshift.settings import setting

from . import registry
from .change import Change, PublishError, route_of, run
from .publish import RouteMove, publish
from .recover import reconcile
from .registry import BASE
from .vllm_client import VLLMClient

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


def _reconcile(checkpoints: str, settings, client: RouteClient | None) -> list[str]:
    return reconcile(checkpoints, api_key=settings.api_key, timeout=settings.timeout, retries=settings.retries,
                     route=client)


def start(checkpoint: str, checkpoints: str, settings, canary: CanarySettings, base_name: str,
          **publish_kw) -> list[str]:
    """Load `checkpoint` beside what serves and send it `canary.share` of the
    conversations that ask for the stable name. `settings`: `PublishSettings`;
    `base_name`: the base model's name on the server (what serves when no version
    does). The proxy is asked for its route before anything is loaded: when it
    cannot be reached (or refuses the token), nothing is loaded or recorded
    (`RouteUnavailable`), and when it fails later the candidate is unloaded again,
    so no canary is ever recorded that the proxy does not route."""
    client = _client(canary)
    endpoint = settings.vllm_url.rstrip("/")
    repaired = _reconcile(checkpoints, settings, client)
    entries = registry.read(checkpoints)
    running = registry.canary(entries, endpoint, settings.name)
    if running is not None:
        raise PublishError(f"canary {running['version']} is still running on {endpoint}: one experiment at a time "
                           "(the watch stops or promotes it)")
    now = registry.serving(entries, endpoint, settings.name)
    serving_name, serving_version = (now["name"], now["version"]) if now else (base_name, BASE)
    stable = _stable(settings)
    res = publish(checkpoint, settings.vllm_url, **{**settings.kwargs(), **publish_kw,
                                                    "canary": {"share": canary.share, "route": canary.route_url,
                                                               "serving": serving_version,
                                                               "serving_name": serving_name, "stable": stable},
                                                    "route": RouteMove(client, stable, serving_name, canary.share)})
    log.warning("canary: %s takes %.0f %% of the conversations asking for %r (the rest: %s)", res.lora_name,
                100 * canary.share, stable, serving_name)
    return [*repaired, *res.repaired,
            f"canary: {res.version} as {res.lora_name!r} takes {100 * canary.share:.0f} % of the conversations "
            f"asking for {stable!r} through {canary.route_url}; {serving_name} keeps the rest",
            *("  " + x for x in res.lines()[len(res.repaired) + 1:])]


def _end_entry(entry: dict, outcome: str, why: str) -> dict:
    return {"version": entry["version"], "name": entry["name"], "endpoint": entry["endpoint"], "role": "canary_end",
            "outcome": outcome, "why": why, "time": _now()}


def stop(entry: dict, checkpoints: str, settings, canary: CanarySettings, why: str,
         outcome: str = "stopped") -> list[str]:
    """Every conversation back to the serving version, the candidate unloaded, and
    the registry told: `stopped` (production judged it worse, so nothing returns
    to it) or `expired` (production could not tell). The proxy is asked first: a
    stop it cannot route changes nothing."""
    stable = entry.get("stable") or _stable(settings)
    client = _client(canary)
    repaired = _reconcile(checkpoints, settings, client)
    if registry.canary(registry.read(checkpoints), entry["endpoint"], settings.name) != entry:
        return [*repaired, f"canary {entry['version']} already ended"]
    try:
        before = route_of(client.get(stable))
    except RouteError as e:
        raise PublishError(f"canary {entry['version']} not {outcome}: {e}; nothing was changed") from None
    # the server has no adapter under the stable name while the base serves: the route holds it then
    want = {"serving": entry["serving_name"], "candidate": None, "share": 0.0} if entry.get("serving") == BASE else None
    c = Change("canary_stop", entry["endpoint"], [_end_entry(entry, outcome, why)],
               route={"url": client.url, "stable": stable, "before": before, "want": want}, unload=entry["name"])
    run(c, checkpoints, VLLMClient(entry["endpoint"], settings.api_key, timeout=settings.timeout,
                                   retries=settings.retries), client)
    log.warning("canary %s %s: %s", entry["name"], outcome, why)
    return [*repaired,
            f"canary {outcome}: {entry['version']} ({why}); every conversation back on {entry['serving_name']}"]


def promote(entry: dict, checkpoints: str, settings, canary: CanarySettings, why: str, **publish_kw) -> list[str]:
    """The candidate to all traffic: published as any version (the stable name moves
    to it, verified), the route removed so the stable name passes through, and the
    canary's end recorded with the publication, in one commit."""
    stable = entry.get("stable") or _stable(settings)
    res = publish(entry.get("checkpoint") or "", settings.vllm_url,
                  **{**settings.kwargs(), **publish_kw, "route": RouteMove(_client(canary), stable),
                     "also": [_end_entry(entry, "promoted", why)]})
    log.warning("canary %s promoted: %s", entry["name"], why)
    return [*res.repaired, f"canary promoted: {entry['version']} now serves every conversation ({why})",
            *("  " + x for x in res.lines()[len(res.repaired):])]
