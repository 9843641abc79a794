"""A tiny chat model built from a config, offline, in a second: a byte-level BPE
tokenizer trained on a few strings, a ChatML template with tools (Qwen2.5's
layout), and a two-layer Qwen2 or Llama with random weights. For tests, the CPU
benchmark and the demo, where nothing may be downloaded. Not a stand-in for a
real model's quality; a real one for every code path.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Qwen2.5's layout, shortened: tools in the system turn, tool calls as
#: <tool_call>{json}</tool_call>, tool results as their own turn. The
#: {% generation %} markers let TRL find assistant tokens.
CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '<tool_call>' }}{{- {'name': f.name, 'arguments': f.arguments} | tojson }}{{- '</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: The same layout with tools listed as `name(arg, ...)` instead of their JSON
#: schemas: a model family may render tools however it likes, and a prompt of
#: tens of tokens is what lets a tiny model learn a tool-use task in minutes on
#: a CPU (the agent world's policy uses it).
CHATML_COMPACT = CHATML.replace(
    "{{- '# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}",
    "{{- 'Tools:' }}{%- for tool in tools %}{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- ' ' + f.name + '(' + (f.parameters.properties | list | join(', ')) + ')' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}",
)
assert CHATML_COMPACT != CHATML
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "user assistant system tool call arguments name weather city temperature",
    "What is 2 + 2? The answer is 4. Hello! How can I help you today?",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "calculator", "arguments": {"expression": "12 * 7"}}',
    "0123456789 + - * / = ( ) answer result lookup capital country population",
]


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or CORPUS) * 20, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 bos_token=None, unk_token=None)
    hf.chat_template = CHATML
    return hf


def build_model(tokenizer, arch: str = "qwen2", hidden: int = 64, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, intermediate: int = 128, max_positions: int = 2048, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if arch == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(path: str | os.PathLike, arch: str = "qwen2", corpus: list[str] | None = None, **model_kw) -> Path:
    """Build and save a tiny tokenizer + model under `path` (a folder any
    `from_pretrained` reads). Returns the folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(path)
    tok = build_tokenizer(corpus=corpus)
    model = build_model(tok, arch, **model_kw)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
