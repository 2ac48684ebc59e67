"""What an agent left in a bwrap sandbox, seen from the host: its processes and the files it wrote.

* Processes: every sandbox process is in the sandbox's cgroup (its daemons in a child group). `ProcessMark`
  remembers the ones alive before the agent's first command (the environment's own: a holding init, a service
  the image starts) by pid and start time, so a pid reused later is not mistaken for one of them; a process
  whose parent chain reaches one of them is the environment's too (a service's workers), unless the chain
  passes a PID namespace's first process, which adopts every orphan. Everything else is the
  agent's, and `end` kills it, round after round until none is left (a process may fork while it is killed).
* Files: `snapshot` records every path under the sandbox's writable folders (size, mtime, mode, link target);
  `diff` of two snapshots is what was added, changed or deleted in between. The root file system is read-only,
  so that is all an agent can change.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tbexp.sandboxes.base import Change, SandboxError
from tbexp.sandboxes.cgroup import kill_until_gone

END_ROUNDS_S = 5.0  # how long `end` keeps killing before it reports what is still alive


def cgroup_pids(cgroup) -> set[int]:
    """Every pid in the cgroup and its child groups."""
    found: set[int] = set()
    for top in cgroup.dirs if cgroup else []:
        for procs in [top / "cgroup.procs", *top.glob("*/cgroup.procs")]:
            try:
                found.update(int(p) for p in procs.read_text().split())
            except OSError:
                pass
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)[:200]


class ProcessMark:
    """The environment's processes at the agent's start; `agents()` are the others in the cgroup now."""

    def __init__(self, cgroup, inits: set[int] = frozenset()):
        self.cgroup = cgroup
        self.inits = inits  # processes that adopt orphans: an agent's daemon reparented to one is still the agent's
        self.kept = {(pid, stat[1]) for pid in cgroup_pids(cgroup) if (stat := _stat(pid))}

    def agents(self) -> dict[int, str]:
        """pid -> command line of every process that is not the environment's."""
        live = {pid: stat for pid in cgroup_pids(self.cgroup) if (stat := _stat(pid))}
        return {pid: cmdline(pid) for pid in live if not self._environments(pid, live)}

    def end(self) -> list[str]:
        """Kill every agent process; the command lines of those still alive after END_ROUNDS_S."""
        kill_until_gone(lambda: set(self.agents()), END_ROUNDS_S, max_pause_s=0.02)
        return [f"{pid} {line}" for pid, line in self.agents().items()]

    def _environments(self, pid: int, live: dict[int, tuple[int, int]]) -> bool:
        seen = set()
        while pid in live and pid not in seen:
            if (pid, live[pid][1]) in self.kept:
                return True
            seen.add(pid)
            pid = live[pid][0]
            if pid in self.inits:
                return False  # an orphan the namespace's init adopted: not the environment's
        return False


def snapshot(work: Path, roots: tuple[str, ...]) -> dict[str, tuple]:
    """sandbox path -> (is_dir, size, mtime_ns, mode, link target) for everything under the writable roots."""
    found: dict[str, tuple] = {}
    for root in roots:
        base = work / root.lstrip("/")
        for parent, dirs, files in os.walk(base):
            for name in dirs + files:
                host = Path(parent, name)
                try:
                    st = host.lstat()
                except OSError:
                    continue
                link = os.readlink(host) if host.is_symlink() else ""
                is_dir = host.is_dir() and not link
                found["/" + str(host.relative_to(work))] = (is_dir, st.st_size, st.st_mtime_ns, st.st_mode, link)
    return found


def diff(before: dict[str, tuple], after: dict[str, tuple]) -> list[Change]:
    """What changed from `before` to `after` (a directory is 'changed' only when its mode changed)."""
    changes = []
    for path, now in after.items():
        was = before.get(path)
        if was is None:
            changes.append(Change(path, "added", now[0]))
        elif now[0] and was[0]:
            if now[3] != was[3]:
                changes.append(Change(path, "changed", True))
        elif now != was:
            changes.append(Change(path, "changed", now[0]))
    changes += [Change(path, "deleted", was[0]) for path, was in before.items() if path not in after]
    return sorted(changes, key=lambda c: c.path)


class BwrapAgentSide:
    """BwrapSandbox's side of tbexp.episodes.integrity: the agent's processes and files, and the verifier's binds.

    Uses the sandbox's `work` (its host folder), `writable`, `cgroup`, `daemons` (start_daemon's bwraps),
    `verifier_dirs` (sandbox path -> the host folder the verifier's execs bind there) and `_end_daemon`.
    """

    def mark_agent_start(self) -> None:
        self._mark = ProcessMark(self.cgroup, self._inits()) if self.cgroup else None
        self._first_agent_daemon = len(self.daemons)
        self._files = snapshot(self.work, self.writable)

    def agent_processes(self) -> list[str]:
        if getattr(self, "_mark", None) is not None:
            return [f"{pid} {line}" for pid, line in self._mark.agents().items()]
        return [f"{d.pid} {cmdline(d.pid)}" for d in self._agent_daemons() if d.poll() is None]

    def end_agent_processes(self) -> list[str]:
        for proc in self._agent_daemons():
            self._end_daemon(proc)
        return self._mark.end() if getattr(self, "_mark", None) is not None else []

    def agent_changes(self) -> list[Change]:
        if getattr(self, "_files", None) is None:
            return []
        return diff(self._files, snapshot(self.work, self.writable))

    def begin_verification(self, fresh_tests: bool = True) -> None:
        """The verifier's execs get /tests and /logs/verifier of their own, which no agent process has mounted,
        and tbexp's start-up folder read-only (tbexp.episodes.integrity)."""
        from tbexp.sandboxes.verifier_files import RUNTIME_MOUNT

        if not fresh_tests:  # the image's /tests (a separate verifier's): the sandbox's own copy of it stays
            self.verifier_dirs.pop("/tests", None)
        mount_points = (self.work / "tmp" / RUNTIME_MOUNT.removeprefix("/tmp/"), self.work / "logs" / "verifier")
        for host in (*self.verifier_dirs.values(), *mount_points):  # where the binds go: real, empty folders
            replace_with_dir(host)
        self.verifier_dirs["/logs/verifier"].chmod(0o777)  # a non-root [verifier] user writes there
        self.verifying = True

    def agent_roots(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.workdir, *self.writable)))

    def _agent_daemons(self) -> list:
        return self.daemons[getattr(self, "_first_agent_daemon", len(self.daemons)) :]

    def _inits(self) -> set[int]:
        """Processes that adopt orphans (a PID namespace's first): their descendants are not the environment's."""
        return set()


def inside(host: Path, root: Path, remote: str) -> Path:
    """`host` under `root`, through no symlink that leads out."""
    parent = host.parent.resolve()
    if host != root and parent != root.resolve() and root.resolve() not in parent.parents:
        raise SandboxError(f"{remote}: resolves outside the sandbox")
    return host


def replace_with_dir(host: Path) -> None:
    """An empty directory at `host`, whatever stood there (a symlink is removed, never followed)."""
    if host.is_symlink() or host.is_file():
        host.unlink()
    elif host.is_dir():
        shutil.rmtree(host)
    host.mkdir(parents=True)
