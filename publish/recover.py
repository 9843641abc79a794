"""After a process was killed in the middle of a change (publish/change.py):
finish or undo what `published.json` records as pending, so the server, the
routing proxy and the registry agree again. Every command that changes anything
(publish, rollback, a canary's start, stop or promotion, the watch) calls
`reconcile` first, and says what it repaired.

One rule per kind of change, chosen by what is safe without guessing:

- a publication, a rollback, a canary start, a promotion: if the server (and the
  proxy) already show all of it, the kill came after the last step: it is
  verified with a chat completion and recorded. Otherwise it is undone, back to
  the paths and route recorded before it began, so what the registry says serves
  is what serves. It is never finished from the middle: the command that wanted
  it can simply be run again (a promotion is decided again by the next look).
- a canary stop: finished, every step again (production judged the candidate
  worse; putting it back in front of conversations would undo that judgement).
- full weights: the server cannot say which weights it holds, so the reload is
  done again, verified and recorded.

A repair that cannot reach the server or the proxy leaves the change pending and
says so; nothing else is attempted until it can.
"""

from __future__ import annotations

import logging

from nightshift.route.client import RouteClient, RouteError

from . import registry
from .change import Change, Outcome, PublishError, apply, complete, undo
from .vllm_client import VLLMClient, VLLMError

log = logging.getLogger("nightshift.publish.recover")


def reconcile(checkpoints: str, *, api_key: str = "", timeout: float = 30.0, retries: int = 4,
              route: RouteClient | None = None, storage_options: dict | None = None) -> list[str]:
    """Finish or undo the pending change, if there is one; returns what was done,
    in words (nothing when there was nothing to do). `route`: a client of the
    routing proxy with its token (the change records the proxy's address only)."""
    pending = registry.load(checkpoints, storage_options).pending
    if pending is None:
        return []
    c = Change.of(pending)
    client = VLLMClient(c.endpoint, api_key, timeout=timeout, retries=retries)
    proxy = None
    if c.route is not None:
        proxy = RouteClient(c.route["url"], route.token if route is not None else "")
    what = c.describe()
    try:
        if c.op == "canary_stop" or c.mode == "full":
            out = Outcome()
            for step in c.steps():
                apply(c, step, client, proxy, out)
            registry.commit(checkpoints, c.entries, storage_options)
            line = f"repaired: {what} was interrupted; finished now and recorded in published.json"
        else:
            line = ""
            if complete(c, client, proxy):
                try:
                    apply(c, "verified", client, proxy, Outcome())
                    registry.commit(checkpoints, c.entries, storage_options)
                    line = (f"repaired: {what} was interrupted after the server had taken all of it: verified and "
                            "recorded in published.json now")
                except (PublishError, VLLMError) as e:
                    if isinstance(e, VLLMError) and e.status == 0:
                        raise
                    log.warning("%s: complete on the server but it does not verify (%s): undoing it", what, e)
            if not line:
                done = undo(c, client, proxy)
                registry.abort(checkpoints, storage_options)
                line = (f"repaired: {what} was interrupted before it was complete: undone "
                        f"({'; '.join(done) or 'the server had not changed yet'}); what published.json says serves "
                        "is what serves")
    except (VLLMError, RouteError) as e:
        raise PublishError(f"{what} was interrupted and cannot be repaired yet ({e}); it stays pending in "
                           f"{registry.path_of(checkpoints)}, and the next publish, rollback or watch tries "
                           "again") from None
    log.warning("%s", line)
    return [line]
