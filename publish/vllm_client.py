"""A small client for the vLLM endpoints publishing uses: models, LoRA load and
unload, one chat completion to verify, and the dev-mode weight reload. Transient
failures (connection refused or reset, timeouts, 502/503/504, 429) are retried
with exponential backoff; anything else is raised at once with the server's body
verbatim, because that is what tells a person what to fix.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

log = logging.getLogger("nightshift.publish")

TRANSIENT = {429, 502, 503, 504}


class VLLMError(RuntimeError):
    """The server refused, or could not be reached: `status` 0 means unreachable."""

    def __init__(self, message: str, status: int = 0, body: str = "", url: str = ""):
        super().__init__(message)
        self.status, self.body, self.url = status, body, url


@dataclass
class VLLMClient:
    url: str
    api_key: str = ""
    timeout: float = 30.0
    retries: int = 4
    backoff: float = 0.5

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
        url = self.url.rstrip("/") + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        delay = self.backoff
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                    return r.status, r.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as e:
                text = e.read().decode("utf-8", "replace")
                if e.code in TRANSIENT and attempt < self.retries:
                    log.warning("%s %s answered %d; retrying in %.1f s", method, url, e.code, delay)
                else:
                    raise VLLMError(f"{method} {url} answered {e.code}: {text.strip() or e.reason}", e.code, text, url) from None
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
                reason = getattr(e, "reason", e)
                if attempt >= self.retries:
                    raise VLLMError(f"the server at {self.url} cannot be reached ({method} {path}: {reason}); "
                                    "is it running, and is the URL right?", 0, "", url) from None
                log.warning("%s %s failed (%s); retrying in %.1f s", method, url, reason, delay)
            time.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    def models(self) -> list[dict]:
        _, text = self._call("GET", "/v1/models")
        try:
            return json.loads(text)["data"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise VLLMError(f"GET {self.url}/v1/models did not answer a model list: {text[:300]}") from None

    def load_lora(self, name: str, path: str, load_inplace: bool = False) -> str:
        try:
            _, text = self._call("POST", "/v1/load_lora_adapter",
                                 {"lora_name": name, "lora_path": path, "load_inplace": load_inplace}, timeout=300)
        except VLLMError as e:
            # A load that timed out may still have happened: its retry is then told the
            # name is taken. If the server serves exactly this path under it, it is done.
            if e.status == 400 and "already been loaded" in e.body and any(
                    m.get("id") == name and m.get("root") == path for m in self.models()):
                return f"already loaded: {name} from {path}"
            raise
        return text

    def unload_lora(self, name: str) -> str:
        _, text = self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        return text

    def chat(self, model: str, content: str = "Hello", max_tokens: int = 8) -> dict:
        _, text = self._call("POST", "/v1/chat/completions",
                             {"model": model, "messages": [{"role": "user", "content": content}],
                              "max_tokens": max_tokens, "temperature": 0}, timeout=120)
        try:
            out = json.loads(text)
            out["choices"][0]["message"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise VLLMError(f"the chat completion with model {model!r} did not answer a completion: {text[:300]}") from None
        return out

    def reload_weights(self, weights_path: str) -> None:
        self._call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": weights_path}},
                   timeout=1800)

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache")
