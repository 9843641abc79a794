"""`nightshift build`'s settings (YAML section `transform:`), with the defaults
that fit a first run: one trajectory per trace, every call credited with the
trajectory's reward (LightningRL's choice), advantages against the same task's
other attempts when there are any.
"""

from __future__ import annotations

import math
import re

from dataclasses import dataclass, field

CREDIT_STRATEGIES = ("identical", "discounted", "last", "per_step")
BASELINES = ("group", "batch", "none")
WEIGHTINGS = ("trajectory", "step")
SOURCES = ("feedback", "function", "span")


@dataclass
class RewardConfig:
    """`name`: which named reward is the outcome (`""`: the primary one: element 0
    of Agent Lightning's list, or the first name seen). `keys`: extra span attribute
    keys holding a reward (e.g. `app.reward`). `functions`: `module:function` names
    of user reward functions, called with each trajectory. `prefer`: which source
    wins when several give a reward to the same trajectory."""

    name: str = ""
    keys: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    prefer: list[str] = field(default_factory=lambda: list(SOURCES))
    default: str = ""  # reward for trajectories nobody rated ("" = leave them unrated)


@dataclass
class CreditConfig:
    """`strategy`: identical | discounted | last | per_step. `gamma`: the discount
    of `discounted` and `per_step`. `tool_error_penalty`: subtracted from the
    return of a call whose tool call came back as an error (the tool's result, as
    the next call saw it, matches `tool_error_pattern`): with a trajectory-wide
    outcome, the call that caused the trouble should not share the credit of
    the calls around it (0 turns it off)."""

    strategy: str = "identical"
    gamma: float = 0.9
    tool_error_penalty: float = 0.5
    tool_error_pattern: str = r"(?i)\b(error|exception|traceback|failed|not found|invalid|no such tool)\b"


@dataclass
class AdvantageConfig:
    """`baseline`: group (mean return of the same task's trajectories, batch mean for
    groups of one) | batch | none. `normalize`: divide by the group's (or batch's)
    standard deviation. `weighting`: trajectory (each trajectory weighs 1 in
    total, spread over its calls) | step (each call weighs 1)."""

    baseline: str = "group"
    normalize: bool = False
    weighting: str = "trajectory"


@dataclass
class TransformConfig:
    """`trajectory`: trace | conversation (calls sharing `gen_ai.conversation.id` /
    `session.id` across traces form one trajectory) | linked (traces joined by
    span links form one: AutoGen teams without a span around `team.run()`). `group_by`: what makes two
    trajectories the same task: first_user_message | conversation | attribute:<key> |
    none. `settle`: a trajectory is built once nothing has arrived for it for this
    long (seconds; `10m` works). `agents_include`/`agents_exclude`: regexes on the
    agent name, selecting whose calls become rows."""

    data: str = "./nightshift-data"
    trajectory: str = "trace"
    group_by: str = "first_user_message"
    settle: float = 600.0
    since: str = ""
    until: str = ""
    agents_include: str = ""
    agents_exclude: str = ""
    memory_budget: int = 512 << 20  # peak memory to aim for; more data is processed in buckets of traces
    incremental: bool = False  # rebuild only the dates whose spans or feedback changed since the last build
    storage_options: dict = field(default_factory=dict)
    reward: RewardConfig = field(default_factory=RewardConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)

    def check(self) -> None:
        """Refuse settings that would silently do something else."""
        from nightshift.settings import SettingsError

        if self.credit.strategy not in CREDIT_STRATEGIES:
            raise SettingsError(f"credit.strategy must be one of {', '.join(CREDIT_STRATEGIES)}, got {self.credit.strategy!r}")
        if not math.isfinite(self.credit.tool_error_penalty) or self.credit.tool_error_penalty < 0:
            raise SettingsError(f"credit.tool_error_penalty must be >= 0, got {self.credit.tool_error_penalty}")
        try:
            re.compile(self.credit.tool_error_pattern)
        except re.error as e:
            raise SettingsError(f"credit.tool_error_pattern: not a valid regex: {e}") from None
        if not 0.0 <= self.credit.gamma <= 1.0:
            raise SettingsError(f"credit.gamma must be in [0, 1], got {self.credit.gamma}")
        if self.advantage.baseline not in BASELINES:
            raise SettingsError(f"advantage.baseline must be one of {', '.join(BASELINES)}, got {self.advantage.baseline!r}")
        if self.advantage.weighting not in WEIGHTINGS:
            raise SettingsError(f"advantage.weighting must be one of {', '.join(WEIGHTINGS)}")
        if self.trajectory not in ("trace", "conversation", "linked"):
            raise SettingsError(f"trajectory must be trace, conversation or linked, got {self.trajectory!r}")
        g = self.group_by
        if g not in ("first_user_message", "conversation", "none") and not g.startswith("attribute:"):
            raise SettingsError(f"group_by must be first_user_message, conversation, none or attribute:<key>, got {g!r}")
        bad = [s for s in self.reward.prefer if s not in SOURCES]
        if bad:
            raise SettingsError(f"reward.prefer: unknown sources {bad} (known: {', '.join(SOURCES)})")
        for fn in self.reward.functions:
            if ":" not in fn:
                raise SettingsError(f"reward.functions: {fn!r} must be module:function")

        if self.incremental and (self.since or self.until):
            raise SettingsError("incremental builds find their own dates from what changed; drop since/until "
                                f"(got since={self.since!r}, until={self.until!r})")
        for what in ("agents_include", "agents_exclude"):
            try:
                re.compile(getattr(self, what))
            except re.error as e:
                raise SettingsError(f"{what}: not a valid regex: {e}") from None
        if self.reward.default:
            try:
                float(self.reward.default)
            except ValueError:
                raise SettingsError(f"reward.default must be a number, got {self.reward.default!r}") from None
