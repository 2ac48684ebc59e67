"""The HTTP front of a `ChatEndpoint`: the standard library's threading HTTP server, JSON in and out.

Routes: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`. Each request gets its own thread;
requests share only the sampler, which serialises or batches them itself (a local sampler holds its lock
while it decodes; the continuous batcher and Tinker's client take concurrent requests), and the endpoint's
table of recent replies, which has its own lock. No authentication: it listens on 127.0.0.1 by default,
and any `Authorization` header is ignored (litellm sends one).
"""

from __future__ import annotations

import errno
import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tbexp.serving.chat import ChatEndpoint, RequestError
from tbexp.serving.checkpoint import ServeError

MAX_BODY_BYTES = 64 * 1024 * 1024


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a client that hangs up mid-request cannot keep the process alive
    endpoint: ChatEndpoint
    quiet: bool


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive, as litellm's httpx client expects

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._reply(200, self.server.endpoint.models())
        elif path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, RequestError(f"no route GET {self.path}", status=404).body())

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._reply(404, RequestError(f"no route POST {self.path}", status=404).body())
            return
        try:
            self._reply(200, self.server.endpoint.complete(self._json_body()))
        except RequestError as err:
            self._reply(err.status, err.body())
        except Exception as err:  # a bug or a failed backend: the client gets a 500, the log gets the traceback
            traceback.print_exc(file=sys.stderr)
            self._reply(500, RequestError(f"{type(err).__name__}: {err}", status=500).body())

    def _json_body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise RequestError(f"request body of {length} bytes is over {MAX_BODY_BYTES}", status=413)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as err:
            raise RequestError(f"the request body is not JSON: {err}") from err
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        return body

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            super().log_message(format, *args)


def make_server(endpoint: ChatEndpoint, host: str = "127.0.0.1", port: int = 8000, quiet: bool = False) -> _Server:
    """A bound server (port 0: any free one; `server.server_address` has the port); call `serve_forever()`."""
    try:
        server = _Server((host, port), _Handler)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ServeError(
                f"port {port} on {host} is in use; choose another with --port (0 picks a free one)"
            ) from err
        raise ServeError(f"cannot listen on {host}:{port}: {err}") from err
    server.endpoint, server.quiet = endpoint, quiet
    return server
