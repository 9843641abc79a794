"""The generation engine behind `nightshift serve --engine transformers`: a base
model with LoRA adapters loaded and unloaded by name at run time (peft), chat
completions rendered with the model's chat template, sampled token by token
(so streaming, logprobs and token ids come from one loop), and tool calls parsed
from Hermes/Qwen `<tool_call>{json}</tool_call>` blocks the way vLLM's `hermes`
parser reads them.

A stand-in for vLLM where vLLM cannot run (no GPU: laptops, CI, the demo): the
same contract for what Nightshift and agents use, not vLLM's speed. Errors carry
vLLM's status codes, types and messages.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

log = logging.getLogger("nightshift.serve")



class ServeError(Exception):
    """An error with vLLM's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.err_type, self.message, self.param = status, err_type, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


@dataclass
class Adapter:
    name: str
    path: str
    int_id: int
    loaded_at: float = field(default_factory=time.time)


def _text(content: Any) -> str:
    """OpenAI message content: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") in ("text", None))
    return str(content)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI request messages as chat templates want them: text content, tool-call
    arguments as mappings."""
    from nightshift.trainer.render import tool_arguments

    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ServeError(400, "BadRequestError", "each message needs a role", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {"id": tc.get("id"), "type": "function",
                 "function": {"name": tc.get("function", {}).get("name", ""),
                              "arguments": tool_arguments(tc.get("function", {}).get("arguments"))}}
                for tc in m["tool_calls"]
            ]
        for k in ("tool_call_id", "name"):
            if m.get(k):
                msg[k] = m[k]
        out.append(msg)
    return out


@dataclass
class Sample:
    """What one decoding step produced."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Engine:
    def __init__(self, model_path: str, served_name: str = "", max_lora_rank: int = 16, max_loras: int = 8,
                 dtype: str = "auto", device: str = ""):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.served_name = served_name or self.model_path
        self.max_lora_rank = max_lora_rank
        self.max_loras = max_loras
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        torch_dtype = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.base = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype).to(self.device).eval()
        self.peft = None  # a PeftModel over `base` once an adapter is loaded
        self.adapters: dict[str, Adapter] = {}
        self._next_id = 0
        self.lock = threading.RLock()  # one generation or adapter change at a time
        self.max_model_len = int(getattr(self.base.config, "max_position_embeddings", 4096))
        self.loads = 0
        self.created = int(time.time())

    # --- models and adapters -----------------------------------------------------------

    def models(self) -> list[dict]:
        card = {"object": "model", "created": self.created, "owned_by": "vllm", "permission": []}
        out = [{**card, "id": self.served_name, "root": self.model_path, "parent": None,
                "max_model_len": self.max_model_len}]
        with self.lock:
            for a in self.adapters.values():
                out.append({**card, "id": a.name, "root": a.path, "parent": self.served_name, "max_model_len": None})
        return out

    def _check_adapter(self, name: str, path: str) -> None:
        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise ServeError(404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}")
        from nightshift.trainer.checkpoint import vllm_problems

        problems = vllm_problems(p, self.max_lora_rank)
        if problems:  # vLLM's engine refuses these in add_lora, answered as a 500
            raise ServeError(500, "InternalServerError", "; ".join(problems) + ".")

    def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        if not name or not path:
            raise ServeError(400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
        if name == self.served_name:
            raise ServeError(400, "InvalidUserInput", f"The lora adapter '{name}' has the name of a base model.")
        with self.lock:
            if name in self.adapters and not load_inplace:
                raise ServeError(400, "InvalidUserInput",
                                 f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                                 "in place, set 'load_inplace' to True.")
            self._check_adapter(name, path)
            if name not in self.adapters and len(self.adapters) >= self.max_loras:
                self._evict_oldest()
            try:
                self._peft_load(name, path)
            except Exception as e:  # noqa: BLE001 - shape mismatch, corrupt file: vLLM answers 500
                raise ServeError(500, "InternalServerError", f"{type(e).__name__}: {e}") from None
            int_id = self.adapters[name].int_id if name in self.adapters else self._new_id()
            self.adapters[name] = Adapter(name, str(path), int_id)
            self.loads += 1
        log.info("loaded LoRA adapter %r from %s", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _evict_oldest(self) -> None:
        oldest = min(self.adapters.values(), key=lambda a: a.loaded_at)
        log.info("evicting LoRA adapter %r (max_loras=%d)", oldest.name, self.max_loras)
        self._peft_delete(oldest.name)
        del self.adapters[oldest.name]

    def _peft_load(self, name: str, path: str) -> None:
        from peft import PeftModel

        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=name).eval()
            return
        if name in self.peft.peft_config:
            if len(self.peft.peft_config) == 1:  # replacing the only adapter: start over on the bare base
                self.base = self.peft.unload()
                self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=name).eval()
                return
            self.peft.delete_adapter(name)
        self.peft.load_adapter(path, adapter_name=name)
        self.peft.eval()

    def _peft_delete(self, name: str) -> None:
        if self.peft is None:
            return
        if len(self.peft.peft_config) == 1:
            self.base = self.peft.unload()
            self.peft = None
        else:
            self.peft.delete_adapter(name)

    def unload_adapter(self, name: str) -> str:
        if not name:
            raise ServeError(400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
        with self.lock:
            if name not in self.adapters:
                raise ServeError(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
            self._peft_delete(name)
            del self.adapters[name]
        log.info("unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def reload_weights(self, weights_path: str) -> None:
        """vLLM's `reload_weights`: new full weights in place; LoRA state is reset."""
        from transformers import AutoModelForCausalLM

        with self.lock:
            model = AutoModelForCausalLM.from_pretrained(weights_path, dtype=self.base.dtype).to(self.device).eval()
            self.base, self.peft, self.adapters = model, None, {}
            self.model_path = str(weights_path)

    # --- generation --------------------------------------------------------------------

    def answering_name(self, name: str | None) -> str:
        """The name a response carries as its `model`: for a stable name (`agent`)
        the versioned adapter loaded from the same folder (`agent@v0003`), so every
        logged call says which published version produced it (the trainer's
        `policy_version`); otherwise the requested name, as vLLM answers."""
        name = name or self.served_name
        with self.lock:
            a = self.adapters.get(name)
            if a is not None and "@v" not in name:
                for other in self.adapters.values():
                    if other.path == a.path and "@v" in other.name:
                        return other.name
        return name

    def _model_for(self, name: str | None):
        if not name or name == self.served_name:
            return None
        if name not in self.adapters:
            raise ServeError(404, "NotFoundError", f"The model `{name}` does not exist.", "model")
        return name

    def prompt_ids(self, messages: list[dict], tools: list | None) -> list[int]:
        try:
            enc = self.tok.apply_chat_template(template_messages(messages), tools=tools or None,
                                               add_generation_prompt=True, tokenize=True, return_dict=True)
        except ServeError:
            raise
        except Exception as e:  # noqa: BLE001 - a template error is the request's fault
            raise ServeError(400, "BadRequestError", f"chat template failed: {type(e).__name__}: {e}", "messages") from None
        return list(enc["input_ids"])

    def decode_steps(self, adapter: str | None, prompt: list[int], max_tokens: int, temperature: float, top_p: float,
                     top_logprobs: int, seed: int | None) -> Iterator[Sample]:
        """Sample token by token with the KV cache: greedy at temperature 0.
        Logprobs are those of the distribution sampled from, log softmax(logits / T)
        renormalized over the top-p set (vLLM's `--logprobs-mode processed_logprobs`):
        the trainer's importance ratios need μ's own numbers, and raw (T = 1)
        logprobs would make every ratio at another temperature wrong."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "big"))
        eos = {self.tok.eos_token_id} | set(self.base.generation_config.eos_token_id
                                             if isinstance(self.base.generation_config.eos_token_id, list)
                                             else [self.base.generation_config.eos_token_id])
        eos.discard(None)
        with self.lock, torch.no_grad():
            if adapter is None:
                model, ctx = (self.peft, self.peft.disable_adapter()) if self.peft is not None else (self.base, None)
            else:
                self.peft.set_adapter(adapter)
                model, ctx = self.peft, None
            if ctx is not None:
                ctx.__enter__()
            try:
                cur = torch.tensor([prompt], device=self.device)
                past = None
                for _ in range(max_tokens):
                    out = model(input_ids=cur, past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    logits = out.logits[0, -1].float().cpu()
                    if temperature <= 0:
                        logp = torch.log_softmax(logits, -1)
                        tid = int(torch.argmax(logits))
                    else:
                        probs = torch.softmax(logits / temperature, -1)
                        if top_p < 1.0:
                            sp, si = torch.sort(probs, descending=True)
                            keep = torch.cumsum(sp, 0) - sp < top_p
                            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
                        probs = probs / probs.sum()
                        logp = torch.log(probs)
                        tid = int(torch.multinomial(probs, 1, generator=gen))
                    top = []
                    if top_logprobs:
                        v, i = torch.topk(logp, top_logprobs)
                        top = list(zip(i.tolist(), v.tolist()))
                    yield Sample(tid, float(logp[tid]), top)
                    if tid in eos:
                        return
                    cur = torch.tensor([[tid]], device=self.device)
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)

    def token_text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False)

    def is_eos(self, tid: int) -> bool:
        return tid == self.tok.eos_token_id

    def finish_text(self, ids: list[int]) -> str:
        """Generated text without the end-of-turn token."""
        if ids and self.is_eos(ids[-1]):
            ids = ids[:-1]
        return self.tok.decode(ids, skip_special_tokens=False)


def logprob_entry(engine: Engine, s: Sample, want_top: bool) -> dict:
    text = engine.token_text(s.token_id)
    entry = {"token": text, "logprob": s.logprob if math.isfinite(s.logprob) else -9999.0,
             "bytes": list(text.encode("utf-8"))}
    entry["top_logprobs"] = [
        {"token": engine.token_text(t), "logprob": lp if math.isfinite(lp) else -9999.0,
         "bytes": list(engine.token_text(t).encode("utf-8"))} for t, lp in s.top] if want_top else []
    return entry
