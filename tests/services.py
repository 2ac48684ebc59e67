"""Services the tests start themselves (Docker, SLURM, a browser…): start them, or skip saying why.

`run_script(name, *args)` runs scripts/NAME and says why it failed ('' when
it did not), with the script's last lines. `skip_or_fail(what, reason,
require_env)` skips the calling test with that reason, or fails it when the
environment variable `require_env` is 1 (CI machines that are meant to have
the service). `tbexp_serve(log, *args)` runs `python -m tbexp.serve ARGS` on a
free port and yields its base URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
SERVE_START_TIMEOUT_S = 300  # a loaded machine takes a minute to import torch and load the model


@contextmanager
def tbexp_serve(log: Path, *args: str) -> Iterator[str]:
    """`python -m tbexp.serve ARGS` on a free port, its stderr in the file `log` (not a pipe nobody reads, which could
    fill up); yields the base URL (…/v1) from the line it prints when ready, and stops the server after."""
    repo = SCRIPTS.parent
    env = {**os.environ, "PYTHONPATH": str(repo), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tbexp.serve", *args, "--port", "0", "--quiet"],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert process.stdout is not None
    stdout = process.stdout
    ready: list[str] = []
    reader = threading.Thread(target=lambda: ready.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(SERVE_START_TIMEOUT_S)
    if not ready or "http://" not in ready[0]:
        process.kill()
        pytest.fail(f"the server did not start: {ready} {log.read_text()[-2000:]}")
    try:
        yield ready[0].split()[-1]
    finally:
        process.terminate()
        process.wait(30)


def run_script(
    name: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess | None, str]:
    """(the finished script or None, why it failed or ''); `env` is added to this process's environment."""
    try:
        done = subprocess.run(
            ["bash", str(SCRIPTS / name), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return None, f"scripts/{name} took more than {timeout_s} s"
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
        return done, f"scripts/{name} failed (exit {done.returncode}): {tail}"
    return done, ""


def skip_or_fail(what: str, reason: str, require_env: str) -> None:
    """Nothing when `reason` is ''; else skip the test, or fail it under `require_env`=1."""
    if not reason:
        return
    if os.environ.get(require_env) == "1":
        pytest.fail(f"{what} required ({require_env}=1) but unavailable: {reason}")
    pytest.skip(f"{what} unavailable: {reason}")


def build_stand_ins(*images: str, timeout_s: float) -> None:
    """The local stand-ins of published base images (scripts/build_base_images.sh), or skip (fail) saying why."""
    env = {"PYTHON": os.environ.get("PYTHON", sys.executable)}  # the interpreter that has tbexp
    _, reason = run_script("build_base_images.sh", *images, timeout_s=timeout_s, env=env)
    skip_or_fail("local stand-in base images", reason, "TBEXP_REQUIRE_DOCKER")
