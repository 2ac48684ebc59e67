"""A one-node SLURM cluster for tests: started once per session, or a skip that says why.

`slurm_or_skip()` runs scripts/start_slurm.sh (installs slurm-wlm and munge,
writes a one-node slurm.conf, starts munged, slurmctld and `slurmd -N
localhost` when no node answers; needs root). Failing skips the calling test
with the script's last lines, unless TBEXP_REQUIRE_SLURM=1, where it fails it
(for CI machines that are meant to have the cluster).

    from tests.slurm_service import slurm_cluster  # noqa: F401  (in the test module)
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time

import pytest

from tests.services import run_script, skip_or_fail

SETUP_TIMEOUT_S = 600  # apt-get install on a cold machine


@functools.cache
def _unavailable() -> str:
    """Why the cluster cannot be had ('' when a node is idle)."""
    if shutil.which("sinfo") is None and os.geteuid() != 0:
        return "no SLURM client, and installing slurm-wlm needs root"
    return run_script("start_slurm.sh", timeout_s=SETUP_TIMEOUT_S)[1]


def slurm_or_skip() -> None:
    skip_or_fail("SLURM cluster", _unavailable(), "TBEXP_REQUIRE_SLURM")


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """A running one-node cluster; yields the node's name."""
    slurm_or_skip()
    return "localhost"


def jobs_named(name: str) -> list[tuple[str, str]]:
    """(job id, state) of the cluster's jobs called `name`; array tasks as ARRAYID_TASK."""
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i %T"], capture_output=True, text=True, timeout=30).stdout
    return [tuple(line.split()) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def release_requeued(job_id: str, timeout_s: float = 60) -> None:
    """Start a requeued job now: SLURM holds one back for two minutes (BeginTime), which tests need not wait out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        if state == "PENDING":
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], capture_output=True, timeout=30)
            return
        time.sleep(0.5)  # still COMPLETING: the old run is being killed
    raise AssertionError(f"job {job_id} did not come back to PENDING after the requeue")
