"""`nightshift train`'s settings (YAML section `train:`), one dataclass per concern,
TRL-style: the defaults are the common case (LoRA on every linear layer,
rejection-sampling `sft` on rewarded calls, the objective benchmarks/learning.py
found best and safest on logged calls; bf16 on a GPU and fp32 on a CPU), every
field documented where it is declared. Each algorithm's own section (`train.pg`,
`train.sft`, ...) is declared in its module under trainer/algorithms/ and added
to `TrainConfig` from there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

from nightshift.settings import invalid, setting, validate

from . import algorithms

ALGORITHMS = tuple(algorithms.registry())
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
#: The ranks vLLM's `--max-lora-rank` may take (vllm/config/lora.py); an adapter's
#: `r` must not exceed the server's setting.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


_DATE = r"\d{4}-\d{2}-\d{2}"

#: Where training figures may go besides the step line, and the package each
#: needs: TensorBoard is installed with Nightshift; wandb and mlflow go through
#: transformers' own integrations, their packages the user's to install.
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "none": ""}

#: transformers TrainingArguments that `train.trainer_args` may not set: each is
#: set from one of Nightshift's own settings, or the shared loop depends on it (its
#: steps by tokens, the memory plan's micro-batches, resumption from its own
#: folder, the held-out evaluation after training). The value says where it is set.
OWNED_TRAINER_ARGS = {
    "output_dir": "train.work_dir (trainer checkpoints to resume from)",
    "per_device_train_batch_size": "train.tokens_per_step or train.batch_size (the memory plan picks micro-batches)",
    "gradient_accumulation_steps": "train.tokens_per_step or train.batch_size (the memory plan picks the accumulation)",
    "auto_find_batch_size": "the memory plan (and its out-of-memory retry)",
    "gradient_checkpointing": "train.gradient_checkpointing",
    "max_steps": "train.max_steps", "num_train_epochs": "train.epochs", "learning_rate": "train.learning_rate",
    "warmup_steps": "train.warmup", "warmup_ratio": "train.warmup (a fraction when below 1)",
    "weight_decay": "train.weight_decay", "max_grad_norm": "train.max_grad_norm", "seed": "train.seed",
    "data_seed": "train.seed", "bf16": "train.precision", "fp16": "train.precision", "use_cpu": "the run plan",
    "torch_compile": "train.compile", "logging_steps": "train.logging_steps", "save_steps": "train.save_steps",
    "save_strategy": "train.save_steps", "report_to": "train.report_to", "disable_tqdm": "--quiet",
    "eval_strategy": "the trainer's own held-out evaluation", "remove_unused_columns": "the shared loop",
    "include_num_input_tokens_seen": "the shared loop (tokens counted per step)",
    "dataloader_num_workers": "the shared loop (steps are made before training)",
    "resume_from_checkpoint": "the trainer (a rerun resumes by itself)",
}


@dataclass
class SelectConfig:
    """Which transitions to train on, applied lazily in Polars before anything is read."""

    since: str = setting("", help="first date of transitions to train on (the date partition, inclusive)",
                         pattern=_DATE, metavar="YYYY-MM-DD", flag="--since")
    until: str = setting("", help="last date, inclusive", pattern=_DATE, metavar="YYYY-MM-DD", flag="--until")
    agents: str | list[str] = setting("", help="train on these agents' calls only: names as the spans give them "
                                               "(writer,rewriter), matched exactly; or a regex matched against the "
                                               "whole name (writer|rewr.*, or re: before it)", regex=True,
                                      metavar="NAMES", flag="--agents")
    models: list[str] = setting(factory=list, help="keep rows whose request_model (what the agent asked for) or "
                                                   "model is one of these (empty: all)")
    require_reward: bool = setting(True, help="leave out rows nobody rated (their reward is null)")
    max_rows: int = setting(0, help="cap, newest first (0: no cap)", bounds="[0, inf)")
    seen_prompts: dict = setting(factory=dict, help="prompt version id -> the system prompt text(s) a route put in "
                                                    "front of the model (nightly fills it from the prompt candidates): "
                                                    "rows answered under one are trained on with it; rows answered "
                                                    "under any other are left out")


@dataclass
class LoraSettings:
    """LoRA as vLLM can serve it: no DoRA, no bias, no modules_to_save."""

    r: int = setting(16, help="rank; must not exceed the server's --max-lora-rank",
                     bounds=f"[1, {VLLM_LORA_RANKS[-1]}]")
    alpha: int = setting(32, help="scale (alpha / r multiplies the update)", bounds="(0, inf)")
    dropout: float = setting(0.0, help="dropout on the adapter's input", bounds="[0, 1)")
    target_modules: str = setting("all-linear", help="all-linear (every linear layer but the LM head) or a "
                                                     "comma-separated list of module names")


@dataclass
class TrainSettings:
    """The policy, the data, and how training runs; `TrainConfig` adds each algorithm's section."""

    data: str = setting("./nightshift-data", help="the dataset root holding transitions/", metavar="DIR|URL")
    base_model: str = setting("", help="the model to train: a local folder, or a name already in the local Hugging "
                                       "Face cache (nothing is downloaded)", metavar="PATH")
    served_model_name: str = setting("", help="the base model's name on the serving engine, written as the "
                                              "adapter's base_model_name_or_path (vLLM requires it to equal its "
                                              "--model; default: base_model)", metavar="NAME")
    output: str = setting("./nightshift-checkpoints", help="where versioned checkpoints go: a folder or an fsspec URL",
                          metavar="DIR|URL", flag="--checkpoints", old_flags=("--output",))
    init_adapter: str = setting("", help="continue training this LoRA adapter (a checkpoint folder, e.g. the "
                                         "published version)", metavar="DIR")
    algorithm: str = setting("sft", help="sft (the learning benchmark's best and safest on logged calls), awr, pg, "
                                         "kto or dpo", choices=ALGORITHMS)
    full_finetune: bool = setting(False, help="train every weight instead of LoRA", flag="--full")
    max_length: int = setting(0, help="prompt plus completion tokens; 0: the model's own limit "
                                      "(max_position_embeddings), lowered by the memory plan if one row that long "
                                      "would not fit; longer rows are left out and counted per agent, never truncated "
                                      "(a truncated prompt is another state)", bounds="[0, inf)")
    chat_template: str = setting("", help="a Jinja chat template for tokenizers without one (or to replace its own)",
                                 metavar="FILE")
    tools_fallback: str = setting("", help="a JSON file with the agent's tool definitions (OpenAI's list), rendered "
                                           "for rows whose spans did not record the tools offered", metavar="FILE")
    learning_rate: float = setting(1e-4, help="peak learning rate", bounds="(0, inf)")
    epochs: float = setting(1.0, help="passes over the rows", bounds="[0, inf)")
    max_steps: int = setting(0, help="optimizer steps (> 0 overrides epochs)", bounds="[0, inf)")
    batch_size: int = setting(0, help="rows per optimizer step, over every process; 0: by tokens (tokens_per_step), "
                                      "so no row count has to be picked to fit memory", bounds="[0, inf)")
    tokens_per_step: int = setting(65536, help="tokens per optimizer step, over every process, when batch_size is 0: "
                                               "about ten agent calls of ~6k tokens (the memory plan splits them into "
                                               "micro-batches and accumulates)", bounds="[1, inf)")
    grad_accum: int = setting(1, help="with batch_size > 0, rows per step are batch_size x grad_accum (kept for older "
                                      "settings files; how a step is split into micro-batches is the memory plan's)",
                              bounds="[1, inf)")
    memory_fraction: float = setting(0.9, help="share of the GPU's free memory the memory plan may use",
                                     bounds="(0, 1]")
    warmup: float = setting(0.0, help="warm-up steps, or a fraction of them when below 1", bounds="[0, inf)")
    weight_decay: float = setting(0.0, help="AdamW's weight decay", bounds="[0, inf)")
    max_grad_norm: float = setting(1.0, help="gradient clipping", bounds="(0, inf)")
    eval_fraction: float = setting(0.1, help="trajectories held out (by a hash of their id) for evaluation",
                                   bounds="[0, 1)")
    eval_batch_size: int = setting(8, help="no longer read: the gate scores in micro-batches of the memory plan's "
                                           "tokens, as the trainer's evaluation and mu do (kept so older settings "
                                           "files load)", bounds="[1, inf)")
    seed: int = setting(0, help="random seed")
    precision: str = setting("auto", help="auto = bf16 on a GPU that has it, else fp32", choices=PRECISIONS)
    attention: str = setting("auto", help="auto = flash_attention_2 where the flash-attn package is installed, else "
                                          "torch's own varlen kernel on a GPU (nightshift_varlen), else sdpa with "
                                          "packed masks; or a transformers attn_implementation name")
    compile: bool = setting(False, help="torch.compile the model")
    packing: str = setting("auto", help="padding-free batches (sequences concatenated, positions restart): auto = on "
                                        "wherever a correct packed attention exists (always for sft, awr and pg; kto "
                                        "and dpo are TRL's and pad); off: padded micro-batches of like lengths",
                           choices=("auto", "on", "off"))
    gradient_checkpointing: str = setting("auto", help="recompute activations in the backward pass: auto (the memory "
                                                       "plan checkpoints as few decoder layers as fit), on (every "
                                                       "layer), selective (some, the plan says how many) or off",
                                          choices=("auto", "on", "off", "selective"))
    save_steps: int = setting(200, help="trainer checkpoints a killed run resumes from, every this many steps",
                              bounds="[1, inf)")
    logging_steps: int = setting(10, help="a step line (and TensorBoard point) every this many steps",
                                 bounds="[1, inf)")
    tensorboard: bool = setting(True, help="write TensorBoard logs beside the version (false: none, whatever "
                                           "report_to says)")
    report_to: list[str] = setting(factory=lambda: ["tensorboard"], choices=tuple(REPORTERS),
                                   help="where training figures go besides the step line: tensorboard (beside the "
                                        "version), wandb, mlflow (transformers' integrations, set up by their own "
                                        "environment: WANDB_PROJECT, MLFLOW_TRACKING_URI, ...; their packages are "
                                        "not installed with Nightshift), or none")
    trainer_args: dict = setting(factory=dict, help="more transformers TrainingArguments: a YAML mapping, or JSON on "
                                                    "the command line ('{\"lr_scheduler_type\": \"cosine\"}'); the "
                                                    "ones Nightshift sets or needs (batch sizes, accumulation, "
                                                    "output_dir, max_steps, learning_rate, ...) are refused, naming "
                                                    "the setting to use")
    work_dir: str = setting("", help="local scratch for trainer checkpoints and TensorBoard logs (default "
                                     "<output>/.runs, or ./nightshift-runs for a remote output)", metavar="DIR")
    tag: str = setting("", help="a label kept in the manifest (the nightly job writes its run id here)")
    storage_options: dict = setting(factory=dict, help="passed to fsspec for data and output")
    select: SelectConfig = setting(factory=SelectConfig, help="which rows")
    lora: LoraSettings = setting(factory=LoraSettings, help="the adapter")

    def rules(self) -> None:
        if not self.base_model:
            raise invalid("base_model", "required: the model to train (--base-model PATH, NIGHTSHIFT_TRAIN_BASE_MODEL "
                                        "or train.base_model in the YAML)")
        if self.max_steps <= 0 and self.epochs <= 0:
            raise invalid("epochs", "set epochs > 0 or max_steps > 0")
        own = algorithms.registry().get(self.algorithm)
        if own is not None and own.rules is not None:
            own.rules(self)
        if self.full_finetune and self.init_adapter:
            raise invalid("init_adapter", "init_adapter continues a LoRA adapter; it cannot be combined with "
                                          "full_finetune")
        if not isinstance(self.select.agents, str) and not all(isinstance(a, str) for a in self.select.agents):
            raise invalid("select.agents", f"a list of agent names, got {self.select.agents!r}")
        if "none" in self.report_to and len(set(self.report_to)) > 1:
            raise invalid("report_to", f"none means nowhere; it cannot be listed with others ({self.report_to})")
        for name in self.report_to:
            package = REPORTERS[name]
            if package and importlib.util.find_spec(package) is None:
                raise invalid("report_to", f"{name} needs the {package} package, which is not installed here "
                                           f"(pip install {package})")
        owned = [k for k in self.trainer_args if k in OWNED_TRAINER_ARGS]
        if owned:
            raise invalid("trainer_args", "; ".join(f"{k} is Nightshift's: set {OWNED_TRAINER_ARGS[k]}" for k in owned)
                          + f" (not settable here: {', '.join(OWNED_TRAINER_ARGS)})")

    def reporters(self) -> list[str]:
        """Where figures go (`report_to`, less TensorBoard when `tensorboard` is off)."""
        return [r for r in dict.fromkeys(self.report_to) if r != "none" and (r != "tensorboard" or self.tensorboard)]

    def check(self) -> None:
        """Refuse settings that would silently do something else."""
        validate(self, "train")

    def served_name(self) -> str:
        return self.served_model_name or self.base_model


#: `TrainSettings` with a section per algorithm (`train.pg`, `train.sft`, ...), in
#: `--algorithm`'s order: the sections come from trainer/algorithms/, so a new
#: algorithm's settings need no line here.
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig",
    [(a.name, a.settings, setting(factory=a.settings, help=f"the {a.name} objective"))
     for a in algorithms.registry().values()],
    bases=(TrainSettings,),
    namespace={"__doc__": TrainSettings.__doc__.split(";")[0] + ".", "__module__": __name__},
)
