"""`nightshift train`'s settings (YAML section `train:`), one dataclass per concern,
TRL-style: the defaults are the common case (LoRA on every linear layer,
rejection-sampling `sft` on rewarded calls, the objective benchmarks/learning.py
found best and safest on logged calls; bf16 on a GPU and fp32 on a CPU), every
field documented where it is declared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALGORITHMS = ("pg", "awr", "sft", "kto", "dpo")
CLIP_MODES = ("topr", "ppo", "truncate", "none")
MU_SOURCES = ("auto", "logged")
REFERENCES = ("base", "init")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
#: The ranks vLLM's `--max-lora-rank` may take (vllm/config/lora.py); an adapter's
#: `r` must not exceed the server's setting.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class SelectConfig:
    """Which transitions to train on, applied lazily in Polars before anything is
    read. `since`/`until`: dates (YYYY-MM-DD) of the `date` partition, inclusive.
    `agents`: whose calls to train on: names (`writer,rewriter`, or a YAML list),
    matched exactly, or a regex matched against the whole `agent_name`
    (`writer|re.*`, or `re:` before it). `models`: keep rows whose
    `request_model` (what the agent asked for) or `model` is one of these (empty:
    all). `require_reward`: leave out rows nobody rated (their reward is null). `max_rows`: cap, newest first (0: no cap)."""

    since: str = ""
    until: str = ""
    agents: str | list[str] = ""
    models: list[str] = field(default_factory=list)
    require_reward: bool = True
    max_rows: int = 0


@dataclass
class LoraSettings:
    """LoRA as vLLM can serve it: no DoRA, no bias, no `modules_to_save`.
    `r` must not exceed the server's `--max-lora-rank`. `target_modules`:
    `all-linear` (every linear layer but the LM head) or a comma-separated list."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str = "all-linear"


@dataclass
class PGSettings:
    """Policy gradient on logged calls (see trainer/pg.py for the why).

    `clip`: how the ratio π/μ against the policy μ that made each call enters:
    `topr` (the default: positives without a ratio, negatives with clip(π/μ, 0, 1)),
    `ppo` (PPO's clipped surrogate against μ, `epsilon`), `truncate` (truncated
    importance weight, at most `truncate_max`) or `none` (raw ratio). There is no
    clip against the policy training starts from: that capped every gain.
    `mu`: where μ's token log-probs come from: `auto` = logged ones where the row
    carries them for our tokens, otherwise recomputed with the weights of the
    version that produced the call (`policy_version`: a checkpoint under
    `output`, or the base model) at the request's temperature; `logged` = only
    logged ones. `unknown_mu_negatives`: the ratio given to negative rows whose
    μ is known neither way (0: left out, the safe choice).
    `baseline_offset`: added to every advantage, i.e. the baseline set that much
    below the mean (AsymRE, arXiv 2506.20520: a baseline above the behaviour
    policy's mean collapses training, slightly below is stable), in the
    advantage's units. The baseline itself (per group of repeated states, else
    the batch) is the transform's `advantage.baseline`.
    `kl_coef`: weight of a KL penalty to the `reference` policy: `base` (the base
    model, adapter off) or `init` (the policy training started from, e.g. the
    published adapter); 0 turns it off and skips the reference pass.
    `normalize_advantages`: rescale advantages to unit standard deviation over
    the training rows (the transform may have normalized them already)."""

    clip: str = "topr"
    epsilon: float = 0.2
    truncate_max: float = 2.0
    mu: str = "auto"
    unknown_mu_negatives: float = 0.0
    baseline_offset: float = 0.1
    kl_coef: float = 0.0
    reference: str = "base"
    normalize_advantages: bool = False


@dataclass
class AWRSettings:
    """Advantage-weighted regression (arXiv 1910.00177): the log-likelihood of each
    call weighted by exp(A / `beta`), weights normalized to mean 1 over the rows
    and capped at `max_weight`. Never pushes anything down, so it cannot break the
    format the way negative gradients can; a low `beta` approaches filtered SFT."""

    beta: float = 0.5
    max_weight: float = 20.0


@dataclass
class KTOSettings:
    """TRL's `KTOTrainer`: a row is desirable when its reward is above `threshold`.
    `beta`: KTO's temperature. Desirable and undesirable weights are balanced
    from their counts into the range TRL recommends."""

    threshold: float = 0.5
    beta: float = 0.1


@dataclass
class DPOSettings:
    """TRL's `DPOTrainer` on pairs built within a `group_id` from rows with the same
    prompt (input messages and tools): the highest against the lowest reward,
    when they differ by at least `min_margin`."""

    min_margin: float = 0.1
    beta: float = 0.1


@dataclass
class SFTSettings:
    """TRL's `SFTTrainer` on the best rows (rejection-sampling fine-tuning, the
    baseline): rows with reward >= `threshold`, or, with `top_k` > 0, the `top_k`
    best of each `group_id` among those."""

    threshold: float = 0.5
    top_k: int = 0


@dataclass
class TrainConfig:
    """`data`: the dataset root holding `transitions/`. `base_model`: a local
    folder (or a name already in the local Hugging Face cache: nothing is
    downloaded). `served_model_name`: the name the serving engine knows the base
    by, written as the adapter's `base_model_name_or_path` (vLLM's resolver
    requires it to equal `--model`; default: `base_model`). `output`: where
    versioned checkpoints go, a folder or an fsspec URL. `init_adapter`: a LoRA
    adapter (a checkpoint folder) to continue training from, e.g. the published
    one. `full_finetune`: train every weight instead of LoRA.

    `max_length`: prompt plus completion tokens; longer rows are left out and
    counted, never truncated (a truncated prompt is another state).
    `chat_template`: a Jinja file to use when the tokenizer has none (or to
    replace its own). `tools_fallback`: a JSON file with the agent's tool
    definitions (OpenAI's list), rendered for rows whose spans did not record
    the tools offered (opentelemetry-instrumentation-openai-v2 does not): without
    it such prompts would lack the tools block the model sees when serving. `batch_size` is per device; `epochs` or `max_steps`
    (> 0 wins). `eval_fraction`: trajectories held out (by a hash of their id)
    for evaluation. `precision`: auto = bf16 on a GPU that has it, else fp32.
    `attention`: auto = flash_attention_2 when installed on a GPU, else sdpa.
    `packing`: padding-free batches (sequences concatenated, positions restart):
    `auto` = on with flash-attention (its varlen kernel keeps each sequence to
    itself at no cost), off otherwise (sdpa would need a dense mask over the
    whole pack: padded batches grouped by length are faster there); `on`/`off`.
    `save_steps`: trainer checkpoints a killed run resumes from. `work_dir`:
    local scratch for those checkpoints and TensorBoard logs (default
    `<output>/.runs` for a local output, `./nightshift-runs` for a remote one)."""

    data: str = "./nightshift-data"
    base_model: str = ""
    served_model_name: str = ""
    output: str = "./nightshift-checkpoints"
    init_adapter: str = ""
    algorithm: str = "sft"  # what benchmarks/learning.py found best and safest (README: Training)
    full_finetune: bool = False
    max_length: int = 2048
    chat_template: str = ""
    tools_fallback: str = ""
    learning_rate: float = 1e-4
    epochs: float = 1.0
    max_steps: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    warmup: float = 0.0  # steps, or a fraction of them when below 1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_fraction: float = 0.1
    eval_batch_size: int = 8
    seed: int = 0
    precision: str = "auto"
    attention: str = "auto"
    compile: bool = False
    packing: str = "auto"
    gradient_checkpointing: bool = False
    save_steps: int = 200
    logging_steps: int = 10
    tensorboard: bool = True
    work_dir: str = ""
    tag: str = ""  # a label kept in the manifest (the nightly job writes its run id here)
    storage_options: dict = field(default_factory=dict)
    select: SelectConfig = field(default_factory=SelectConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    pg: PGSettings = field(default_factory=PGSettings)
    awr: AWRSettings = field(default_factory=AWRSettings)
    kto: KTOSettings = field(default_factory=KTOSettings)
    dpo: DPOSettings = field(default_factory=DPOSettings)
    sft: SFTSettings = field(default_factory=SFTSettings)

    def check(self) -> None:
        """Refuse settings that would silently do something else."""
        import re

        from nightshift.settings import SettingsError

        if not self.base_model:
            raise SettingsError("base_model is required (--base-model PATH): the model to train")
        if self.algorithm not in ALGORITHMS:
            raise SettingsError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.pg.clip not in CLIP_MODES:
            raise SettingsError(f"pg.clip must be one of {', '.join(CLIP_MODES)}, got {self.pg.clip!r}")
        if self.pg.mu not in MU_SOURCES:
            raise SettingsError(f"pg.mu must be one of {', '.join(MU_SOURCES)}, got {self.pg.mu!r}")
        if not 0.0 <= self.pg.unknown_mu_negatives <= 1.0:
            raise SettingsError(f"pg.unknown_mu_negatives must be in [0, 1], got {self.pg.unknown_mu_negatives}")
        if self.awr.beta <= 0 or self.awr.max_weight <= 0:
            raise SettingsError(f"awr.beta and awr.max_weight must be positive, got {self.awr.beta}, {self.awr.max_weight}")
        if self.pg.reference not in REFERENCES:
            raise SettingsError(f"pg.reference must be one of {', '.join(REFERENCES)}, got {self.pg.reference!r}")
        if self.precision not in PRECISIONS:
            raise SettingsError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.packing not in ("auto", "on", "off"):
            raise SettingsError(f"packing must be auto, on or off, got {self.packing!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise SettingsError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for name in ("max_length", "batch_size", "grad_accum", "eval_batch_size", "save_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise SettingsError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise SettingsError("set epochs > 0 or max_steps > 0")
        if self.algorithm == "kto" and self.batch_size < 2:
            raise SettingsError("kto needs batch_size >= 2: its KL term pairs each completion with another row's prompt")
        if not self.full_finetune:
            if self.lora.r < 1 or self.lora.r > VLLM_LORA_RANKS[-1]:
                raise SettingsError(f"lora.r must be in 1..{VLLM_LORA_RANKS[-1]} (vLLM's largest --max-lora-rank), got {self.lora.r}")
        if self.full_finetune and self.init_adapter:
            raise SettingsError("init_adapter continues a LoRA adapter; it cannot be combined with full_finetune")
        if self.pg.epsilon <= 0 or self.pg.truncate_max <= 0 or self.pg.kl_coef < 0:
            raise SettingsError("pg.epsilon and pg.truncate_max must be positive, pg.kl_coef non-negative")
        if self.dpo.min_margin < 0:
            raise SettingsError(f"dpo.min_margin must be non-negative, got {self.dpo.min_margin}")
        if self.sft.top_k < 0:
            raise SettingsError(f"sft.top_k must be non-negative, got {self.sft.top_k}")
        try:
            if isinstance(self.select.agents, str):
                re.compile(self.select.agents.removeprefix("re:"))
            elif not all(isinstance(a, str) for a in self.select.agents):
                raise SettingsError(f"select.agents: a list of agent names, got {self.select.agents!r}")
        except re.error as e:
            raise SettingsError(f"select.agents: not a valid regex: {e}") from None
        for what in ("since", "until"):
            value = getattr(self.select, what)
            if value and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", value):
                raise SettingsError(f"select.{what} must be a date YYYY-MM-DD, got {value!r}")

    def served_name(self) -> str:
        return self.served_model_name or self.base_model
