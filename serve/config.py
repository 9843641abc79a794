"""`nightshift serve`'s settings (YAML section `serve:`, `NIGHTSHIFT_SERVE_*`): what
vLLM needs for runtime LoRA publishing, and the same for the transformers stand-in."""

from __future__ import annotations

from dataclasses import dataclass

from nightshift.settings import host_problem, invalid, setting, validate
from nightshift.trainer.config import VLLM_LORA_RANKS


@dataclass
class ServeConfig:
    """The model server the agents talk to and `nightshift publish` publishes to."""

    engine: str = setting("vllm", help="vllm (production, needs a GPU) or transformers (a stand-in without one: "
                                       "same API subset, CPU speed)", choices=("vllm", "transformers"))
    model: str = setting("", help="the base model (the transformers engine needs a local folder: nothing is "
                                  "downloaded)", metavar="PATH|NAME")
    served_model_name: str = setting("", help="the name clients use for the base (default: --model)", metavar="NAME")
    host: str = setting("127.0.0.1", help="listen address", check=host_problem)
    port: int = setting(8000, help="listen port", bounds="[1, 65535]")
    api_key: str = setting("", help="require `Authorization: Bearer KEY` on /v1 (default: $VLLM_API_KEY)",
                           metavar="KEY")
    max_lora_rank: int = setting(16, help="largest adapter rank", choices=VLLM_LORA_RANKS)
    max_loras: int = setting(4, help="adapters kept loaded at once (4: today's, yesterday's, a stable name, a spare)",
                             bounds="[1, inf)")
    tool_call_parser: str = setting("hermes", help="vLLM's parser for the model's tool-call format (hermes: Qwen, "
                                                   "Hermes)")
    dtype: str = setting("auto", help="weights' precision", choices=("auto", "bf16", "fp16", "fp32"))
    log_level: str = setting("info", help="debug, info, warning or error",
                             pattern=r"(?i)debug|info|warning|error|critical", metavar="LEVEL")

    def rules(self) -> None:
        if not self.model:
            raise invalid("model", "required: the base model (--model, NIGHTSHIFT_SERVE_MODEL or serve.model in the "
                                   "YAML)")

    def check(self) -> None:
        validate(self, "serve")
