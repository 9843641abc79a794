"""A stand-in for vLLM's adapter API, in process, for the campaigns and tests that
run a command hundreds of times against a server (a real `nightshift serve`
costs seconds per start and per load). It answers what publishing uses, as vLLM
does: GET /v1/models (the base, then each adapter with its `root` and `parent`),
POST /v1/load_lora_adapter (404 for a folder with no adapter_config.json, 400
for a name already loaded), POST /v1/unload_lora_adapter (404 when absent),
POST /v1/chat/completions (404 for a model it does not serve),
POST /reset_prefix_cache; and records every request, so a test can say the
server was not touched at all. `fail` makes a route answer an error instead (a
verification that fails after the server took the adapter).

`fake_adapter` writes a version folder publishing accepts (a LoRA config, one
small tensor named as vLLM expects, a manifest) without training anything.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Standin:
    def __init__(self, base: str = "tiny") -> None:
        self.base = base
        self.adapters: dict[str, str] = {}  # name -> path
        self.requests: list[tuple[str, str]] = []  # (method, path), every one received
        self.fail: dict[str, tuple[int, str]] = {}  # path -> (status, message) answered instead
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, obj) -> None:
                body = (json.dumps(obj) if not isinstance(obj, str) else obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if not isinstance(obj, str) else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _error(self, code: int, kind: str, message: str) -> None:
                self._send(code, {"object": "error", "type": kind, "code": code, "message": message})

            def do_GET(self):  # noqa: N802
                with outer.lock:
                    outer.requests.append(("GET", self.path))
                    data = [{"id": outer.base, "root": f"/models/{outer.base}", "parent": None}]
                    data += [{"id": n, "root": p, "parent": outer.base} for n, p in outer.adapters.items()]
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": data})
                else:
                    self._error(404, "NotFoundError", f"no route {self.path}")

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with outer.lock:
                    outer.requests.append(("POST", self.path))
                    self._post(body)

            def _post(self, body: dict) -> None:
                name = body.get("lora_name") or ""
                if self.path in outer.fail:
                    return self._error(outer.fail[self.path][0], "InternalServerError", outer.fail[self.path][1])
                if self.path == "/v1/load_lora_adapter":
                    if name in outer.adapters and not body.get("load_inplace"):
                        return self._error(400, "InvalidUserInput", f"The lora adapter '{name}' has already been "
                                           "loaded. If you want to load the adapter in place, set 'load_inplace' "
                                           "to True.")
                    if not (Path(body.get("lora_path") or "/nonexistent") / "adapter_config.json").is_file():
                        return self._error(404, "NotFoundError", f"Loading lora {name} failed: No adapter found "
                                           f"for {body.get('lora_path')}")
                    outer.adapters[name] = body["lora_path"]
                    return self._send(200, f"Success: LoRA adapter '{name}' added successfully.")
                if self.path == "/v1/unload_lora_adapter":
                    if outer.adapters.pop(name, None) is None:
                        return self._error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
                    return self._send(200, f"Success: LoRA adapter '{name}' removed successfully.")
                if self.path == "/v1/chat/completions":
                    model = body.get("model")
                    if model != outer.base and model not in outer.adapters:
                        return self._error(404, "NotFoundError", f"The model `{model}` does not exist.")
                    return self._send(200, {"object": "chat.completion", "model": model, "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
                if self.path == "/reset_prefix_cache":
                    return self._send(200, "")
                return self._error(404, "NotFoundError", f"no route {self.path}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def changes(self) -> list[tuple[str, str]]:
        """The requests that could change something (every POST)."""
        return [r for r in self.requests if r[0] == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fake_adapter(folder: Path, version: str, base: str = "tiny") -> Path:
    """A version folder that passes publishing's checks (vLLM's rules, the base
    model's name) with one 2x4 tensor: enough for the stand-in, which loads nothing."""
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "base_model_name_or_path": base, "bias": "none",
        "target_modules": ["q_proj"]}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 4), np.float32)},
              str(folder / "adapter_model.safetensors"))
    (folder / "manifest.json").write_text(json.dumps({"version": version, "kind": "lora", "base_model": base}))
    return folder
