"""A scripted OpenAI-compatible chat endpoint: a STAND-IN for a hosted teacher API in the collect tests.

Why a stand-in: what a hosted API does under load (429s with Retry-After, a reply that never comes, a 200 whose
body is not a chat completion) cannot be had offline, and `python -m tbexp.serve` never does any of it on purpose.
This server answers `POST /v1/chat/completions` from a script: each request takes the next step of `faults`
("429", "500", "401", "slow", "garbage", "empty") until it is used up, then `answer(messages, body)` gives the
reply's text. It counts the requests it got. The real endpoint the tests use besides it is `python -m tbexp.serve`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[list[dict[str, str]], dict[str, Any]], str]


class ScriptedTeacher:
    def __init__(self, answer: Answer, faults: list[str] | None = None, slow_s: float = 5.0):
        self.answer = answer
        self.faults = list(faults or [])
        self.slow_s = slow_s
        self.requests = 0
        self.lock = threading.Lock()
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with teacher.lock:
                    teacher.requests += 1
                    fault = teacher.faults.pop(0) if teacher.faults else ""
                if fault == "429":
                    self._send(429, {"error": {"message": "rate limited", "type": "rate_limit"}}, {"Retry-After": "0"})
                elif fault == "500":
                    self._send(500, {"error": {"message": "overloaded"}})
                elif fault == "401":
                    self._send(401, {"error": {"message": "bad key", "type": "invalid_api_key"}})
                elif fault == "slow":
                    time.sleep(teacher.slow_s)
                    self._send(200, teacher._completion(body, "too late"))
                elif fault == "garbage":
                    self._raw(200, b"<html>upstream said something</html>")
                elif fault == "empty":
                    self._send(200, {"id": "x", "object": "chat.completion", "model": body.get("model"), "choices": []})
                else:
                    self._send(200, teacher._completion(body, teacher.answer(body["messages"], body)))

            def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
                self._raw(status, json.dumps(payload).encode(), headers)

            def _raw(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and hung up
                    pass

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _completion(self, body: dict[str, Any], text: str) -> dict[str, Any]:
        words = sum(len(m["content"].split()) for m in body["messages"])
        return {
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "scripted"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": words, "completion_tokens": len(text.split()), "total_tokens": 0},
        }

    def __enter__(self) -> ScriptedTeacher:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
