"""The inventory sidecar: GET /health, GET /stock (JSON {item: count}) on port 8000 of its own container.

The counts come from STOCK_SEED, which only the compose file gives this service, so only the sidecar the compose file
describes can answer them."""
import json
import os
import random
from http.server import BaseHTTPRequestHandler, HTTPServer

rng = random.Random(int(os.environ["STOCK_SEED"]))
STOCK = {item: rng.randint(1, 50) for item in ("bolts", "nuts", "screws", "washers")}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            body = b"ok"
        elif self.path == "/stock":
            body = json.dumps(STOCK).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


HTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
