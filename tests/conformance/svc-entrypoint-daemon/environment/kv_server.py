"""A key-value daemon on 127.0.0.1:8080. Its one value is made when it starts and lives only in its memory, so only a
daemon that is running (the one the image's ENTRYPOINT starts) can give it: GET /health, GET /key/answer."""
import secrets
from http.server import BaseHTTPRequestHandler, HTTPServer

VALUES = {"answer": secrets.token_hex(8)}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            body = b"ok"
        elif self.path.startswith("/key/") and self.path[5:] in VALUES:
            body = VALUES[self.path[5:]].encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", 8080), Handler).serve_forever()
