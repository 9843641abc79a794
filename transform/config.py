"""`nightshift build`'s settings (YAML section `transform:`), with the defaults
that fit a first run: one trajectory per trace, every call credited with the
trajectory's reward (LightningRL's choice), advantages against the same task's
other attempts when there are any.
"""

from __future__ import annotations

from dataclasses import dataclass

from nightshift.settings import invalid, setting, validate

CREDIT_STRATEGIES = ("identical", "discounted", "last", "per_step")
BASELINES = ("group", "batch", "none")
WEIGHTINGS = ("trajectory", "step")
SOURCES = ("feedback", "function", "span")
ENGINES = ("local", "ray")


_DATE = r"\d{4}-\d{2}-\d{2}"


@dataclass
class RewardConfig:
    """Where a trajectory's reward comes from (span attributes, feedback, your functions)."""

    name: str = setting("", help="which named reward is the outcome (empty: the primary one: element 0 of Agent "
                                 "Lightning's list, or the first name seen)")
    keys: list[str] = setting(factory=list, help="more span attribute keys holding a reward, e.g. app.reward")
    functions: list[str] = setting(factory=list, help="reward functions, module:function, called with each "
                                                      "trajectory", pattern=r"[\w.]+:[\w.]+",
                                   metavar="MODULE:FUNCTION,...")
    prefer: list[str] = setting(factory=lambda: list(SOURCES), help="which source wins when several give a "
                                                                    "reward to one trajectory", choices=SOURCES)
    default: str = setting("", help="reward for trajectories nobody rated (empty: leave them unrated)",
                           pattern=r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", metavar="NUMBER")


@dataclass
class CreditConfig:
    """How the outcome is shared among a trajectory's calls."""

    strategy: str = setting("identical", help="identical (every call gets the outcome), discounted (gamma per step "
                                              "back), last (only the last call), per_step (rewards to go)",
                            choices=CREDIT_STRATEGIES, flag="--credit")
    gamma: float = setting(0.9, help="the discount of discounted and per_step", bounds="[0, 1]")
    tool_error_penalty: float = setting(0.5, help="subtracted from the return of a call whose tool call came back "
                                                  "as an error (its result matches tool_error_pattern): it should "
                                                  "not share the credit of the calls around it; 0 turns it off",
                                        bounds="[0, inf)")
    tool_error_pattern: str = setting(r"(?i)\b(error|exception|traceback|failed|not found|invalid|no such tool)\b",
                                      help="a tool result matching this regex was an error", regex=True,
                                      metavar="REGEX")


@dataclass
class AdvantageConfig:
    """What each call's return is compared with."""

    baseline: str = setting("group", help="group (mean return of the same task's trajectories, batch mean for "
                                          "groups of one), batch or none", choices=BASELINES)
    normalize: bool = setting(False, help="divide by the group's (or batch's) standard deviation")
    weighting: str = setting("trajectory", help="trajectory (each trajectory weighs 1, spread over its calls) or "
                                                "step (each call weighs 1)", choices=WEIGHTINGS)


@dataclass
class BuildConfig:
    """Where the buckets of traces are built: one after another in this process, or as
    tasks on Ray when one machine's cores are not enough. The rows are the same."""

    engine: str = setting("local", help="local (buckets one after another in this process) or ray (each bucket a "
                                        "Ray task: on a local cluster of build.workers processes, or on the cluster "
                                        "at build.ray_address); the same rows either way", choices=ENGINES)
    ray_address: str = setting("", help="the Ray cluster to run on (host:6379, ray://host:10001 or auto); empty: "
                                        "RAY_ADDRESS if set, else a local cluster started for this build; the data "
                                        "folder must be one every node reaches at the same path",
                               metavar="ADDRESS")
    workers: int = setting(0, help="processes of the local Ray cluster (0: one per core of this machine)",
                           bounds="[0, inf)")
    buckets: int = setting(0, help="at least this many buckets of traces (0: as many as memory_budget needs); Ray "
                                   "runs them side by side, so give it a few per worker; rows are the same, their "
                                   "order within a partition follows the buckets", bounds="[0, inf)")


@dataclass
class TransformConfig:
    """Which spans become which trajectories and transitions."""

    data: str = setting("./nightshift-data", help="dataset root: a folder or an fsspec URL", metavar="DIR|URL")
    trajectory: str = setting("trace", help="trace; conversation (calls sharing gen_ai.conversation.id / "
                                            "session.id across traces); linked (traces joined by span links: "
                                            "AutoGen teams without a span around team.run())",
                              choices=("trace", "conversation", "linked"))
    group_by: str = setting("first_user_message", help="what makes two trajectories the same task: "
                                                       "first_user_message, conversation, attribute:<key> or none",
                            pattern=r"first_user_message|conversation|none|attribute:.+",
                            metavar="first_user_message|conversation|none|attribute:KEY")
    settle: float = setting(600.0, help="build a trajectory once nothing has arrived for it for this long by the "
                                        "build's clock (six times this long if its root span never ended; 0 = now)",
                            bounds="[0, inf)", metavar="DURATION")
    since: str = setting("", help="first date of spans to build from (default: all)", pattern=_DATE,
                         metavar="YYYY-MM-DD")
    until: str = setting("", help="last date (default: all)", pattern=_DATE, metavar="YYYY-MM-DD")
    agents_include: str = setting("", help="regex on the agent name: only these agents' calls become rows",
                                  regex=True, metavar="REGEX")
    agents_exclude: str = setting("", help="regex on the agent name: these agents' calls do not", regex=True,
                                  metavar="REGEX")
    memory_budget: int = setting(512 << 20, help="peak memory to aim for; more data is processed in buckets of "
                                                 "traces", bounds="[1, inf)", metavar="SIZE")
    incremental: bool = setting(False, help="rebuild only the dates whose rows changed since the last build (new "
                                            "or late spans however late, log events, feedback added or removed, "
                                            "trajectories that settled): the same rows as a full build; a rerun "
                                            "with nothing new writes nothing; what `nightly` runs")
    storage_options: dict = setting(factory=dict, help="passed to fsspec for data")
    reward: RewardConfig = setting(factory=RewardConfig, help="rewards")
    credit: CreditConfig = setting(factory=CreditConfig, help="credit assignment")
    advantage: AdvantageConfig = setting(factory=AdvantageConfig, help="advantages")
    build: BuildConfig = setting(factory=BuildConfig, help="where the buckets are built (this process, or Ray)")

    def rules(self) -> None:
        if self.incremental and (self.since or self.until):
            raise invalid("incremental", "incremental builds find their own dates from what changed; drop since/until "
                                         f"(got since={self.since!r}, until={self.until!r})")

    def check(self) -> None:
        """Refuse settings that would silently do something else."""
        validate(self, "transform")


@dataclass
class RetentionConfig:
    """How long the lake keeps its data."""

    days: int = setting(0, help="days of data kept besides today: a date partition older than this (spans, logs, "
                                "feedback and the transitions built from them) is deleted by `nightshift prune` and by "
                                "the nightly job before it builds, with every span of the traces that started in it; "
                                "0 keeps everything", bounds="[0, inf)")

    def check(self) -> None:
        validate(self, "retention")


@dataclass
class CompactionConfig:
    """Small files of past dates merged into bigger ones."""

    enabled: bool = setting(True, help="merge the small files of past dates (UTC) in spans/, logs/ and feedback/ "
                                       "before the nightly build (`nightshift compact` by hand)")
    target_bytes: int = setting(64 << 20, help="size a merged file grows to; a file half this size or more is "
                                               "left as it is", bounds="[1, inf)", metavar="SIZE")

    def check(self) -> None:
        validate(self, "compaction")
