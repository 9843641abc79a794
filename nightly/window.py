"""Where a night's training starts in the data (`nightly.train_window_days: 0`).

A candidate continues the adapter that serves (`nightly.init_from_published`), so
what it must learn is what that adapter has not: the data after the night that
trained it. The night before tonight is the wrong mark: a night that trained
nothing (a prompt canary held the adapter back, nothing to train on, a crash
before training) or trained a version that never served (the gate blocked it,
publishing was off or the route refused it) would move the mark past logs no
serving model ever learned, and nothing would train on them again. A candidate
that starts from the base model (nothing serves yet, `init_from_published:
false`, full weights) has learned nothing, so it takes all of the data.

The run decides its window once, when it enters the train stage, and keeps it in
its state: a resumed run trains on the same rows from the same adapter, whatever
the watch or a person did to what serves in between.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from nightshift.trainer.checkpoint import read_manifest


@dataclass
class Window:
    """Tonight's training: where its data starts and which adapter it continues."""

    since: str  # the first date trained on; "" for all of the data
    init_adapter: str  # the serving adapter training continues; "" for the base model (or train.init_adapter)
    why: str  # in words, for the report


def data_end(checkpoint: str) -> dt.date:
    """The last day of data the version at `checkpoint` learned: the day of the
    nightly run that trained it (its run id, kept as the manifest's tag: that
    run's build happened then, however late its training finished or resumed),
    else the day it was written (a version from `nightshift train`). OSError or
    ValueError when its manifest cannot tell."""
    man = read_manifest(checkpoint)
    for value in ((man.get("config") or {}).get("tag"), man.get("created")):
        try:
            return dt.datetime.fromisoformat(str(value)).date()
        except ValueError:
            continue
    raise ValueError("its manifest has neither a run id (config.tag) nor a creation time")


def choose(n, serving: dict | None, now: dt.datetime, full_finetune: bool) -> Window:
    """Tonight's window for the nightly settings `n`, given the registry entry that
    serves (None: the base model)."""
    init = ""
    if (n.init_from_published and serving and serving.get("mode") == "lora" and serving.get("checkpoint")
            and not full_finetune):
        init = str(serving["checkpoint"])
    if n.train_window_days > 0:
        since = (now.date() - dt.timedelta(days=n.train_window_days)).isoformat()
        return Window(since, init, f"the last {n.train_window_days} day(s), since {since} "
                                   "(nightly.train_window_days)")
    if not init:
        how = ("nothing serves yet" if not serving else "nightly.init_from_published is false"
               if not n.init_from_published else f"what serves, {serving.get('version')}, is not an adapter it "
               "continues")
        return Window("", "", f"all of the data: training starts from the base model ({how}), which learned none of it")
    version = serving.get("version")
    try:
        end = data_end(init)
    except (OSError, ValueError) as e:
        return Window("", init, f"all of the data: where the data of serving adapter {version} ended cannot be told "
                                f"({e})")
    since = (end - dt.timedelta(days=max(n.overlap_days, 0))).isoformat()
    return Window(since, init, f"since {since}: serving adapter {version}, which this run continues, learned the data "
                               f"up to {end}; less overlap_days {n.overlap_days}, for trajectories that settled later")
