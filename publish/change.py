"""One change to what the agents get, as steps the server and the routing proxy
take in a fixed order, bracketed by the registry (publish/registry.py):

    begin     published.json records the change as pending
    loaded    the version under its versioned name (`agent@v0004`)
    stable    the stable name moved to it               (publications, promotions)
    verified  GET /v1/models lists it; a chat completion answers
    routed    the proxy's route set, or deleted          (canary starts, promotions)
    commit    its entries appended, pending cleared, in one write

A canary's stop: begin -> routed (every conversation back on the serving
version) -> unloaded (the candidate) -> commit. Full weights: begin -> reloaded
-> verified -> commit. Every step is validated for before `begin` (the caller
reads the registry, the checkpoint, the adapter, the server's base model and
the proxy's route first), and every step is safe to repeat.

A step that fails undoes the ones before it (`undo`: the route, the stable name
and the versioned name back to the paths recorded in `before`), then the pending
change is cleared, so the error reaches the user with nothing changed. A stop is
never undone (production judged the candidate worse: it is finished instead),
and its unload is tidying up: once the route sends the candidate nothing, an
unload that fails is logged and the stop recorded.
A process killed between two steps leaves the change pending: publish/recover.py
finishes or undoes it on the next command. Between every two steps there is a
failpoint (publish/failpoints.py: `<op>.<step>`) where a test kills the process.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, fields

from nightshift.route.client import RouteClient, RouteError

from . import failpoints, registry
from .vllm_client import VLLMClient, VLLMError

log = logging.getLogger("nightshift.publish")


class PublishError(RuntimeError):
    pass


class RouteUnavailable(PublishError):
    """The routing proxy could not be used, and nothing was left changed: a canary
    was not started (the nightly job goes on rather than wait for it)."""


@dataclass
class Change:
    """What one command changes, recorded as `pending` in published.json before the
    server is touched; everything recovery needs to finish or undo it."""

    op: str  # publish | canary_start | canary_stop | canary_promote
    endpoint: str
    entries: list[dict]  # what the registry gains when it commits
    lora_name: str = ""  # the adapter it loads (the base model's name for full weights)
    path: str = ""  # from where
    stable_name: str = ""  # moved to `path`
    mode: str = "lora"
    before: dict[str, str | None] = field(default_factory=dict)  # name -> its path before (None: not loaded)
    route: dict | None = None  # {"url", "stable", "before": {...} | None, "want": {...} | None (deleted)}
    unload: str = ""  # a stopped canary's adapter

    @classmethod
    def of(cls, d: dict) -> Change:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d and d[f.name] is not None})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def version(self) -> str:
        return str(self.entries[0]["version"])

    def steps(self) -> list[str]:
        if self.op == "canary_stop":
            return ["routed", "unloaded"]
        if self.mode == "full":
            return ["reloaded", "verified"]
        return ["loaded", *(["stable"] if self.stable_name else []), "verified", *(["routed"] if self.route else [])]

    def describe(self) -> str:
        what = {"publish": "the publication", "canary_start": "the canary start",
                "canary_stop": "the canary stop", "canary_promote": "the promotion"}[self.op]
        back = next((e.get("rollback_of") for e in self.entries if e.get("rollback_of")), None)
        return (f"{what} of {self.version}" + (f" (a rollback from {back})" if back else "")
                + f" on {self.endpoint}")


def models(client: VLLMClient) -> dict[str, dict]:
    return {str(m.get("id")): m for m in client.models()}


def _same_route(current: dict | None, want: dict | None) -> bool:
    if want is None or current is None:
        return want is None and current is None
    return (current.get("serving") == want.get("serving") and current.get("candidate") == want.get("candidate")
            and abs(float(current.get("share") or 0) - float(want.get("share") or 0)) < 1e-9)


def route_of(route: dict | None) -> dict | None:
    """The part of a proxy's route a change sets and restores."""
    return None if route is None else {k: route.get(k) for k in ("serving", "candidate", "share")}


def _route_to(client: RouteClient, stable: str, want: dict | None) -> None:
    if want is None:
        client.delete(stable)
    else:
        client.set(stable, want["serving"], want.get("candidate"), float(want.get("share") or 0.0))


def load_fresh(client: VLLMClient, name: str, path: str, loaded: bool) -> float:
    """Load `name` from `path` as a new adapter, never with `load_inplace: true`
    (vLLM then re-reads the adapter from disk on every model step: vllm issue
    33791): a name already loaded is unloaded first. Returns the seconds the name
    was absent (0 when it was not loaded), the window in which a request for it
    is answered 404, which an OpenAI client does not retry (it retries 408, 409,
    429 and 5xx): the agent's call fails, so the window is kept short."""
    if not loaded:
        client.load_lora(name, path, load_inplace=False)
        return 0.0
    t = time.perf_counter()
    unload_quietly(client, name)
    client.load_lora(name, path, load_inplace=False)
    return time.perf_counter() - t


def unload_quietly(client: VLLMClient, name: str) -> None:
    """Unload `name`; already gone is what was wanted."""
    try:
        client.unload_lora(name)
    except VLLMError as e:
        if e.status != 404:
            raise


def reset_prefix_cache(client: VLLMClient) -> None:
    """After adapters change, drop cached prefixes (vllm issue 42125). The route
    exists only in vLLM's dev mode; without it a freshly loaded adapter has a new
    id, which its cache keys on, so nothing stale can be served."""
    try:
        client.reset_prefix_cache()
    except VLLMError as e:
        if e.status != 404:
            log.warning("POST /reset_prefix_cache failed: %s", e)


@dataclass
class Outcome:
    sample: str = ""  # what the verifying chat completion answered
    stable_gap: float = 0.0  # seconds the stable name was absent while it moved
    served: set[str] = field(default_factory=set)  # names GET /v1/models listed at verification


def apply(c: Change, step: str, client: VLLMClient, route: RouteClient | None, out: Outcome) -> None:
    """Do one step; each is a no-op when its effect is already there."""
    if step == "loaded":
        now = models(client)
        if (now.get(c.lora_name) or {}).get("root") != c.path:
            load_fresh(client, c.lora_name, c.path, c.lora_name in now)
    elif step == "stable":
        now = models(client)
        if (now.get(c.stable_name) or {}).get("root") != c.path:
            out.stable_gap = load_fresh(client, c.stable_name, c.path, c.stable_name in now)
    elif step == "reloaded":
        try:
            client.reload_weights(c.path)
        except VLLMError as e:
            if e.status == 404:
                raise PublishError(
                    "the server has no /collective_rpc: in-place weight reloads need vLLM started with "
                    "VLLM_SERVER_DEV_MODE=1 (keep those routes private: --api-key does not guard them). Without dev "
                    f"mode, start a second server on {c.path} and switch traffic to it (blue-green).") from None
            raise
    elif step == "verified":
        if c.mode == "full":
            client.reset_prefix_cache()
        elif c.before.get(c.lora_name) != c.path or c.stable_name and c.before.get(c.stable_name) != c.path:
            reset_prefix_cache(client)
        out.served = set(models(client))
        missing = [n for n in (c.lora_name, c.stable_name) if n and n not in out.served]
        if missing:
            raise PublishError(f"the server accepted the load but GET /v1/models does not list {missing}")
        out.sample = client.chat(c.lora_name)["choices"][0]["message"].get("content") or ""
    elif step == "routed":
        assert route is not None and c.route is not None
        if not _same_route(route_of(route.get(c.route["stable"])), c.route.get("want")):
            _route_to(route, c.route["stable"], c.route.get("want"))
    elif step == "unloaded":
        try:
            unload_quietly(client, c.unload)
        except VLLMError as e:  # the route no longer sends it anything: said, and the stop is recorded
            log.warning("canary %s: could not unload it: %s", c.unload, e)
    else:
        raise AssertionError(step)


def complete(c: Change, client: VLLMClient, route: RouteClient | None) -> bool:
    """Whether the server (and the proxy) already show everything the change does."""
    now = models(client)
    if c.lora_name and (now.get(c.lora_name) or {}).get("root") != c.path:
        return False
    if c.stable_name and (now.get(c.stable_name) or {}).get("root") != c.path:
        return False
    if c.route is not None:
        assert route is not None
        return _same_route(route_of(route.get(c.route["stable"])), c.route.get("want"))
    return True


def undo(c: Change, client: VLLMClient, route: RouteClient | None, reloaded: bool = True) -> list[str]:
    """Put back what the change moved: the route first (no conversation is sent to
    an adapter about to go), then the stable name, then the versioned name. Returns
    what it did, in words. Full weights cannot be read back from the server:
    `reloaded` False says the reload was refused, so nothing is reloaded."""
    done = []
    if c.route is not None:
        assert route is not None
        before = c.route.get("before")
        if not _same_route(route_of(route.get(c.route["stable"])), before):
            if before is None:
                route.delete(c.route["stable"])
            else:
                _route_to(route, c.route["stable"], before)
            done.append(f"route for {c.route['stable']!r} restored")
    if c.mode == "full":
        if reloaded and c.before.get(c.lora_name):
            client.reload_weights(str(c.before[c.lora_name]))
            client.reset_prefix_cache()
            done.append(f"weights {c.before[c.lora_name]} reloaded")
        return done
    now = models(client)
    for name in (c.stable_name, c.lora_name):
        if not name or name not in c.before:
            continue
        was, root = c.before[name], (now.get(name) or {}).get("root")
        if root == was:
            continue
        if was is None:
            unload_quietly(client, name)
            done.append(f"{name} unloaded")
        else:
            load_fresh(client, name, was, name in now)
            done.append(f"{name} back on {was}")
    if done:
        reset_prefix_cache(client)
    return done


def run(c: Change, checkpoints: str, client: VLLMClient, route: RouteClient | None,
        storage_options: dict | None = None) -> tuple[Outcome, list[dict]]:
    """Record the change as pending, take its steps, commit it. Returns what the
    steps saw and the entries recorded. On a failure: undone and cleared (a stop:
    left pending for the next command to finish), then raised."""
    registry.begin(checkpoints, c.to_dict(), storage_options)
    failpoints.hit(f"{c.op}.begin")
    out, step = Outcome(), ""
    try:
        for step in c.steps():
            apply(c, step, client, route, out)
            failpoints.hit(f"{c.op}.{step}")
    except Exception as e:
        if c.op == "canary_stop":
            raise PublishError(f"{e}; the stop stays pending in {registry.path_of(checkpoints)} and the next "
                               "watch or publish finishes it") from None
        refused = isinstance(e, PublishError) or isinstance(e, VLLMError) and 400 <= e.status < 500
        try:
            undone = undo(c, client, route, reloaded=not (step == "reloaded" and refused))
            registry.abort(checkpoints, storage_options)
        except (VLLMError, RouteError, PublishError, OSError) as u:
            raise PublishError(f"{e}; undoing it failed too ({u}): {c.describe()} stays pending in "
                               f"{registry.path_of(checkpoints)} and the next publish, rollback or watch finishes "
                               "or undoes it") from None
        if undone:
            log.warning("%s failed and was undone: %s", c.describe(), "; ".join(undone))
        if isinstance(e, RouteError):
            raise RouteUnavailable(f"{e}; {c.describe()} was undone ({'; '.join(undone) or 'nothing had changed'}) "
                                   "and nothing was recorded") from None
        raise
    added = registry.commit(checkpoints, c.entries, storage_options)
    failpoints.hit(f"{c.op}.committed")
    return out, added
