"""How many torch threads a job's updates may use: its cores, shared with the other tbexp jobs on them.

A job's cores are the fewest of: its CPU affinity (`os.sched_getaffinity`, which
taskset and SLURM's binding set), its cgroup's quota (`/sys/fs/cgroup/cpu.max`,
quota / period rounded up; cgroup v1's `cpu.cfs_quota_us` likewise), SLURM's
`SLURM_CPUS_PER_TASK`, and the Hydra launcher's `cpus_per_task` (submitit_local
passes it to nobody, so the job reads it itself).

What else runs: each job on the CPU backend registers in a folder shared by the
user's jobs on this machine (`$TBEXP_JOBS_DIR`, default `<tmp>/tbexp-jobs-<uid>`)
a file naming its cores, holding an exclusive lock on it while it lives (the
kernel drops the lock when the process dies, however it dies). Before each
update a job counts the live jobs whose cores overlap its own and takes its
share: cores // jobs, at least 1. So two default jobs on two cores take one
thread each instead of two, and a job left alone takes both again.

Simplified: other users' processes and the sandboxes' commands are not counted
(the stages update between rollouts, when the job's own sandboxes are idle); a
share is re-read per update, not mid-update.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
_REGISTRATION: list = []  # this process's open, locked registration file (kept open for the process's life)


def job_cores(launcher_cpus: int | None = None) -> int:
    """The cores this process may use: affinity, cgroup quota, SLURM's and the launcher's cpus per task."""
    limits = [len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1]
    quota = cgroup_quota_cores()
    if quota:
        limits.append(quota)
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        limits.append(int(slurm))
    if launcher_cpus:
        limits.append(int(launcher_cpus))
    return max(1, min(limits))


def launcher_cpus_per_task() -> int | None:
    """The Hydra launcher's `cpus_per_task` when this job was launched by one that has it."""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return None
    if not HydraConfig.initialized():
        return None
    launcher = HydraConfig.get().get("launcher") or {}
    cpus = launcher.get("cpus_per_task") if hasattr(launcher, "get") else None
    return int(cpus) if cpus else None


class SharedThreads:
    """Called before each update: `configured` threads (0: all the job's cores), never more than the job's share."""

    def __init__(self, configured: int, cores: int, folder: Path | None = None):
        self.configured, self.cores, self.folder = configured, cores, folder
        self.last = configured or cores  # what the job would take alone
        register(folder)

    def __call__(self) -> int:
        threads = min(self.configured or self.cores, share(self.cores, self.folder))
        if threads != self.last:
            # Said because it moves results: a seed's SFT losses left those of the same seed at fixed threads when
            # its share changed while other jobs ran beside it (docs/shared-machine.md).
            log.info(
                "updates now on %d torch thread(s), were %d: %d tbexp job(s) share these cores; the losses' last "
                "bits can move with it (backend.share_cores=false keeps it fixed)",
                threads,
                self.last,
                live_jobs(self.folder),
            )
        self.last = threads
        return threads


def register(folder: Path | None = None) -> Path:
    """Announce this process and its cores to the other jobs; once per process."""
    folder = folder or jobs_folder()
    path = folder / f"{os.getpid()}.job"
    if _REGISTRATION and Path(_REGISTRATION[0].name) == path:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # Locked before it gets its name, so no other job ever sees the file unlocked and takes it for a dead one's.
    f = open(folder / f".{os.getpid()}.tmp", "w")
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(" ".join(str(c) for c in sorted(_affinity())) + "\n")
    f.flush()
    os.replace(f.name, path)
    _REGISTRATION[:] = [_Named(f, path)]
    return path


def share(cores: int, folder: Path | None = None) -> int:
    """This job's threads: `cores` divided among the live registered jobs whose cores overlap ours (us included)."""
    return max(1, cores // max(1, live_jobs(folder)))


class _Named:
    """The open (locked) registration file, under the name it was renamed to."""

    def __init__(self, f, path: Path):
        self.file, self.name = f, str(path)


def live_jobs(folder: Path | None = None) -> int:
    """Registered jobs still alive whose cores overlap this process's, counting this one; stale files are removed."""
    folder = folder or jobs_folder()
    mine, count = _affinity(), 1
    own = Path(_REGISTRATION[0].name) if _REGISTRATION else None
    for path in folder.glob("*.job") if folder.is_dir() else []:
        if own is not None and path == own:
            continue
        alive, cpus = _probe(path)
        if alive and (not cpus or cpus & mine):
            count += 1
    return count


def jobs_folder() -> Path:
    return Path(os.environ.get("TBEXP_JOBS_DIR") or Path(tempfile.gettempdir()) / f"tbexp-jobs-{os.getuid()}")


def _probe(path: Path) -> tuple[bool, set[int]]:
    """(is its owner alive, the cores it named); a file nobody holds is a dead job's and is removed."""
    try:
        with open(path) as f:
            cpus = {int(c) for c in f.read().split()}
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True, cpus
        path.unlink(missing_ok=True)
    except (FileNotFoundError, ValueError):
        pass
    return False, set()


def _affinity() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """ceil(quota / period) of this process's cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`); None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else max(1, math.ceil(quota_us / period_us))
    except (OSError, ValueError):
        return None
