"""svc-compose-sidecar: environment/docker-compose.yaml runs an inventory sidecar beside the main container, reachable by
its service name, with the environment the compose file gives each. The first test checks the sidecar answers (it passes
without work); the second needs the work."""
import json
import os
import urllib.request
from pathlib import Path


def _get(path: str) -> bytes:
    return urllib.request.urlopen(os.environ["INVENTORY_URL"] + path, timeout=5).read()


def test_sidecar_answers():
    assert os.environ["INVENTORY_URL"] == "http://inventory:8000"
    assert _get("/health") == b"ok"


def test_total_written():
    assert Path("/app/total.txt").read_text().strip() == str(sum(json.loads(_get("/stock")).values()))
