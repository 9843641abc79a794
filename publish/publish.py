"""`nightshift publish` and `nightshift rollback`: a checkpoint version in front of
the agents on a running vLLM server, checked before and verified after.

LoRA (default): the adapter is checked against vLLM's rules and the server's
base model, placed in a folder of its own per version (vLLM keys its prefix
cache on name and path, so a path is never reused for other weights), loaded
as `<name>@<version>` (and, optionally, under a stable name moved by unload +
load: never `load_inplace`, which makes vLLM re-read the adapter every step),
verified with GET /v1/models and one chat completion, then written to the
registry; versions beyond `keep` are unloaded. Publishing again what is already
loaded and registered changes nothing.

Everything is read and checked before the server is touched, and the change is
recorded as pending in the registry first (publish/change.py): a run killed at
any step leaves it there, and the next command finishes or undoes it
(publish/recover.py), so the server and the registry agree again.

Full weights (`mode="full"`): merged, then reloaded in place with vLLM's dev-mode
`/collective_rpc reload_weights` and `/reset_prefix_cache`. Production without
dev mode: restart a second server on the merged folder and switch traffic
(blue-green).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path

from nightshift.settings import Moved, setting
from nightshift.trainer.checkpoint import MANIFEST, fetch, is_local, read_manifest, vllm_problems

from nightshift.route.client import RouteClient, RouteError

from . import registry
from .change import Change, Outcome, PublishError, RouteUnavailable, apply, models, route_of, run
from .recover import reconcile
from .registry_check import VERSION
from .vllm_client import VLLMClient, VLLMError

log = logging.getLogger("nightshift.publish")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", MANIFEST,
                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


__all__ = ["MOVED", "PublishError", "PublishResult", "PublishSettings", "RouteMove", "RouteUnavailable", "publish", "rollback"]


@dataclass
class PublishResult:
    version: str
    lora_name: str
    path: str
    endpoint: str
    mode: str
    seconds: float
    sample: str
    stable_name: str = ""
    already_loaded: bool = False
    unloaded: list[str] = field(default_factory=list)
    rollback_of: str = ""
    stable_gap: float = 0.0  # seconds the stable name was unloaded while it moved
    repaired: list[str] = field(default_factory=list)  # what an interrupted earlier change needed (publish/recover.py)

    def lines(self) -> list[str]:
        what = f"rolled back from {self.rollback_of} to" if self.rollback_of else "published"
        out = [*self.repaired, f"{what} {self.version} as {self.lora_name!r} on {self.endpoint} ({self.mode}, {self.seconds:.1f} s)",
               f"  adapter path: {self.path}"]
        if self.stable_name:
            gap = f" (absent for {1000 * self.stable_gap:.0f} ms while it moved)" if self.stable_gap else ""
            out.append(f"  stable name {self.stable_name!r} now serves {self.version}{gap}")
        if self.already_loaded:
            out.append("  (it was already loaded: nothing reloaded)")
        out.append(f"  verified: GET /v1/models lists it; a chat completion answered {self.sample!r}")
        if self.unloaded:
            out.append(f"  unloaded older versions: {', '.join(self.unloaded)}")
        return out


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._@-]+", "--", name).strip("-") or "policy"


def _version_of(name: str, prefix: str) -> int:
    m = re.fullmatch(re.escape(prefix) + r"@v(\d+)", name)
    return int(m.group(1)) if m else -1


def checkpoints_of(checkpoint: str) -> str:
    """The checkpoints folder a version belongs to (where the registry lives)."""
    return checkpoint.rstrip("/").rsplit("/", 1)[0] if "/" in checkpoint.rstrip("/") else "."


def _place(src: Path, adapter_root: str, lora_name: str) -> str:
    """Copy the adapter into its own folder under `adapter_root` (atomically; an
    identical copy already there is reused)."""
    dest = Path(adapter_root) / _safe(lora_name)
    if (dest / "adapter_config.json").exists():
        same = all((dest / f).read_bytes() == (src / f).read_bytes()
                   for f in ("adapter_config.json", "adapter_model.safetensors") if (src / f).exists())
        if same:
            return str(dest)
        raise PublishError(f"{dest} already holds different weights for {lora_name}; a path is never reused "
                           "(vLLM caches on name and path): remove it or publish under another name")
    tmp = dest.parent / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    for f in ADAPTER_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, tmp / f)
    os.rename(tmp, dest)
    return str(dest)


def _check_base(client: VLLMClient, adapter_dir: Path) -> str:
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    want = conf.get("base_model_name_or_path") or ""
    bases = [m for m in client.models() if not m.get("parent")]
    served = {m.get("id") for m in bases} | {m.get("root") for m in bases}
    if want not in served:
        names = ", ".join(sorted(str(m.get("id")) for m in bases)) or "nothing"
        raise PublishError(
            f"base model mismatch: the adapter was trained for {want!r} (adapter_config.json base_model_name_or_path) "
            f"but {client.url} serves {names}; train with --served-model-name set to the served name, or publish to a "
            "server running that base")
    return bases[0]["id"]



@dataclass
class PublishSettings:
    """How a version goes in front of the agents: YAML section `publish:`, env
    NIGHTSHIFT_PUBLISH_*, and the flags of `nightshift publish` and `rollback`; read
    by publish, rollback, watch and nightly alike (`MOVED`), declared once."""

    vllm_url: str = setting("http://127.0.0.1:8000", help="the server the agents use, e.g. http://127.0.0.1:8000",
                            metavar="URL")
    name: str = setting("policy", help="adapters are served as <name>@<version>")
    api_key: str = setting("", help="the server's --api-key")
    stable_name: str = setting("", help="also serve the version under this fixed name (moved to each new version "
                                         "by unload + load: absent for that moment)")
    adapter_root: str = setting("", help="copy the adapter into a folder of its own here, where the server can read "
                                         "it (default: load it from the checkpoint folder)", metavar="DIR")
    keep: int = setting(3, help="versions left loaded", bounds="[1, inf)")
    mode: str = setting("lora", help="lora: load the adapter at run time; full: merge it and reload the weights "
                                     "(a dev-mode server)", choices=("lora", "full"))
    max_lora_rank: int = setting(0, help="the server's --max-lora-rank, to refuse a larger adapter before loading",
                                 bounds="[0, inf)")
    base_model: str = setting("", help="--mode full: the base's local folder for merging", metavar="DIR")
    timeout: float = setting(30.0, help="seconds per request (loads get longer)", bounds="(0, inf)")
    retries: int = setting(4, help="retries on transient errors, with backoff", bounds="[0, inf)")

    def kwargs(self) -> dict:
        """`publish`'s keyword arguments (everything but the URL)."""
        return {f.name: getattr(self, f.name) for f in fields(PublishSettings) if f.name != "vllm_url"}


#: The publishing keys lived in the nightly job's section (`nightly:`,
#: NIGHTSHIFT_NIGHTLY_*) until they got a home of their own; files that still give
#: them there keep working, with a note naming the new key (settings.Moved).
MOVED = Moved(keys=tuple(f.name for f in fields(PublishSettings)), old="nightly", new="publish")


@dataclass
class RouteMove:
    """The routing proxy's route for `stable`, changed as the last step before the
    registry commits: to `serving` plus the version published at `share` (a
    canary start), or deleted (`share` None: a promotion, after which the stable
    name passes through to the server)."""

    client: RouteClient
    stable: str
    serving: str = ""
    share: float | None = None

    def want(self, lora_name: str) -> dict | None:
        return None if self.share is None else {"serving": self.serving, "candidate": lora_name, "share": self.share}


def _manifest(checkpoint: str, storage_options: dict | None) -> dict:
    try:
        manifest = read_manifest(checkpoint, storage_options)
    except FileNotFoundError:
        raise PublishError(f"{checkpoint} is not a checkpoint version (no {MANIFEST})") from None
    except (ValueError, OSError) as e:  # not JSON, not UTF-8, a folder
        raise PublishError(f"{checkpoint}/{MANIFEST} cannot be read ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("version"), str) or not VERSION.match(
            manifest["version"]):
        raise PublishError(f"{checkpoint}/{MANIFEST} names no version (a 'version' like v0003)")
    return manifest


def _route_before(route: RouteMove | None, what: str) -> dict | None:
    """The proxy's route now: read before anything moves, which also proves the
    proxy answers and takes the token."""
    if route is None:
        return None
    try:
        return route_of(route.client.get(route.stable))
    except RouteError as e:
        raise RouteUnavailable(f"{what}: {e}; nothing was loaded, moved or recorded") from None


def publish(checkpoint: str, vllm_url: str, *, name: str = "policy", api_key: str = "", stable_name: str = "",
            adapter_root: str = "", keep: int = 3, mode: str = "lora", max_lora_rank: int = 0, base_model: str = "",
            storage_options: dict | None = None, rollback_of: str = "", timeout: float = 30.0,
            retries: int = 4, canary: dict | None = None, route: RouteMove | None = None,
            also: list[dict] | None = None) -> PublishResult:
    """`canary`: load the version under its versioned name only, beside what serves
    (the stable name does not move), and register it as a canary with these
    fields. `route`: the proxy's route moved as the last step (a canary start sends
    the candidate its share; a promotion deletes the route). `also`: entries the
    registry records with this one (a promotion's `canary_end`).

    Everything is read and checked before the server is touched: the registry (a
    change an earlier run left pending is finished or undone first), the
    checkpoint, the adapter against vLLM's rules, the server's base model, the
    proxy's route. Then the change's steps run in order (publish/change.py) and
    the registry commits only after the server has verified it."""
    t0 = time.perf_counter()
    if canary is not None:
        if mode != "lora":
            raise PublishError("a canary is an adapter loaded beside the serving version: it needs mode lora")
        stable_name = ""
    op = "canary_start" if canary is not None else "canary_promote" if route is not None else "publish"
    client = VLLMClient(vllm_url, api_key, timeout=timeout, retries=retries)
    endpoint = vllm_url.rstrip("/")
    ckpts = checkpoints_of(checkpoint)
    repaired = reconcile(ckpts, api_key=api_key, timeout=timeout, retries=retries,
                         route=route.client if route else None, storage_options=storage_options)
    entries = registry.read(ckpts, storage_options)
    if not is_local(checkpoint) and not adapter_root:
        raise PublishError("the checkpoint is on an object store: give --adapter-root, a folder the server can read, "
                           "to copy it to")
    manifest = _manifest(checkpoint, storage_options)
    version = manifest["version"]
    lora_name = f"{name}@{version}"
    route_before = _route_before(route, "canary not started" if canary is not None else f"{version} not promoted")
    local = fetch(checkpoint, Path(adapter_root or ".") / f".fetch-{version}", storage_options)
    try:
        if mode == "full":
            return _publish_full(client, checkpoint, local, manifest, ckpts, endpoint, base_model, adapter_root,
                                 storage_options, rollback_of, t0, entries, repaired)
        if manifest.get("kind") != "lora":
            raise PublishError(f"{checkpoint} holds full weights: publish it with --mode full")
        problems = _adapter_config_problem(local) or vllm_problems(local, max_lora_rank or None)
        if problems:
            raise PublishError("vLLM would refuse this adapter: " + "; ".join(problems))
        _check_base(client, local)
        path = _place(local, adapter_root, lora_name) if adapter_root else str(local.resolve())
        loaded = models(client)
        before = {n: (loaded.get(n) or {}).get("root") for n in (lora_name, stable_name) if n}
        last = (registry.canary(entries, endpoint, name) if canary is not None
                else registry.serving(entries, endpoint, name))
        registered = last is not None and last.get("name") == lora_name and last.get("path") == path
        entry = {"version": version, "name": lora_name, "stable_name": stable_name or None, "path": path,
                 "endpoint": endpoint, "mode": "lora", "checkpoint": checkpoint, "rollback_of": rollback_of or None,
                 **({"role": "canary", **canary} if canary is not None else {})}
        c = Change(op, endpoint, [entry, *(also or [])], lora_name, path, stable_name, "lora", before,
                   None if route is None else {"url": route.client.url, "stable": route.stable,
                                               "before": route_before, "want": route.want(lora_name)})
        if registered and route is None and all(p == path for p in before.values()):
            out = Outcome()  # published, loaded and registered already: verified as it is, nothing changed
            apply(c, "verified", client, None, out)
        else:
            out, _ = run(c, ckpts, client, route.client if route else None, storage_options)
        keep_loaded = {lora_name}
        if canary is not None:  # what serves beside the canary stays loaded, whatever `keep` says
            keep_loaded.add(str((registry.serving(entries, endpoint, name) or {}).get("name")))
        unloaded = _prune(client, name, keep, out.served - keep_loaded)
        return PublishResult(version, lora_name, path, endpoint, "lora", time.perf_counter() - t0, out.sample,
                             stable_name, before.get(lora_name) == path, unloaded, rollback_of, out.stable_gap,
                             repaired)
    finally:
        if not is_local(checkpoint):
            shutil.rmtree(local, ignore_errors=True)


def _adapter_config_problem(adapter_dir: Path) -> list[str]:
    """adapter_config.json must be a JSON object before anything reads its keys."""
    try:
        conf = json.loads((adapter_dir / "adapter_config.json").read_bytes())
    except FileNotFoundError:
        return ["no adapter_config.json"]
    except (ValueError, OSError) as e:
        return [f"adapter_config.json unreadable: {e}"]
    return [] if isinstance(conf, dict) else ["adapter_config.json is not a JSON object"]


def _prune(client: VLLMClient, name: str, keep: int, others: set[str]) -> list[str]:
    """Unload `name@vNNNN` adapters beyond the newest `keep` (the one just
    published, which is not among `others`, counts as one of them)."""
    mine = sorted((n for n in others if _version_of(n, name) >= 0), key=lambda n: _version_of(n, name))
    gone = []
    for n in mine[: max(0, len(mine) - max(keep - 1, 0))]:
        try:
            client.unload_lora(n)
            gone.append(n)
        except VLLMError as e:
            if e.status != 404:
                log.warning("could not unload %s: %s", n, e)
    return gone


def _publish_full(client, checkpoint, local: Path, manifest, ckpts, endpoint, base_model, adapter_root,
                  storage_options, rollback_of, t0, entries, repaired) -> PublishResult:
    version = manifest["version"]
    if manifest.get("kind") == "full":
        weights = str(local.resolve())
    else:
        from nightshift.trainer.merge import merge

        dest = Path(adapter_root or (ckpts if is_local(ckpts) else ".")) / "merged" / version
        if not (dest / "config.json").exists():
            merge(local, dest, base_model)
        weights = str(dest.resolve())
    bases = [m for m in client.models() if not m.get("parent")]
    if not bases:
        raise PublishError(f"{client.url} lists no base model (GET /v1/models): nothing to reload weights into")
    base = str(bases[0]["id"])
    served = next((e for e in reversed(entries) if e.get("endpoint") == endpoint and e.get("mode") == "full"
                   and e.get("role") is None), None)
    before = {base: (served or {}).get("path") or bases[0].get("root")}
    entry = {"version": version, "name": base, "stable_name": None, "path": weights, "endpoint": endpoint,
             "mode": "full", "checkpoint": checkpoint, "rollback_of": rollback_of or None}
    c = Change("publish", endpoint, [entry], base, weights, "", "full", before)
    out, _ = run(c, ckpts, client, None, storage_options)
    return PublishResult(version, base, weights, endpoint, "full", time.perf_counter() - t0, out.sample,
                         rollback_of=rollback_of, repaired=repaired)


def rollback(checkpoints: str, vllm_url: str, *, name: str = "policy", **kw) -> PublishResult:
    """Publish again the newest version older than the one serving whose folder is
    still in `checkpoints` and that production never judged worse (rolled back, or
    a canary stopped: going back to it would undo that judgement): one deleted
    from disk is skipped (and logged), and when every older one is gone it
    refuses, naming the missing folders, before touching the server or the
    registry. Canaries never count as having served. A change an earlier run left
    pending is finished or undone first, so the version rolled back is the one
    that really serves."""
    repaired = reconcile(checkpoints, api_key=kw.get("api_key", ""), timeout=kw.get("timeout", 30.0),
                         retries=kw.get("retries", 4), storage_options=kw.get("storage_options"))
    entries = registry.read(checkpoints, kw.get("storage_options"))
    endpoint = vllm_url.rstrip("/")
    mine = [e for e in registry.lane(entries, endpoint, name) if e.get("role") not in registry.CANARY_ROLES]
    if not mine:
        raise PublishError(f"nothing has been published to {endpoint} as {name!r} (see {checkpoints}/published.json)")
    now = mine[-1]["version"]

    def number(v) -> int:  # -1 for what is not vNNNN: never a target
        m = re.fullmatch(r"v(\d+)", str(v))
        return int(m.group(1)) if m else -1

    worse = registry.judged_worse(entries, endpoint, name)
    older = sorted({e["version"] for e in mine if 0 <= number(e["version"]) < number(now)}, key=number)
    if older and not set(older) - worse:
        raise PublishError(f"cannot roll back {now} on {endpoint}: every older version was judged worse in production "
                           f"({', '.join(older)}); nothing was changed. Publish another version")
    older = [v for v in older if v not in worse]
    if not older:
        raise PublishError(f"{now} is the oldest version published to {endpoint}: nothing to roll back to")
    missing = []
    for target in reversed(older):
        folder = f"{checkpoints.rstrip('/')}/{target}"
        try:
            _manifest(folder, kw.get("storage_options"))
        except PublishError as e:  # deleted, or its manifest unreadable: not a version to go back to
            missing.append(folder)
            log.warning("rollback of %s: %s", now, e)
            continue
        if missing:
            log.warning("rollback of %s: skipping %s (deleted from disk) for %s", now, ", ".join(missing), target)
        mode = next(e["mode"] for e in reversed(mine) if e["version"] == target)
        res = publish(folder, vllm_url, name=name, rollback_of=now, mode=mode, **kw)
        res.repaired = repaired + res.repaired
        return res
    raise PublishError(f"cannot roll back {now} on {endpoint}: every older version's folder has been deleted "
                       f"({', '.join(missing)}: no {MANIFEST}); nothing was changed, {now} still serves. Restore one "
                       "of them or publish another version")
