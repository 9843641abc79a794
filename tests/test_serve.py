"""`nightshift serve --engine transformers` as a real process, driven by the real
`openai` client and by raw HTTP: vLLM's shapes for chat, streaming, tools,
logprobs, token ids, models, and LoRA load/unload with its exact errors."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from openai import NotFoundError, OpenAI

from nightshift.trainer.render import parse_tool_calls
from transitions_data import CALC_TOOL

Q = [{"role": "user", "content": "What is 12 * 7?"}]


def post(url: str, body: dict, key: str = "") -> tuple[int, str, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def test_lora_load_unload_with_vllms_exact_answers(serve_factory, tool_adapter):
    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    load = f"{s.url}/v1/load_lora_adapter"
    assert post(load, {"lora_name": "p@v0001", "lora_path": str(tool_adapter)}) == \
        (200, "text/plain; charset=utf-8", "Success: LoRA adapter 'p@v0001' added successfully.")
    code, ctype, body = post(load, {"lora_name": "p@v0001", "lora_path": str(tool_adapter)})
    assert code == 400 and ctype == "application/json"
    assert json.loads(body) == {"error": {
        "message": "The lora adapter 'p@v0001' has already been loaded. If you want to load the adapter in place, "
                   "set 'load_inplace' to True.", "type": "InvalidUserInput", "param": None, "code": 400}}
    assert post(load, {"lora_name": "p@v0001", "lora_path": str(tool_adapter), "load_inplace": True})[0] == 200
    code, _, body = post(load, {"lora_name": "x", "lora_path": "/no/such/dir"})
    assert code == 404 and json.loads(body)["error"]["message"] == "Loading lora x failed: No adapter found for /no/such/dir"
    assert post(load, {"lora_name": "", "lora_path": "x"})[0] == 400
    models = s.models()
    assert models["p@v0001"]["root"] == str(tool_adapter) and models["p@v0001"]["parent"] == "tiny"
    assert models["tiny"]["parent"] is None
    unload = f"{s.url}/v1/unload_lora_adapter"
    assert post(unload, {"lora_name": "p@v0001"})[2] == "Success: LoRA adapter 'p@v0001' removed successfully."
    code, _, body = post(unload, {"lora_name": "p@v0001"})
    assert code == 404 and json.loads(body)["error"]["type"] == "NotFoundError"
    assert s.metric("nightshift_serve_lora_loads_total") == 2


def test_rank_above_the_servers_limit_is_refused(serve_factory, tool_adapter):
    s = serve_factory(extra_args=["--max-lora-rank", "16"]).start()
    code, _, body = post(f"{s.url}/v1/load_lora_adapter", {"lora_name": "p", "lora_path": str(tool_adapter)})
    assert code == 500 and "LoRA rank 64 is greater than max_lora_rank 16" in json.loads(body)["error"]["message"]


def test_the_adapter_really_changes_the_answers(serve_factory, tool_adapter):
    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    client = OpenAI(base_url=f"{s.url}/v1", api_key="unused")
    base = client.chat.completions.create(model="tiny", messages=Q, tools=CALC_TOOL, max_tokens=40, temperature=0)
    assert not base.choices[0].message.tool_calls
    post(f"{s.url}/v1/load_lora_adapter", {"lora_name": "p@v0001", "lora_path": str(tool_adapter)})
    r = client.chat.completions.create(model="p@v0001", messages=Q, tools=CALC_TOOL, max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "12*7"}
    assert r.model == "p@v0001" and r.usage.completion_tokens > 0
    # the tool result goes back in, rendered by the template like any turn
    follow = Q + [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "84"}]
    again = client.chat.completions.create(model="p@v0001", messages=follow, tools=CALC_TOOL, max_tokens=5, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=Q)


def test_streaming_token_ids_and_logprobs(serve_factory, tool_adapter, tiny_model):
    from transformers import AutoTokenizer

    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    post(f"{s.url}/v1/load_lora_adapter", {"lora_name": "p@v0001", "lora_path": str(tool_adapter)})
    client = OpenAI(base_url=f"{s.url}/v1", api_key="unused")
    full = client.chat.completions.create(model="p@v0001", messages=Q, tools=CALC_TOOL, max_tokens=40, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    extra = full.model_extra
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert extra["prompt_token_ids"] == tok.apply_chat_template(Q, tools=CALC_TOOL, add_generation_prompt=True,
                                                                tokenize=True, return_dict=True)["input_ids"]
    ids = full.choices[0].model_extra["token_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == full.usage.completion_tokens
    lps = full.choices[0].logprobs.content
    assert len(lps) == len(ids) and all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps)
    assert lps[0].top_logprobs[0].logprob == pytest.approx(lps[0].logprob)  # greedy: the chosen token is the top one
    chunks = list(client.chat.completions.create(model="p@v0001", messages=Q, tools=CALC_TOOL, max_tokens=40,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed_ids == ids
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "calculator" and json.loads(calls[0].function.arguments) == {"expression": "12*7"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(ids)
    # plain text streams as content deltas that add up to the non-streamed answer
    text = client.chat.completions.create(model="tiny", messages=Q, max_tokens=12, temperature=0).choices[0].message.content
    parts = client.chat.completions.create(model="tiny", messages=Q, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == text


def test_api_key_guards_v1_only_and_health_and_metrics(serve_factory):
    s = serve_factory(extra_args=["--api-key", "sekret"]).start()
    code, _, body = post(f"{s.url}/v1/chat/completions", {"messages": Q, "max_tokens": 2})
    assert code == 401 and json.loads(body) == {"error": "Unauthorized"}
    assert post(f"{s.url}/v1/chat/completions", {"messages": Q, "max_tokens": 2}, key="sekret")[0] == 200
    assert urllib.request.urlopen(f"{s.url}/health").status == 200
    assert b"nightshift_serve_requests_total" in urllib.request.urlopen(f"{s.url}/metrics").read()
    code, _, body = post(f"{s.url}/v1/chat/completions", {"messages": [], "max_tokens": 2}, key="sekret")
    assert code == 400 and "messages" in json.loads(body)["error"]["message"]


def test_vllm_engine_command_has_the_flags_nightshift_needs():
    p = subprocess.run([sys.executable, "-m", "nightshift.cli", "serve", "--engine", "vllm", "--model", "Qwen/Qwen2.5-1.5B",
                        "--max-lora-rank", "64", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    line = p.stdout.strip()
    assert line.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve Qwen/Qwen2.5-1.5B")
    for flag in ("--enable-lora", "--max-lora-rank 64", "--max-loras 4", "--tool-call-parser hermes"):
        assert flag in line


def test_tool_call_parsing():
    content, calls = parse_tool_calls('Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    assert content == "Let me check." and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    content, calls = parse_tool_calls("<tool_call>not json</tool_call>")
    assert calls == [] and content == "<tool_call>not json</tool_call>"
    assert parse_tool_calls("plain") == ("plain", [])


def test_logprobs_are_those_of_the_distribution_sampled_from(serve_factory, tiny_model):
    """At temperature T the stand-in samples from softmax(logits / T), and the
    logprobs it returns must be that distribution's (the trainer's importance
    ratios use them as μ), not the raw T = 1 ones."""
    import torch
    from transformers import AutoModelForCausalLM

    s = serve_factory().start()
    client = OpenAI(base_url=f"{s.url}/v1", api_key="unused")
    r = client.chat.completions.create(model="tiny", messages=Q, max_tokens=6, temperature=0.5, seed=3, logprobs=True,
                                       extra_body={"return_token_ids": True})
    prompt, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    at_t = [torch.log_softmax(logits[len(prompt) + i - 1] / 0.5, -1)[t].item() for i, t in enumerate(ids)]
    raw = [torch.log_softmax(logits[len(prompt) + i - 1], -1)[t].item() for i, t in enumerate(ids)]
    got = [lp.logprob for lp in r.choices[0].logprobs.content]
    assert got == pytest.approx(at_t, abs=1e-3)
    assert got != pytest.approx(raw, abs=1e-3)
