"""What an agent left in a Docker sandbox: its processes (listed from inside, as root) and the container's diff.

* Processes: one exec lists `/proc` (pid, parent, start time, command line), leaving itself out. The processes
  alive before the agent's first command are the environment's (a service the image starts), and so are the
  later ones whose parent chain reaches one of them without passing PID 1, which adopts every orphan. PID 1 and
  the sleep it restarts are tbexp's (docker_containers.KEEPER). The others are the agent's: `end` kills them,
  with `kill -9 -1` (one call new forks cannot race) when the environment has no process of its own, else by
  pid, round after round. Simplified: an agent process that names itself as the keeper's sleep is not listed
  (a `kill -9 -1` still ends it; where the environment runs services, it lives on).
* Files: the container's writable layer (overlay2's upper folder, on this host as the provisioning binds are),
  walked when the agent starts and again before the verifier, and the two compared as bwrap's writable folders
  are (tbexp.sandboxes.agent_state). Where that layer cannot be read, the engine's diff against the image is
  used instead (about a second a call here), less the diff at the agent's start; a path taken for a directory
  when another changed path lies under it, and a path the start had changed and the agent changed again unseen.
"""

from __future__ import annotations

import re
import stat
import time
from pathlib import Path

from tbexp.sandboxes import agent_state
from tbexp.sandboxes.base import Change

LIST = (
    'for d in /proc/[0-9]*; do p=${d#/proc/}; [ "$p" = "$$" ] && continue; '
    's=$(cat "$d/stat" 2>/dev/null) || continue; r=${s##*) }; set -- $r; '
    '[ "$2" = "$$" ] && continue; '
    'c=$(tr "\\000" " " < "$d/cmdline" 2>/dev/null | cut -c1-200); echo "$p $2 ${20} $c"; done'
)
KINDS = {0: "changed", 1: "added", 2: "deleted"}
KEEPER_SLEEP = re.compile(r"^sleep \d+\s*$")
END_S = 5.0


def processes(sandbox) -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, command line) of every process in the container but the lister's own."""
    found = {}
    for line in sandbox.run_as_root(["sh", "-c", LIST]).splitlines():
        fields = line.split(" ", 3)
        if len(fields) >= 3 and all(f.isdigit() for f in fields[:3]):
            found[int(fields[0])] = (int(fields[1]), int(fields[2]), fields[3] if len(fields) > 3 else "")
    return found


def _keepers(live: dict[int, tuple[int, int, str]]) -> set[int]:
    """PID 1 and the sleep it runs (docker_containers.KEEPER), which it restarts whenever it is killed."""
    return {1} | {pid for pid, (ppid, _, line) in live.items() if ppid == 1 and KEEPER_SLEEP.match(line)}


class ProcessMark:
    def __init__(self, sandbox):
        self.sandbox = sandbox
        live = processes(sandbox)
        keepers = _keepers(live)
        self.kept = {(pid, info[1]) for pid, info in live.items() if pid not in keepers}

    def agents(self) -> dict[int, str]:
        live = processes(self.sandbox)
        keepers = _keepers(live)
        return {pid: info[2] for pid, info in live.items() if pid not in keepers and not self._environments(pid, live)}

    @property
    def only_init(self) -> bool:
        """The environment had no process but PID 1 (and its sleep) when the agent started."""
        return not self.kept

    def end(self) -> list[str]:
        only_init = self.only_init
        deadline = time.monotonic() + END_S
        while (left := self.agents()) and time.monotonic() < deadline:
            self.sandbox.run_as_root(
                ["bash", "-c", "kill -9 -1" if only_init else f"kill -9 {' '.join(map(str, left))}"]
            )
        return [f"{pid} {line}" for pid, line in self.agents().items()]

    def _environments(self, pid: int, live: dict) -> bool:
        seen = set()
        while pid in live and pid not in seen and pid != 1:
            seen.add(pid)
            if (pid, live[pid][1]) in self.kept:
                return True
            pid = live[pid][0]
        return False


def upper_dir(api, container: str) -> Path | None:
    """The container's writable layer on this host (overlay2's UpperDir), where every change it made lies."""
    try:
        data = (api.inspect_container(container).get("GraphDriver") or {}).get("Data") or {}
    except Exception:  # noqa: BLE001 - no layer to read: the engine's diff is asked instead
        return None
    upper = Path(data.get("UpperDir") or "/nonexistent")
    return upper if upper.is_dir() else None


def state(api, container: str, upper: Path | None):
    """What `changes` compares: a walk of the writable layer (milliseconds), else the engine's diff (a second)."""
    if upper is not None:
        return agent_state.snapshot(upper, ("/",))
    return {entry["Path"]: KINDS.get(entry["Kind"], "changed") for entry in api.diff(container) or []}


def changes(before, after) -> list[Change]:
    """What the agent changed between two `state`s."""
    if after and isinstance(next(iter(after.values())), tuple):  # walks of the writable layer
        found = agent_state.diff(before, after)
        return [Change(c.path, "deleted", False) if _whiteout(after.get(c.path)) else c for c in found]
    new = {path: kind for path, kind in after.items() if before.get(path) != kind}
    dirs = {path[:i] for path in after for i, c in enumerate(path) if c == "/" and i}
    return [Change(path, kind, path in dirs) for path, kind in sorted(new.items())]


def _whiteout(entry: tuple | None) -> bool:
    """overlayfs marks a file the container deleted with a character device in its layer."""
    return entry is not None and stat.S_ISCHR(entry[3])


class DockerAgentSide:
    """DockerSandbox's side of tbexp.episodes.integrity (uses its `api`, `id`, `keep_processes`, `run_as_root`)."""

    def mark_agent_start(self) -> None:
        self._mark = ProcessMark(self)
        self._upper = upper_dir(self.api, self.id)
        self._state_at_start = state(self.api, self.id, self._upper)

    def agent_processes(self) -> list[str]:
        mark = getattr(self, "_mark", None)
        return [f"{pid} {line}" for pid, line in mark.agents().items()] if mark else []

    def end_agent_processes(self) -> list[str]:
        mark = getattr(self, "_mark", None)
        survivors = mark.end() if mark else []
        # The verifier's execs clean up after themselves again, unless the environment runs services of its own.
        self.keep_processes = bool(mark) and not mark.only_init and getattr(self, "keep_processes", False)
        return survivors

    def agent_changes(self) -> list[Change]:
        if getattr(self, "_state_at_start", None) is None:
            return []
        return changes(self._state_at_start, state(self.api, self.id, self._upper))
