"""A tiny deterministic OpenAI-compatible server on loopback: `POST /v1/chat/completions`.

- Tools offered and the last message is not a tool result: one tool call to the
  first tool (`finish_reason: "tool_calls"`, a `call_...` id, JSON arguments).
- Otherwise: a text answer (`finish_reason: "stop"`).

Every answer carries `id`, `model` (the requested model with a date suffix, as
OpenAI answers) and `usage`, all derived from the request, and is recorded in
`StubOpenAI.calls` so tests can compare what the instrumentations saw with what
was really sent and answered. `stream: true` gets the same answer as server-sent
chunks, as OpenAI streams it (role, then content or the tool call's name and its
arguments in pieces, then the finish reason, then usage when `stream_options.include_usage`).

Run alone for manual poking: `python stub_openai.py [port]`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL_SUFFIX = "-2024-07-18"
TOOL_ARGUMENTS = {"city": "Paris", "unit": "celsius"}


def _digest(obj: Any, n: int = 24) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:n]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def answer(req: dict) -> dict:
    """The chat completion for a request body (pure: same request, same answer)."""
    messages = req.get("messages") or []
    tools = req.get("tools") or []
    last = messages[-1] if messages else {}
    model = str(req.get("model") or "stub-model")
    key = _digest(messages)
    prompt_tokens = 10 * len(messages) + len(json.dumps(messages)) // 50
    if tools and last.get("role") != "tool":
        fn = tools[0].get("function", tools[0])
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{
                "id": f"call_{key}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": json.dumps(TOOL_ARGUMENTS)},
            }],
        }
        finish, completion_tokens = "tool_calls", 17
    else:
        if last.get("role") == "tool":
            text = f"Answer from tool result: {_text_of(last.get('content'))}"
        else:
            text = f"Reply to: {_text_of(last.get('content'))[:80]}"
        message = {"role": "assistant", "content": text}
        finish, completion_tokens = "stop", len(text.split())
    if not model.endswith(MODEL_SUFFIX):
        model += MODEL_SUFFIX
    return {
        "id": f"chatcmpl-{key}",
        "object": "chat.completion",
        "created": 1_763_800_000,
        "model": model,
        "system_fingerprint": "fp_stub",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def chunks(req: dict, resp: dict) -> list[dict]:
    """`resp` as the `chat.completion.chunk`s OpenAI streams it in."""
    choice = resp["choices"][0]
    msg = choice["message"]
    head = {k: resp[k] for k in ("id", "created", "model", "system_fingerprint")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict, finish=None) -> dict:
        return head | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": "" if not msg.get("tool_calls") else None})]
    for i, call in enumerate(msg.get("tool_calls") or []):
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        args = call["function"]["arguments"]
        for a in range(0, len(args), 8):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": args[a:a + 8]}}]}))
    text = msg.get("content") or ""
    for a in range(0, len(text), 12):
        out.append(chunk({"content": text[a:a + 12]}))
    out.append(chunk({}, choice["finish_reason"]))
    if (req.get("stream_options") or {}).get("include_usage"):
        out.append(head | {"choices": [], "usage": resp["usage"]})
    return out


@dataclass
class StubOpenAI:
    host: str = "127.0.0.1"
    port: int = 0
    calls: list[dict] = field(default_factory=list)  # {"request": ..., "response": ...} in arrival order
    errors: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "StubOpenAI":
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                path = self.path.split("?", 1)[0].rstrip("/")
                if not path.endswith("/chat/completions"):
                    stub.errors.append(f"unsupported path {self.path}")
                    self._send(404, {"error": {"message": f"stub: no route {self.path}", "type": "invalid_request_error"}})
                    return
                try:
                    req = json.loads(raw)
                except json.JSONDecodeError as e:
                    stub.errors.append(f"bad json: {e}")
                    self._send(400, {"error": {"message": str(e), "type": "invalid_request_error"}})
                    return
                resp = answer(req)
                stub.calls.append({"request": req, "response": resp})
                if req.get("stream"):
                    self._stream(chunks(req, resp))
                else:
                    self._send(200, resp)

            def _stream(self, parts: list[dict]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for part in parts:
                    self.wfile.write(f"data: {json.dumps(part)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def do_GET(self):  # noqa: N802
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": []})
                else:
                    self._send(404, {"error": {"message": "not found"}})

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="stub-openai", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StubOpenAI":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    import sys
    import time

    s = StubOpenAI(port=int(sys.argv[1]) if len(sys.argv) > 1 else 0).start()
    print(s.base_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        s.stop()
