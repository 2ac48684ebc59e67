"""Per-sandbox process and memory limits through Linux control groups.

A fork bomb or a memory hog must hit a wall that belongs to its own sandbox,
not to the host or to the other episodes running beside it. rlimits cannot
do that for processes that run as root, so each sandbox gets its own `pids`
and `memory` cgroup (v1 hierarchies, or the unified v2 tree when that is
what the machine has). Where no cgroup can be created (not root, read-only
cgroupfs) `Cgroup.create` returns None and the caller falls back to rlimits.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup")
PARENT = "tbexp"


class Cgroup:
    """A named pair of cgroup directories that processes can be moved into."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, name: str, pids_max: int, memory_bytes: int) -> "Cgroup | None":
        pids, memory = V1_ROOT / "pids" / PARENT / name, V1_ROOT / "memory" / PARENT / name
        try:
            if (V1_ROOT / "pids").is_dir() and (V1_ROOT / "memory").is_dir():
                for d in (pids, memory):
                    d.mkdir(parents=True, exist_ok=True)
                (pids / "pids.max").write_text(str(pids_max))
                (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
                swap = memory / "memory.memsw.limit_in_bytes"
                if swap.exists():
                    swap.write_text(str(memory_bytes))  # no escaping the limit into swap
                return cls([pids, memory])
            unified = Path("/sys/fs/cgroup")
            if (unified / "cgroup.controllers").exists():
                d = unified / PARENT / name
                d.mkdir(parents=True, exist_ok=True)
                (d / "pids.max").write_text(str(pids_max))
                (d / "memory.max").write_text(str(memory_bytes))
                return cls([d])
        except OSError:
            pass
        return None

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
        deadline = time.monotonic() + timeout_s
        pause_s = 0.0002  # processes already exiting vanish within a fraction of a millisecond
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(pause_s)
            pause_s = min(pause_s * 2, 0.005)

    def remove(self) -> None:
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


def leftover_cgroups() -> list[Cgroup]:
    """Every tbexp cgroup on the machine, grouped by name (for reaping after a crash)."""
    by_name: dict[str, list[Path]] = {}
    for parent in (V1_ROOT / "pids" / PARENT, V1_ROOT / "memory" / PARENT, Path("/sys/fs/cgroup") / PARENT):
        if parent.is_dir():
            for d in parent.iterdir():
                if d.is_dir():
                    by_name.setdefault(d.name, []).append(d)
    return [Cgroup(dirs) for dirs in by_name.values()]
