"""scripts/dashboard: optuna-dashboard over a study storage, looked at in headless Chromium.

Chromium comes from Debian (`apt-get install chromium`, done here when
missing and root); without it the browser test is skipped with the reason,
unless TBEXP_REQUIRE_CHROMIUM=1, where it fails. The screenshot is kept under
test-artifacts/ (git-ignored) and its path printed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.services import skip_or_fail

ARTIFACTS = REPO / "test-artifacts"


@pytest.fixture
def study_storage(tmp_path) -> str:
    """A small finished study in an sqlite file, made with Optuna directly."""
    import optuna

    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="dashboard-demo", storage=storage, direction="maximize")
    for number in range(3):
        trial = study.ask()
        lr = trial.suggest_float("sft.learning_rate", 1e-4, 1e-2, log=True)
        trial.report(0.1 * number, step=5)
        study.tell(trial, 0.2 * number + lr)
    return storage


@pytest.fixture
def dashboard(study_storage, tmp_path):
    """scripts/dashboard running on a free port of 127.0.0.1; yields its base URL."""
    port = _free_port()
    log = (tmp_path / "dashboard.log").open("w")
    server = subprocess.Popen(
        [str(REPO / "scripts" / "dashboard"), study_storage, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{url}/api/studies", server, tmp_path / "dashboard.log")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


def test_dashboard_serves_the_study_over_its_api(dashboard):
    studies = json.loads(urllib.request.urlopen(f"{dashboard}/api/studies", timeout=10).read())["study_summaries"]
    assert [s["study_name"] for s in studies] == ["dashboard-demo"]


def test_dashboard_refuses_a_storage_that_does_not_exist(tmp_path):
    done = subprocess.run(
        [str(REPO / "scripts" / "dashboard"), f"sqlite:///{tmp_path}/nothing.db"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "no study storage" in done.stderr
    assert not (tmp_path / "nothing.db").exists()


def test_study_and_trials_appear_in_a_browser(dashboard):
    chromium = _chromium_or_skip()
    study_page = _browse(chromium, f"{dashboard}/dashboard/studies/1", "--dump-dom")
    assert "dashboard-demo" in study_page
    trials_page = _browse(chromium, f"{dashboard}/dashboard/studies/1/trials", "--dump-dom")
    for number in range(3):
        assert f"Trial {number}" in trials_page
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard-study.png"
    shot.unlink(missing_ok=True)
    _browse(chromium, f"{dashboard}/dashboard/studies/1", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000  # a rendered page, not a blank one
    print(f"dashboard screenshot: {shot}")


def _browse(chromium: str, url: str, action: str) -> str:
    # The page is a React app: the virtual time budget lets its scripts fetch the study and render before the dump.
    done = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--window-size=1400,1000",
            "--virtual-time-budget=15000",
            action,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@functools.cache
def _chromium() -> tuple[str, str]:
    """(path to chromium, '') or ('', why it cannot be had); installs Debian's chromium when root."""
    if not shutil.which("chromium") and os.geteuid() == 0:
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=900,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
            if done.returncode != 0:
                return "", f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}"
    found = shutil.which("chromium")
    return (found, "") if found else ("", "chromium is not installed, and installing it needs root")


def _chromium_or_skip() -> str:
    path, reason = _chromium()
    skip_or_fail("Chromium", reason, "TBEXP_REQUIRE_CHROMIUM")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the dashboard exited:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"the dashboard did not answer within {timeout_s} s:\n{log.read_text()[-2000:]}")
