"""A STAND-IN for the proposer LLM: a small OpenAI-compatible server on loopback
(`POST /v1/chat/completions`) that answers Nightshift's meta-prompts without any
model, for tests and the demo.

It derives everything from the text it is sent, and from nothing else: it knows no
task, no world, no right answer. A critique request (it holds `<trajectories>`)
is answered with the tool errors and feedback comments of the FAILED trajectories
in it, most frequent first, counted; an edit request (it holds `<critique>`) with
the `<prompt>` it was sent, unchanged, plus one instruction per problem the
critique lists (one for a conservative edit file, which says "ONE problem"; two
otherwise), each quoting at most ten words of the problem. So whatever a
candidate gains is what the failures said, which is what APO can know; a result
that beats the base prompt measures APO, not a stand-in that knew the answer.

Broken proposers for the tests: `script` is a list of modes, one per request
(then `mode`): `slow` (answers after `delay` s), `500`, `garbage` (HTML),
`not_completion` (JSON without choices), `empty` (no text), `enormous` (a prompt
of 200,000 characters), `unchanged` (the prompt as sent), `drop_placeholder`
(the prompt without its {{slots}}), `no_block` (text without <prompt> tags).
`key`: requests without `Authorization: Bearer <key>` get 401 with the key they
did send echoed in the message (as some APIs echo part of it), to test that
Nightshift never repeats it. Every request is kept in `requests`
(headers, body).

Run alone for the demo: `python tests/support/proposer_standin.py --port 8300`;
then `apo: {base_url: http://127.0.0.1:8300/v1, model: standin}`.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAG = re.compile(r"<(prompt|critique|trajectories)>\n?(.*?)\n?</\1>", re.DOTALL)
PROBLEM = re.compile(r"^\d+\. \((\d+) of (\d+) failed\) (.+)$", re.MULTILINE)


def _blocks(text: str) -> dict[str, str]:
    """Each tagged block's last occurrence (the meta-prompt's own, after its instructions)."""
    return {m.group(1): m.group(2) for m in TAG.finditer(text)}


def critique(trajectories: str) -> str:
    """The failures' tool errors and feedback comments, counted."""
    failed = [t for t in re.split(r"^### ", trajectories, flags=re.MULTILINE) if "FAILED" in t.split("\n", 1)[0]]
    seen: Counter = Counter()
    for t in failed:
        said = set()
        for line in t.splitlines():
            if line.startswith(("tool error: ", "feedback: ")):
                said.add(re.sub(r"\s+", " ", line.strip()))
        seen.update(said)
    if not seen:
        return (f"The {len(failed)} failed conversations carry no tool error and no feedback comment: nothing in them "
                "says what went wrong.")
    out = ["Problems seen in the failed conversations, most frequent first:"]
    for i, (what, n) in enumerate(sorted(seen.items(), key=lambda x: (-x[1], x[0]))[:5]):
        out.append(f"{i + 1}. ({n} of {len(failed)} failed) {what}")
    out.append("The prompt says nothing about these: add an instruction for each.")
    return "\n".join(out)


def _instruction(problem: str) -> str:
    words = problem.split()
    quoted = " ".join(words[:10]) + (" ..." if len(words) > 10 else "")
    return f"Earlier conversations went wrong with: {quoted}. Make sure this does not happen."


def edit(prompt: str, critique_text: str, conservative: bool) -> str:
    problems = [m.group(3) for m in PROBLEM.finditer(critique_text)]
    keep = problems[:1] if conservative else problems[:2]
    lines = [prompt] if prompt and not prompt.startswith("(the agent sends no system prompt)") else []
    return "\n".join(lines + [i for i in map(_instruction, keep) if i not in prompt])


class Standin:
    def __init__(self, mode: str = "ok", script: list[str] | None = None, key: str | None = None, delay: float = 5.0,
                 model: str = "standin-proposer"):
        self.mode, self.script, self.key, self.delay, self.model = mode, list(script or []), key, delay, model
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> Standin:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_mode(self) -> str:
        with self._lock:
            return self.script.pop(0) if self.script else self.mode

    def answer(self, body: dict) -> tuple[int, bytes]:
        mode = self._next_mode()
        if mode == "slow":
            time.sleep(self.delay)
        if mode == "500":
            return 500, b'{"error": {"message": "internal error"}}'
        if mode == "garbage":
            return 200, b"<html><body>Bad gateway, or something</body></html>"
        if mode == "not_completion":
            return 200, json.dumps({"object": "list", "data": []}).encode()
        text = "".join(m.get("content") or "" for m in body.get("messages") or [] if m.get("role") == "user")
        blocks = _blocks(text)
        if mode == "empty":
            content = ""
        elif "trajectories" in blocks:
            content = critique(blocks["trajectories"])
        elif "critique" in blocks:
            prompt = blocks.get("prompt", "")
            if mode == "enormous":
                content = "<prompt>" + "Be careful. " * 17000 + "</prompt>"
            elif mode == "unchanged":
                content = f"<prompt>{prompt}</prompt>"
            elif mode == "drop_placeholder":
                content = "<prompt>" + re.sub(r"\{\{\w+\}\}", "", edit(prompt, blocks["critique"], False)) + "</prompt>"
            elif mode == "no_block":
                content = "Here is my suggestion: " + edit(prompt, blocks["critique"], False)
            else:
                content = "<prompt>\n" + edit(prompt, blocks["critique"], "ONE problem" in text) + "\n</prompt>"
        else:
            content = "I can only answer Nightshift's critique and edit meta-prompts."
        reply = {"id": "chatcmpl-standin", "object": "chat.completion", "model": self.model,
                 "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
                 "usage": {"prompt_tokens": len(text.split()), "completion_tokens": len(content.split())}}
        return 200, json.dumps(reply).encode()

    def _handler(self):
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, json.dumps({"object": "list", "data": [{"id": standin.model}]}).encode())

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = {}
                standin.requests.append({"headers": {k.lower(): v for k, v in self.headers.items()}, "body": body,
                                         "path": self.path})
                if standin.key and self.headers.get("Authorization") != f"Bearer {standin.key}":
                    sent = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                    msg = f"Incorrect API key provided: {sent}."
                    return self._send(401, json.dumps({"error": {"message": msg}}).encode())
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, b'{"error": {"message": "not found"}}')
                self._send(*standin.answer(body))

        return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description="A stand-in proposer LLM (no model: answers from what it is sent).")
    ap.add_argument("--port", type=int, default=8300)
    args = ap.parse_args()
    s = Standin()
    s.server.server_close()
    s.server = ThreadingHTTPServer(("127.0.0.1", args.port), s._handler())
    print(f"stand-in proposer on http://127.0.0.1:{args.port}/v1", flush=True)
    s.server.serve_forever()


if __name__ == "__main__":
    main()
