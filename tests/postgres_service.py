"""A PostgreSQL server for the sweep tests: started once per session, or a skip that says why.

The `postgres_url` fixture runs scripts/start_postgres.sh (installs Debian's
postgresql if missing, which needs root; a fresh cluster in a new /tmp
directory, 127.0.0.1 on a free port) and stops and removes the server
afterwards. When the server cannot be had the calling test is skipped with
the script's last lines, unless TBEXP_REQUIRE_POSTGRES=1, where it fails (for
CI machines that are meant to have it).

    from tests.postgres_service import postgres_url  # noqa: F401  (in the test module)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.services import run_script, skip_or_fail

SETUP_TIMEOUT_S = 600  # apt-get install on a cold machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres_url():
    """The storage URL of a running server with an empty database `tbexp`."""
    data = Path(
        tempfile.mkdtemp(prefix="tbexp-postgres-", dir="/tmp")
    )  # not under tmp_path: the server's user must enter it
    done, reason = run_script("start_postgres.sh", str(data), str(_free_port()), timeout_s=SETUP_TIMEOUT_S)
    if reason:
        shutil.rmtree(data, ignore_errors=True)
        skip_or_fail("PostgreSQL", reason, "TBEXP_REQUIRE_POSTGRES")
    lines = done.stdout.strip().splitlines()
    stop = lines[-2].removeprefix("stop: ").split()
    yield lines[-1]
    subprocess.run(stop, capture_output=True, timeout=120)
    shutil.rmtree(data, ignore_errors=True)
    Path(f"{data}.initdb.log").unlink(missing_ok=True)
