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

import pytest

from tests.services import run_script, skip_or_fail

SETUP_TIMEOUT_S = 900  # apt-get install + debootstrap + import on a cold machine


@functools.cache
def _unavailable() -> str:
    """Why the engine cannot be had ('' when it is running and the base image exists)."""
    if shutil.which("docker") is None and os.geteuid() != 0:
        return "no docker client, and installing docker.io needs root"
    for script in ("start_dockerd.sh", "build_base_image.sh"):
        _, reason = run_script(script, timeout_s=SETUP_TIMEOUT_S)
        if reason:
            return reason
    return ""


def docker_or_skip() -> None:
    skip_or_fail("Docker engine", _unavailable(), "TBEXP_REQUIRE_DOCKER")


@pytest.fixture(scope="session")
def docker_engine():
    """A running engine with the base image; yields a low-level client for inspecting it."""
    docker_or_skip()
    import docker

    client = docker.APIClient(version="auto", **docker.utils.kwargs_from_env())
    yield client
    client.close()
