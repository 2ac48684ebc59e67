"""The code that composes a job type-checks strictly: mypy, as pyproject.toml's [tool.mypy] configures it (strict on
tbexp/stages, tbexp/job.py and tbexp/caches.py), reports no error.

mypy is a dev dependency; where it is not installed the test is skipped and says so. `TBEXP_MYPY=<path to a mypy>`
runs one installed elsewhere (it reads this environment's packages through --python-executable).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _mypy() -> list[str]:
    if os.environ.get("TBEXP_MYPY"):
        return [os.environ["TBEXP_MYPY"]]
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed: it is a dev dependency (pyproject.toml's [project.optional-dependencies])")
    return [sys.executable, "-m", "mypy"]


@pytest.mark.timeout(900)
def test_the_stages_the_job_and_the_caches_type_check_strictly(tmp_path):
    command = [*_mypy(), "--python-executable", sys.executable, "--cache-dir", str(tmp_path / "mypy-cache")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout
