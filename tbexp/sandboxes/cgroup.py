"""Per-sandbox process and memory limits through Linux control groups.

A fork bomb or a memory hog must hit a wall that belongs to its own sandbox,
not to the host or to the other episodes running beside it. rlimits cannot
do that for processes that run as root, so each sandbox gets its own `pids`
and `memory` cgroup (v1 hierarchies, or the unified v2 tree when that is
what the machine has), and a `cpu` quota where the task names its cpus
(CFS: `cpus` x 100 ms of CPU time per 100 ms). Where no cgroup can be created (not root, read-only
cgroupfs) `Cgroup.create` returns None and the caller falls back to rlimits.
A sandbox's daemons (a tmux server that must outlive the exec that started it)
live in a child group: the parent's limits bound them too (v1 hierarchies are
hierarchical; in v2 a child without controllers of its own is charged to its
parent), while `kill_all` on the parent, which reads only the parent's own
`cgroup.procs`, spares them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup")
PARENT = "tbexp"
CPU_PERIOD_US = 100_000


class Cgroup:
    """A named pair of cgroup directories that processes can be moved into."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, name: str, pids_max: int, memory_bytes: int, cpus: float | None = None) -> "Cgroup | None":
        pids, memory = V1_ROOT / "pids" / PARENT / name, V1_ROOT / "memory" / PARENT / name
        quota_us = int(cpus * CPU_PERIOD_US) if cpus else 0
        try:
            if (V1_ROOT / "pids").is_dir() and (V1_ROOT / "memory").is_dir():
                dirs = [pids, memory]
                for d in dirs:
                    d.mkdir(parents=True, exist_ok=True)
                (pids / "pids.max").write_text(str(pids_max))
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                swap = memory / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(str(memory_bytes))  # no escaping the limit into swap
                if quota_us and (V1_ROOT / "cpu" / "cpu.cfs_quota_us").exists():
                    cpu = V1_ROOT / "cpu" / PARENT / name
                    cpu.mkdir(parents=True, exist_ok=True)
                    (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (cpu / "cpu.cfs_quota_us").write_text(str(quota_us))
                    dirs.append(cpu)
                return cls(dirs)
            unified = Path("/sys/fs/cgroup")
            if (unified / "cgroup.controllers").exists():
                d = unified / PARENT / name
                d.mkdir(parents=True, exist_ok=True)
                (d / "pids.max").write_text(str(pids_max))
                (d / "memory.max").write_text(str(memory_bytes))
                if quota_us and (d / "cpu.max").exists():
                    (d / "cpu.max").write_text(f"{quota_us} {CPU_PERIOD_US}")
                return cls([d])
        except OSError:
            pass
        return None

    def child(self, name: str) -> "Cgroup":
        """A group inside this one, without limits of its own: the parent's bound it (see the module docstring)."""
        dirs = [d / name for d in self.dirs]
        for d in dirs:
            d.mkdir(exist_ok=True)
        return Cgroup(dirs)

    def pids(self) -> set[int]:
        found: set[int] = set()
        for f in self.procs_files:
            try:
                found.update(int(p) for p in Path(f).read_text().split())
            except OSError:
                pass
        return found

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the group until it is empty (a fork bomb keeps forking)."""
        kill_until_gone(self.pids, timeout_s)

    def remove(self) -> None:
        children = [Cgroup([c]) for d in self.dirs if d.is_dir() for c in d.iterdir() if c.is_dir()]
        for child in children:  # a group with a child cannot be removed
            child.remove()
        self.kill_all()
        for d in self.dirs:
            for _ in range(100):  # rmdir fails with EBUSY until the last killed process is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


def kill_until_gone(pids, timeout_s: float, max_pause_s: float = 0.005) -> None:
    """SIGKILL what `pids()` lists, again and again, until it lists nothing or `timeout_s` is up."""
    deadline = time.monotonic() + timeout_s
    pause_s = 0.0002  # processes already exiting vanish within a fraction of a millisecond
    while (found := pids()) and time.monotonic() < deadline:
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, max_pause_s)


def leftover_cgroups() -> list[Cgroup]:
    """Every tbexp cgroup on the machine, grouped by name (for reaping after a crash)."""
    by_name: dict[str, list[Path]] = {}
    roots = (V1_ROOT / "pids", V1_ROOT / "memory", V1_ROOT / "cpu", Path("/sys/fs/cgroup"))
    for parent in (root / PARENT for root in roots):
        if parent.is_dir():
            for d in parent.iterdir():
                if d.is_dir():
                    by_name.setdefault(d.name, []).append(d)
    return [Cgroup(dirs) for dirs in by_name.values()]
