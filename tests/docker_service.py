"""The Docker engine for tests: started once per session, or a skip that says why.

`docker_or_skip()` runs scripts/start_dockerd.sh (installs docker.io and
starts dockerd if no engine answers; needs root) and then
scripts/build_base_image.sh (debootstrap root -> `tbexp-base:bookworm`,
skipped when the image exists). Either failing skips the calling test with
the script's last lines, unless TBEXP_REQUIRE_DOCKER=1, where it fails it
(for CI machines that are meant to have the engine).

    from tests.docker_service import docker_engine  # noqa: F401  (in conftest.py)
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SETUP_TIMEOUT_S = 900  # apt-get install + debootstrap + import on a cold machine


@functools.cache
def _unavailable() -> str:
    """Why the engine cannot be had ('' when it is running and the base image exists)."""
    if shutil.which("docker") is None and os.geteuid() != 0:
        return "no docker client, and installing docker.io needs root"
    for script in ("start_dockerd.sh", "build_base_image.sh"):
        try:
            done = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"scripts/{script} took more than {SETUP_TIMEOUT_S} s"
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            return f"scripts/{script} failed (exit {done.returncode}): {tail}"
    return ""


def docker_or_skip() -> None:
    reason = _unavailable()
    if reason:
        if os.environ.get("TBEXP_REQUIRE_DOCKER") == "1":
            pytest.fail(f"Docker engine required (TBEXP_REQUIRE_DOCKER=1) but unavailable: {reason}")
        pytest.skip(f"Docker engine unavailable: {reason}")


@pytest.fixture(scope="session")
def docker_engine():
    """A running engine with the base image; yields a low-level client for inspecting it."""
    docker_or_skip()
    import docker

    client = docker.APIClient(version="auto", **docker.utils.kwargs_from_env())
    yield client
    client.close()
