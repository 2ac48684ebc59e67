"""A real Tinker-API server for backend=tinker's tests: SkyRL's, started once per session, or a skip that says why.

The `tinker_server` fixture runs scripts/start_tinker_server.sh, which installs SkyRL's Tinker server into
$TBEXP_CACHE/skyrl-venv when it is missing (scripts/setup_tinker_server.sh: about 6.6 GB and three minutes the first
time) and serves the shipped tiny model (tbexp/models/tiny) on 127.0.0.1 with JAX on CPU; it is ready about 20 s
after it starts. The fixture yields the base URL with TINKER_API_KEY set to a dummy (the server checks none), and
stops the server afterwards. When the server cannot be had the calling test is skipped with the script's last
lines, unless TBEXP_REQUIRE_TINKER=1, where it fails (for CI machines that are meant to have it).

    from tests.tinker_server import tinker_server  # noqa: F401  (in the test module)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tbexp.models import TINY_DIR
from tests.services import run_script, skip_or_fail

SETUP_TIMEOUT_S = 900  # the first install downloads about 2 GB


@pytest.fixture(scope="session")
def tinker_server():
    """The base URL of a running SkyRL Tinker server over tbexp/models/tiny (its base model's name: str(TINY_DIR))."""
    state = Path(tempfile.mkdtemp(prefix="tbexp-tinker-", dir="/tmp"))
    done, reason = run_script("start_tinker_server.sh", str(TINY_DIR), "", str(state), timeout_s=SETUP_TIMEOUT_S)
    if reason:
        shutil.rmtree(state, ignore_errors=True)
        skip_or_fail("SkyRL's Tinker server", reason, "TBEXP_REQUIRE_TINKER")
    assert done is not None
    lines = done.stdout.strip().splitlines()
    stop = lines[-2].removeprefix("stop: ").split()
    key = os.environ.get("TINKER_API_KEY")
    os.environ["TINKER_API_KEY"] = "tml-dummy-for-a-local-server"
    try:
        yield lines[-1]
    finally:
        if key is None:
            os.environ.pop("TINKER_API_KEY", None)
        else:
            os.environ["TINKER_API_KEY"] = key
        subprocess.run(stop, capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)
