"""A real Tinker-API server for backend=tinker's tests: SkyRL's, started once per session, or a skip that says why.

The `tinker_server` fixture runs scripts/start_tinker_server.sh, which installs SkyRL's Tinker server into
$TBEXP_CACHE/skyrl-venv when it is missing (scripts/setup_tinker_server.sh: about 6.6 GB and three minutes the first
time) and serves the shipped tiny model (tbexp/models/tiny) on 127.0.0.1 with JAX on CPU; it is ready about 20 s
after it starts. One server serves the session (`tinker_service`); `tinker_server` gives a test its base URL with
TINKER_API_KEY set to a dummy for that test alone (the server checks none). The server is stopped at the session's end. When the server cannot be had the calling test is skipped with the script's last
lines, unless TBEXP_REQUIRE_TINKER=1, where it fails (for CI machines that are meant to have it).

    def test_x(tinker_server): ...  # the fixture: tests/conftest.py imports it for every module
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tbexp.models import TINY_DIR
from tests.services import run_script, skip_or_fail

SETUP_TIMEOUT_S = 900  # the first install downloads about 2 GB


@pytest.fixture(scope="session")
def tinker_service():
    """The base URL of a running SkyRL Tinker server over tbexp/models/tiny (its base model's name: str(TINY_DIR)), one
    for the whole session (tests/conftest.py imports this fixture once, so every module shares the one server)."""
    state = Path(tempfile.mkdtemp(prefix="tbexp-tinker-", dir="/tmp"))
    done, reason = run_script("start_tinker_server.sh", str(TINY_DIR), "", str(state), timeout_s=SETUP_TIMEOUT_S)
    if reason:
        shutil.rmtree(state, ignore_errors=True)
        skip_or_fail("SkyRL's Tinker server", reason, "TBEXP_REQUIRE_TINKER")
    assert done is not None
    lines = done.stdout.strip().splitlines()
    stop = lines[-2].removeprefix("stop: ").split()
    try:
        yield lines[-1]
    finally:
        subprocess.run(stop, capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def tinker_server(tinker_service, monkeypatch):
    """`tinker_service`'s URL, with TINKER_API_KEY a dummy (the server checks none) for this test alone: a key left
    in the environment would let a later test's job with a made-up base_url try to reach it."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-dummy-for-a-local-server")
    return tinker_service
