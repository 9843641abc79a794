"""The watch's settings, apart from the watch: `nightshift watch` declares its flags
from them, and the watch itself needs Polars, which no command's --help (every
parser is built for each) should wait for."""

from __future__ import annotations

from dataclasses import dataclass

from nightshift.publish.canary import CanarySettings
from nightshift.settings import setting


@dataclass
class WatchSettings:
    """After each build, production's verdict on what was published: the serving
    version against the one before it, or a canary against the serving one."""

    enabled: bool = setting(True, help="watch after each build; a worse version is rolled back (a canary stopped) "
                                       "before training starts from it")
    alpha: float = setting(0.01, help="false-alarm bound over every look: the chance of ever rolling back a version "
                                      "as good as its predecessor", bounds="(0, 1)", flag="--alpha")
    tau: float = setting(0.1, help="mixture scale: the size of difference worth finding quickly, in reward units",
                         bounds="(0, inf)", flag="--tau")
    min_trajectories: int = setting(30, help="rated trajectories each side needs before any decision",
                                    bounds="[2, inf)", flag="--min-trajectories")
    margin: float = setting(0.05, help="a canary shown, at the watch's confidence, to be no more than this far "
                                       "below the serving version (reward units) is promoted", bounds="[0, inf)",
                            flag="--margin")


@dataclass
class Watching:
    """The nightly job's `watch:` and `canary:`, which `nightshift watch` takes as
    flags too, declared apart from the job's config (nightly/run.py) so that the
    command line can be built without importing the job."""

    watch: WatchSettings = setting(factory=WatchSettings, help="the production watch")
    canary: CanarySettings = setting(factory=CanarySettings, help="canary publishing")
