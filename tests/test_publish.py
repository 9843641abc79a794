"""`nightshift publish` / `rollback` against `nightshift serve --engine transformers`
as a real process: the adapter is served and changes the answers, each version
has its own folder, the registry moves only after verification, and every
failure says what is wrong and leaves the registry as it was."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import free_port
from nightshift.publish import registry
from nightshift.publish.publish import PublishError, publish, rollback
from transitions_data import CALC_TOOL

Q = [{"role": "user", "content": "What is 12 * 7?"}]


def ns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nightshift.cli", *args], capture_output=True, text=True, timeout=120)


def _versions(tmp_path: Path, tool_adapter: Path, n: int = 2) -> Path:
    """A checkpoints folder with `n` versions of the tool adapter (same weights,
    their own manifests)."""
    ck = tmp_path / "ck"
    for i in range(1, n + 1):
        v = ck / f"v{i:04d}"
        shutil.copytree(tool_adapter, v)
        man = json.loads((v / "manifest.json").read_text())
        man["version"] = v.name
        (v / "manifest.json").write_text(json.dumps(man))
    return ck


def _answer(url: str, model: str):
    r = OpenAI(base_url=f"{url}/v1", api_key="x").chat.completions.create(
        model=model, messages=Q, tools=CALC_TOOL, max_tokens=40, temperature=0)
    return r.choices[0].message


def test_publish_serves_the_adapter_verifies_and_records_it(tmp_path, serve_factory, tool_adapter):
    s = serve_factory(extra_args=["--max-lora-rank", "64"]).start()
    ck = _versions(tmp_path, tool_adapter)
    assert not _answer(s.url, "tiny").tool_calls  # the base model does not call the tool
    p = ns("publish", "--checkpoint", str(ck / "v0001"), "--vllm-url", s.url, "--name", "agent",
           "--stable-name", "agent-live", "--adapter-root", str(tmp_path / "adapters"))
    assert p.returncode == 0, p.stderr
    assert "published v0001 as 'agent@v0001'" in p.stdout and "verified" in p.stdout
    assert _answer(s.url, "agent@v0001").tool_calls[0].function.name == "calculator"
    assert _answer(s.url, "agent-live").tool_calls[0].function.name == "calculator"
    path = tmp_path / "adapters" / "agent@v0001"
    assert (path / "adapter_model.safetensors").exists() and s.models()["agent@v0001"]["root"] == str(path)
    entry = registry.current(str(ck))
    assert (entry["version"], entry["name"], entry["path"], entry["endpoint"]) == ("v0001", "agent@v0001", str(path), s.url)
    # publishing the same version again changes nothing
    again = publish(str(ck / "v0001"), s.url, name="agent", stable_name="agent-live", adapter_root=str(tmp_path / "adapters"))
    assert again.already_loaded and len(registry.read(str(ck))) == 1
    # the next version gets a folder of its own; --keep 1 unloads the older one
    r2 = publish(str(ck / "v0002"), s.url, name="agent", stable_name="agent-live",
                 adapter_root=str(tmp_path / "adapters"), keep=1)
    assert r2.path == str(tmp_path / "adapters" / "agent@v0002") and r2.unloaded == ["agent@v0001"]
    models = s.models()
    assert "agent@v0001" not in models and models["agent-live"]["root"] == r2.path
    # rollback publishes v0001 again (reloaded, since it was unloaded), the stable name follows
    rb = ns("rollback", "--checkpoints", str(ck), "--vllm-url", s.url, "--name", "agent", "--stable-name", "agent-live",
            "--adapter-root", str(tmp_path / "adapters"))
    assert rb.returncode == 0, rb.stderr
    assert "rolled back from v0002 to v0001" in rb.stdout
    assert s.models()["agent-live"]["root"] == str(path)
    hist = registry.read(str(ck))
    assert [h["version"] for h in hist] == ["v0001", "v0002", "v0001"] and hist[-1]["rollback_of"] == "v0002"
    with pytest.raises(PublishError, match="v0001 is the oldest version published"):
        rollback(str(ck), s.url, name="agent")


def test_failures_are_clear_and_leave_the_registry_unchanged(tmp_path, serve_factory, tool_adapter):
    ck = _versions(tmp_path, tool_adapter, 1)
    down = ns("publish", "--checkpoint", str(ck / "v0001"), "--vllm-url", f"http://127.0.0.1:{free_port()}",
              "--retries", "1")
    assert down.returncode == 1 and "cannot be reached" in down.stderr and "is it running" in down.stderr
    other = serve_factory(served_name="Qwen/Qwen2.5-7B-Instruct", extra_args=["--max-lora-rank", "64"]).start()
    wrong = ns("publish", "--checkpoint", str(ck / "v0001"), "--vllm-url", other.url)
    assert wrong.returncode == 1
    assert "base model mismatch: the adapter was trained for 'tiny'" in wrong.stderr
    assert "Qwen/Qwen2.5-7B-Instruct" in wrong.stderr
    small = serve_factory(extra_args=["--max-lora-rank", "16"]).start()
    rank = ns("publish", "--checkpoint", str(ck / "v0001"), "--vllm-url", small.url)
    assert rank.returncode == 1 and "answered 500" in rank.stderr
    assert "LoRA rank 64 is greater than max_lora_rank 16" in rank.stderr  # the server's message, verbatim
    pre = ns("publish", "--checkpoint", str(ck / "v0001"), "--vllm-url", small.url, "--max-lora-rank", "16")
    assert pre.returncode == 1 and "vLLM would refuse this adapter" in pre.stderr
    not_ckpt = ns("publish", "--checkpoint", str(tmp_path), "--vllm-url", small.url)
    assert not_ckpt.returncode == 1 and "not a checkpoint version" in not_ckpt.stderr
    assert registry.read(str(ck)) == [] and small.models().keys() == {"tiny"}


class _Scripted(BaseHTTPRequestHandler):
    """Answers as vLLM does in the cases a healthy stand-in cannot produce: a scripted
    list of (status, body) for POST /v1/load_lora_adapter; GET /v1/models serves "tiny"."""

    script: list = []
    calls: list = []
    extra_models: list = []

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: str, ctype: str = "application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body.encode())))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        data = [{"id": "tiny", "root": "/m/tiny", "parent": None}, *type(self).extra_models]
        self._send(200, json.dumps({"object": "list", "data": data}))

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        type(self).calls.append(self.path)
        code, body = type(self).script.pop(0) if type(self).script else (500, "{}")
        self._send(code, body, "text/plain" if code == 200 else "application/json")


@pytest.mark.parametrize("code,etype,message", [
    (400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."),
    (404, "NotFoundError", "Loading lora agent@v0001 failed: No adapter found for /x"),
    (500, "InternalServerError", "CUDA out of memory while loading the adapter"),
])
def test_server_errors_reach_the_user_verbatim(tmp_path, tool_adapter, code, etype, message):
    ck = _versions(tmp_path, tool_adapter, 1)
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code}})
    _Scripted.script, _Scripted.calls = [(code, body)], []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(Exception) as e:
            publish(str(ck / "v0001"), f"http://127.0.0.1:{srv.server_address[1]}", name="agent", retries=0)
        assert f"answered {code}" in str(e.value) and message in str(e.value) and etype in str(e.value)
        assert _Scripted.calls == ["/v1/load_lora_adapter"]  # not retried: it would fail the same way
    finally:
        srv.shutdown()
    assert registry.read(str(ck)) == []


def test_transient_errors_are_retried_with_backoff(tmp_path, tool_adapter):
    from nightshift.publish.vllm_client import VLLMClient

    _Scripted.script = [(503, "{}"), (503, "{}"), (200, "Success: LoRA adapter 'a' added successfully.")]
    _Scripted.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = VLLMClient(f"http://127.0.0.1:{srv.server_address[1]}", backoff=0.01, retries=3)
        assert client.load_lora("a", "/p") == "Success: LoRA adapter 'a' added successfully."
        assert len(_Scripted.calls) == 3
    finally:
        srv.shutdown()


def test_a_load_that_timed_out_but_happened_is_not_an_error_on_retry(tmp_path, tool_adapter):
    """The first POST is answered 504 after the server did load the adapter; the
    retry hears "already been loaded". Serving that very path, it counts as done."""
    from nightshift.publish.vllm_client import VLLMClient, VLLMError

    already = json.dumps({"object": "error", "type": "InvalidUserInput", "code": 400,
                          "message": "The lora adapter 'a' has already been loaded. If you want to load the adapter "
                                     "in place, set 'load_inplace' to True."})
    _Scripted.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        client = VLLMClient(f"http://127.0.0.1:{srv.server_address[1]}", backoff=0.01, retries=3)
        _Scripted.script = [(504, "{}"), (400, already)]
        _Scripted.extra_models = [{"id": "a", "root": "/p", "parent": "tiny"}]
        assert client.load_lora("a", "/p") == "already loaded: a from /p"
        _Scripted.script = [(504, "{}"), (400, already)]  # loaded, but from another path: a real error
        with pytest.raises(VLLMError, match="already been loaded"):
            client.load_lora("a", "/other")
    finally:
        _Scripted.extra_models = []
        srv.shutdown()


def test_full_weights_reload_in_place_with_dev_mode(tmp_path, serve_factory, tool_adapter, tiny_model):
    ck = _versions(tmp_path, tool_adapter, 1)
    plain = serve_factory().start()
    with pytest.raises(PublishError, match="VLLM_SERVER_DEV_MODE=1.*blue-green"):
        publish(str(ck / "v0001"), plain.url, mode="full", base_model=str(tiny_model))
    dev = serve_factory(env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    assert not _answer(dev.url, "tiny").tool_calls
    res = publish(str(ck / "v0001"), dev.url, mode="full", base_model=str(tiny_model), adapter_root=str(tmp_path / "out"))
    assert res.mode == "full" and Path(res.path, "model.safetensors").exists()
    assert _answer(dev.url, "tiny").tool_calls[0].function.name == "calculator"  # the merged weights serve
    assert registry.current(str(ck))["mode"] == "full"


def test_publishing_never_loads_in_place_and_moves_the_stable_name_by_unload_and_load(
        tmp_path, serve_factory, tool_adapter, monkeypatch):
    """vLLM re-reads an adapter loaded with load_inplace on every step (vllm issue
    33791): the publish path must never send it, move the stable name by unload +
    load, reset the prefix cache, and every answer must name the version that
    produced it."""
    from nightshift.publish.vllm_client import VLLMClient

    sent: list[tuple[str, dict | None]] = []
    real = VLLMClient._call

    def recording(self, method, path, body=None, **kw):
        sent.append((path, body))
        return real(self, method, path, body, **kw)

    monkeypatch.setattr(VLLMClient, "_call", recording)
    s = serve_factory(extra_args=["--max-lora-rank", "64"], env={"VLLM_SERVER_DEV_MODE": "1"}).start()
    ck = _versions(tmp_path, tool_adapter, 2)
    kw = dict(name="agent", stable_name="agent-live", adapter_root=str(tmp_path / "adapters"))
    publish(str(ck / "v0001"), s.url, **kw)
    r2 = publish(str(ck / "v0002"), s.url, **kw)
    rollback(str(ck), s.url, **kw)
    loads = [b for p, b in sent if p == "/v1/load_lora_adapter"]
    assert loads and all(b["load_inplace"] is False for b in loads)
    paths = [p for p, _ in sent]
    # the second publish moved the stable name: unloaded, then loaded, then the cache reset
    i = next(i for i, (p, b) in enumerate(sent) if p == "/v1/unload_lora_adapter" and b["lora_name"] == "agent-live")
    assert sent[i + 1][0] == "/v1/load_lora_adapter" and sent[i + 1][1]["lora_name"] == "agent-live"
    assert "/reset_prefix_cache" in paths[i:]
    assert r2.stable_gap > 0 and "absent for" in "\n".join(r2.lines())
    r = OpenAI(base_url=f"{s.url}/v1", api_key="x").chat.completions.create(
        model="agent-live", messages=Q, tools=CALC_TOOL, max_tokens=8, temperature=0)
    assert r.model == "agent@v0001"  # after the rollback: the version, not the stable name
