"""The HTTP face of `nightshift serve --engine transformers`: the subset of vLLM's
OpenAI-compatible server that agents and `nightshift publish` use, with vLLM's
request and response shapes.

    POST /v1/chat/completions     non-streaming and SSE; tools, tool_calls, logprobs,
                                  top_logprobs, return_token_ids, seed, stop
    GET  /v1/models               the base model and every loaded adapter
    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"}: 200 text
    POST /v1/unload_lora_adapter  {"lora_name"}: 200 text
    GET  /health, GET /metrics
    POST /collective_rpc, /reset_prefix_cache   only with VLLM_SERVER_DEV_MODE=1, as in vLLM

`--api-key` guards the /v1 routes only, as vLLM's does.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from nightshift.trainer.render import parse_tool_calls

from .engine import Engine, ServeError, logprob_entry

log = logging.getLogger("nightshift.serve")

HOLD = len("<tool_call>") - 1  # characters held back while a tool-call tag may be starting


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _request_fields(engine: Engine, req: dict) -> dict:
    if not isinstance(req.get("messages"), list) or not req["messages"]:
        raise ServeError(400, "BadRequestError", "messages must be a non-empty list", "messages")
    if int(req.get("n") or 1) != 1:
        raise ServeError(400, "BadRequestError", "n > 1 is not supported by the transformers engine", "n")
    adapter = engine._model_for(req.get("model"))
    prompt = engine.prompt_ids(req["messages"], req.get("tools"))
    room = engine.max_model_len - len(prompt)
    if room <= 0:
        raise ServeError(400, "BadRequestError",
                         f"This model's maximum context length is {engine.max_model_len} tokens. However, your request "
                         f"has {len(prompt)} input tokens. Please reduce the length of the input messages.", "messages")
    asked = req.get("max_completion_tokens") or req.get("max_tokens")
    if asked is not None and (not isinstance(asked, int) or asked < 1):
        raise ServeError(400, "BadRequestError", "max_tokens must be a positive integer", "max_tokens")
    stop = req.get("stop") or []
    top = req.get("top_logprobs") or 0
    if top and not req.get("logprobs"):
        raise ServeError(400, "BadRequestError", "top_logprobs needs logprobs=true", "top_logprobs")
    return {
        "adapter": adapter, "prompt": prompt, "max_tokens": min(asked or room, room),
        "temperature": float(req["temperature"]) if req.get("temperature") is not None else 1.0,
        "top_p": float(req["top_p"]) if req.get("top_p") is not None else 1.0,
        "seed": req.get("seed"), "stop": [stop] if isinstance(stop, str) else list(stop),
        "logprobs": bool(req.get("logprobs")), "top": int(top), "ids": bool(req.get("return_token_ids")),
        "model": engine.answering_name(req.get("model")),
    }


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    for s in stops:
        i = text.find(s)
        if s and i >= 0:
            return text[:i], True
    return text, False


def make_handler(engine: Engine, api_key: str = ""):
    registry = CollectorRegistry()
    requests = Counter("nightshift_serve_requests", "HTTP requests by route and status", ["route", "status"],
                       registry=registry)
    tokens = Counter("nightshift_serve_generated_tokens", "completion tokens generated", registry=registry)
    loads = Counter("nightshift_serve_lora_loads", "LoRA adapters loaded (load_lora_adapter successes)",
                    registry=registry)
    latency = Histogram("nightshift_serve_request_seconds", "chat completion latency", registry=registry)
    dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE", "0").lower() in ("1", "true")
    expected = f"Bearer {api_key}".encode() if api_key else b""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "nightshift-serve"

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            requests.labels(self.path.split("?")[0], str(code)).inc()

        def _json(self, code: int, obj) -> None:
            self._send(code, json.dumps(obj).encode())

        def _error(self, e: ServeError) -> None:
            self._json(e.status, e.body())

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                obj = json.loads(raw or b"{}")
            except json.JSONDecodeError as e:
                raise ServeError(400, "BadRequestError", f"invalid JSON body: {e}") from None
            if not isinstance(obj, dict):
                raise ServeError(400, "BadRequestError", "the body must be a JSON object")
            return obj

        def _authorized(self) -> bool:
            if not expected or not self.path.startswith("/v1"):
                return True
            if hmac.compare_digest(self.headers.get("Authorization", "").encode(), expected):
                return True
            self._json(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            if not self._authorized():
                return
            if path == "/health":
                self._send(200, b"", "text/plain")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": engine.models()})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            path = self.path.split("?")[0]
            if not self._authorized():
                return
            try:
                body = self._body()
                if path == "/v1/chat/completions":
                    self._chat(body)
                elif path == "/v1/load_lora_adapter":
                    msg = engine.load_adapter(body.get("lora_name") or "", body.get("lora_path") or "",
                                              bool(body.get("load_inplace")))
                    loads.inc()
                    self._send(200, msg.encode(), "text/plain; charset=utf-8")
                elif path == "/v1/unload_lora_adapter":
                    self._send(200, engine.unload_adapter(body.get("lora_name") or "").encode(), "text/plain; charset=utf-8")
                elif dev_mode and path == "/collective_rpc":
                    self._collective_rpc(body)
                elif dev_mode and path == "/reset_prefix_cache":
                    self._send(200, b"", "text/plain")
                else:
                    self._json(404, {"detail": "Not Found"})
            except ServeError as e:
                self._error(e)
            except Exception as e:  # noqa: BLE001 - a bug must not kill the server; it answers 500
                log.exception("request to %s failed", path)
                self._error(ServeError(500, "InternalServerError", f"{type(e).__name__}: {e}"))

        def _collective_rpc(self, body: dict) -> None:
            if body.get("method") != "reload_weights":
                raise ServeError(400, "BadRequestError", f"unsupported method {body.get('method')!r} (reload_weights only)")
            path = (body.get("kwargs") or {}).get("weights_path")
            if not path or not os.path.isdir(path):
                raise ServeError(400, "BadRequestError", f"weights_path {path!r} is not a folder")
            engine.reload_weights(path)
            self._json(200, {"results": [None]})

        # --- chat -----------------------------------------------------------------------

        def _chat(self, req: dict) -> None:
            t0 = time.perf_counter()
            f = _request_fields(engine, req)
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            steps = engine.decode_steps(f["adapter"], f["prompt"], f["max_tokens"], f["temperature"], f["top_p"],
                                        f["top"], f["seed"])
            if req.get("stream"):
                self._stream(req, f, rid, created, steps)
            else:
                samples = list(steps)
                ids = [s.token_id for s in samples]
                text, stopped = _cut_at_stop(engine.finish_text(ids), f["stop"])
                content, calls = parse_tool_calls(text)
                finish = "tool_calls" if calls else ("stop" if stopped or (ids and engine.is_eos(ids[-1]))
                                                      else "length")
                choice = {"index": 0, "message": {"role": "assistant", "content": content, "tool_calls": calls},
                          "logprobs": {"content": [logprob_entry(engine, s, f["top"] > 0) for s in samples]}
                          if f["logprobs"] else None, "finish_reason": finish, "stop_reason": None}
                if f["ids"]:
                    choice["token_ids"] = ids
                out = {"id": rid, "object": "chat.completion", "created": created, "model": f["model"],
                       "choices": [choice],
                       "usage": {"prompt_tokens": len(f["prompt"]), "completion_tokens": len(ids),
                                 "total_tokens": len(f["prompt"]) + len(ids)}}
                if f["ids"]:
                    out["prompt_token_ids"] = f["prompt"]
                tokens.inc(len(ids))
                self._json(200, out)
            latency.observe(time.perf_counter() - t0)

        def _chunk(self, obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _stream(self, req: dict, f: dict, rid: str, created: int, steps) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            requests.labels("/v1/chat/completions", "200").inc()

            def chunk(delta: dict, finish=None, logprobs=None, ids=None) -> dict:
                c = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if ids is not None:
                    c["token_ids"] = ids
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": f["model"],
                        "choices": [c]}

            first = chunk({"role": "assistant", "content": ""}, ids=[] if f["ids"] else None)
            if f["ids"]:
                first["prompt_token_ids"] = f["prompt"]
            self._chunk(first)
            ids: list[int] = []
            sent = 0  # characters of content already streamed
            stopped = False
            for s in steps:
                ids.append(s.token_id)
                text, stopped = _cut_at_stop(engine.finish_text(ids), f["stop"])
                tag = text.find("<tool_call>")
                upto = tag if tag >= 0 else (len(text) if stopped else max(sent, len(text) - HOLD))
                delta = text[sent:upto] if upto > sent else ""
                sent = max(sent, upto)
                lp = {"content": [logprob_entry(engine, s, f["top"] > 0)]} if f["logprobs"] else None
                self._chunk(chunk({"content": delta} if delta else {}, logprobs=lp,
                                  ids=[s.token_id] if f["ids"] else None))
                if stopped:
                    break
            text, _ = _cut_at_stop(engine.finish_text(ids), f["stop"])
            content, calls = parse_tool_calls(text)
            rest = {}
            if calls:
                rest["tool_calls"] = [{**c, "index": i} for i, c in enumerate(calls)]
                tail = (content or "")[sent:] if content and len(content) > sent else ""
            else:
                tail = text[sent:]
            if tail:
                rest["content"] = tail
            finish = "tool_calls" if calls else ("stop" if stopped or (ids and engine.is_eos(ids[-1])) else "length")
            self._chunk(chunk(rest, finish=finish))
            if (req.get("stream_options") or {}).get("include_usage"):
                self._chunk({"id": rid, "object": "chat.completion.chunk", "created": created, "model": f["model"],
                             "choices": [], "usage": {"prompt_tokens": len(f["prompt"]), "completion_tokens": len(ids),
                                                      "total_tokens": len(f["prompt"]) + len(ids)}})
            self._chunk(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            tokens.inc(len(ids))

    return Handler


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, api_key: str = "") -> _Server:
    """The server, bound and ready; `serve_forever()` to run it."""
    server = _Server((host, port), make_handler(engine, api_key))
    log.info("serving %s (transformers engine) on http://%s:%d/v1", engine.served_name, host, server.server_address[1])
    return server
