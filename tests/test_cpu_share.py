"""A job's cores (affinity, cgroup quota, launcher) and its share of them among the live tbexp jobs on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tbexp.jobs import cpu_share
from tbexp.jobs.cpu_share import SharedThreads, cgroup_quota_cores, job_cores, live_jobs, register, share

HOLDER = """
import sys, time
from pathlib import Path
from tbexp.jobs.cpu_share import register
register(Path(sys.argv[1]))
print("registered", flush=True)
time.sleep(60)
"""


def test_cgroup_quota_rounds_up_and_max_is_no_limit(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota_cores(tmp_path) == 1


def test_job_cores_is_the_tightest_limit(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_share, "cgroup_quota_cores", lambda: 3)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert job_cores() == 3
    assert job_cores(launcher_cpus=2) == 2
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert job_cores(launcher_cpus=2) == 1


def test_live_jobs_share_the_cores_and_a_dead_job_frees_its_share(tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="tbexp.jobs.cpu_share")
    # a logging config that an earlier test in the session applied may have disabled the module's logger
    monkeypatch.setattr(cpu_share.log, "disabled", False)
    monkeypatch.setattr(cpu_share.log, "propagate", True)
    monkeypatch.setattr(cpu_share, "_REGISTRATION", [])
    register(tmp_path)
    assert live_jobs(tmp_path) == 1 and share(2, tmp_path) == 2
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout.readline().strip() == "registered"
        assert live_jobs(tmp_path) == 2 and share(2, tmp_path) == 1 and share(5, tmp_path) == 2
        threads = SharedThreads(configured=2, cores=2, folder=tmp_path)
        assert threads() == 1
    finally:
        other.kill()
        other.wait()
    deadline = time.monotonic() + 10
    while live_jobs(tmp_path) != 1 and time.monotonic() < deadline:  # the kernel drops a dead process's lock
        time.sleep(0.05)
    assert live_jobs(tmp_path) == 1 and threads() == 2
    assert not (tmp_path / f"{other.pid}.job").exists()  # the dead job's file is cleaned up
    # each change of the thread count is said once (it can move the losses' last bits); an unchanged count is not
    threads()
    said = [r.getMessage() for r in caplog.records if "torch thread" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == [
        "updates now on 1 torch thread(s), were 2",
        "updates now on 2 torch thread(s), were 1",
    ], said


def test_a_job_on_other_cores_does_not_count(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_share, "_REGISTRATION", [])
    (tmp_path / "a").mkdir()
    register(tmp_path / "a")
    stranger = tmp_path / "a" / "999999.job"
    with open(stranger, "w") as f:  # a live job (we hold its lock) bound to cores we do not have
        import fcntl

        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("1000 1001\n")
        f.flush()
        assert live_jobs(tmp_path / "a") == 1
        stranger.write_text(" ".join(str(c) for c in os.sched_getaffinity(0)) + "\n")
        assert live_jobs(tmp_path / "a") == 2


@pytest.mark.parametrize("share_cores", [True, False])
def test_the_backend_gets_a_share_only_when_asked(share_cores, monkeypatch, tmp_path):
    from types import SimpleNamespace

    from tbexp.build import configure_threads

    monkeypatch.setenv("TBEXP_JOBS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_share, "_REGISTRATION", [])
    import torch

    previous = torch.get_num_threads()
    try:
        b = SimpleNamespace(share_cores=share_cores, threads=1, train_threads=2)
        got = configure_threads(b, "cpu")
        assert callable(got) if share_cores else got == 2
        assert configure_threads(b, "cuda") == 2  # the GPU's updates take what they are given
    finally:
        torch.set_num_threads(previous)
