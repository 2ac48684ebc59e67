"""The sandbox interface: one fresh isolated environment per episode.

Five methods: `start`, `exec`, `upload`, `download`, `stop`. A sandbox is
single-use: started once, used by one episode, stopped once. `exec` runs
`bash -c command` as a fresh process in the sandbox's working directory, as
the sandbox's current `user` (`as_user`, Harbor's `with_default_user`: the
episode runs the agent as task.toml's `[agent] user` and test.sh as its
`[verifier] user`; None is the image's USER); it never raises for what the
command does (a time-out, too much output, a crash are all part of the
`ExecResult`), only for a broken sandbox (`SandboxError`), which makes the
episode invalid rather than failed.

`task_limits` is the memory, disk and CPU a sandbox gets: the task's own
`memory_mb` / `storage_mb` / `cpus` where task.toml names them, as Harbor's
environments take them, else the `sandbox` node's.
Nothing an `exec` starts outlives it, except through `start_daemon`: a
command whose background processes (a tmux server, the shells in its panes
and what they run) must live on until `stop`, as terminus-2's terminal does,
or the service an image starts (its ENTRYPOINT/CMD, started at `start`:
image_start.py). `environment_source` says where the environment came from
(the episode record keeps it).
"""

from __future__ import annotations

import abc
import contextlib
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError
from tbexp.tasks.harbor_task import Task

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
AGENT_ROOTS = ("/app", "/tmp", "/var/tmp", "/dev/shm", "/root", "/home", "/logs", "/solution", "/tests")
TIMEOUT_EXIT = 124  # what coreutils' timeout(1) returns; used for every kill on time-out
OUTPUT_LIMIT_EXIT = 125  # the command was killed because it printed more than allowed


def launcher_env() -> dict[str, str]:
    """The environment a sandbox's launcher (bwrap, nsenter, prlimit) starts with: the host's PATH, nothing else.

    bwrap's `--clearenv` clears the command's environment, not bwrap's own, and bwrap is the sandbox's pid 1:
    from inside, `/proc/1/environ` shows whatever bwrap was started with, and the job's environment holds its
    secrets (tbexp.redaction).
    """
    return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LANG": "C.UTF-8"}


class SandboxError(TbexpError, RuntimeError):
    """The sandbox itself failed (not the command run in it)."""


class EnvironmentBuildError(SandboxError):
    """A task's environment cannot be built or honoured; the task is unrunnable, not one episode invalid."""


class MissingImageError(EnvironmentBuildError):
    """A FROM or `docker_image` image the Docker engine lacks (nothing is pulled)."""


@dataclass(frozen=True)
class ExecResult:
    output: str  # stdout and stderr interleaved, cut at the output limit
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class Change:
    """A path the agent added, changed or deleted since its first command (`Sandbox.agent_changes`)."""

    path: str  # absolute, in the sandbox
    kind: str  # added | changed | deleted
    is_dir: bool = False


@dataclass(frozen=True)
class Limits:
    memory_mb: int
    disk_mb: int
    cpus: float | None  # None: the node's `cpus` (Docker's quota; bwrap sets none)


def task_limits(settings: Any, task: Task) -> Limits:
    """The task's own limits where task.toml names them, else the `sandbox` node's."""
    return Limits(
        memory_mb=int(task.memory_mb or settings.memory_mb),
        disk_mb=int(task.storage_mb or settings.disk_mb),
        cpus=float(task.cpus) if task.cpus else None,
    )


class Sandbox(abc.ABC):
    """One episode's environment, built from a task's `environment/`."""

    provision: Any = None  # set at start: what provision.py bound in for the task's test.sh, or None
    user: str | int | None = None  # whom `exec` runs as; None = the image's USER
    environment_source: str = ""  # set at start: "environment/Dockerfile", "docker_image NAME", ... (and why)
    service: str = ""  # set at start: the image's service command it started before the agent, or ""

    def __init__(self, settings: Any, task: Task):
        self.settings = settings  # the `sandbox` config node
        self.task = task
        self.workdir = task.workdir  # where exec runs; a Dockerfile's WORKDIR may change it at start

    @classmethod
    def for_task(cls, settings: Any, task: Task) -> Sandbox:
        """The sandbox for one task: this class, or (bwrap) the kind the task's environment needs."""
        return cls(settings, task)

    @classmethod
    def prepare(cls, settings: Any, task: Task) -> None:
        """Build the task's environment once, before any episode (EnvironmentBuildError if it cannot be)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult: ...

    def start_daemon(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run `command` like `exec`, but what it leaves running lives on until `stop` (both sandboxes say how)."""
        raise SandboxError(f"{type(self).__name__} cannot keep a process between commands (start_daemon)")

    @abc.abstractmethod
    def upload(self, local: Path, remote: str) -> None:
        """Copy a file or a directory's contents from the host to `remote` in the sandbox."""

    @abc.abstractmethod
    def download(self, remote: str, local: Path) -> None:
        """Copy a file or a directory's contents from `remote` in the sandbox to the host."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Release everything; safe to call twice or after a failed start."""

    # -- the verifier's side (tbexp.episodes.integrity); a sandbox that cannot see its agent's work keeps these -----

    verifying = False  # between begin_verification and end_verification: execs are the verifier's
    image_path = DEFAULT_PATH  # the PATH the image gives a command

    def mark_agent_start(self) -> None:
        """Remember the processes and files the environment holds before the agent's first command."""

    def agent_processes(self) -> list[str]:
        """'<pid> <command line>' of each process the agent left (not the environment's own)."""
        return []

    def end_agent_processes(self) -> list[str]:
        """Kill every process the agent left; those still alive after (none, normally)."""
        return []

    def agent_changes(self) -> list[Change]:
        """What the agent added, changed or deleted since `mark_agent_start`."""
        return []

    def set_aside(self, paths: list[str]) -> None:
        """Rename each path to `<path>.tbexp-set-aside` (a free name), as root: out of the verifier's way, kept."""
        script = 'for p; do t="$p.tbexp-set-aside"; while [ -e "$t" ] || [ -L "$t" ]; do t="$t.x"; done; mv -f -- "$p" "$t"; done'
        with self.as_user("root"):
            self.exec(f"set -- {' '.join(shlex.quote(p) for p in paths)}; {script}", timeout_s=60)

    def shadows_image_tool(self, path: str) -> bool:
        """Another executable of `path`'s name is on the verifier's PATH: `path` stood in front of it."""
        name = shlex.quote(path.rsplit("/", 1)[-1])
        script = (
            f"dirs={shlex.quote(self.verifier_path())}; IFS=:; for d in $dirs; do "
            f'[ "$d/"{name} = {shlex.quote(path)} ] && continue; [ -x "$d/"{name} ] && {{ echo tbexp-shadows; exit 0; }}; '
            "done; true"
        )
        with self.as_user("root"):
            return "tbexp-shadows" in self.exec(script, timeout_s=30).output

    def begin_verification(self, fresh_tests: bool = True) -> None:
        """From now on execs are the verifier's (bwrap: a namespace no agent process is in); `fresh_tests`: with a
        /tests of their own (False: the image's, a separate verifier's tests/Dockerfile put them there)."""
        self.verifying = True

    def end_verification(self) -> None:
        self.verifying = False

    def agent_roots(self) -> tuple[str, ...]:
        """Folders the agent writes to as a matter of course (its work, scratch, home, logs)."""
        return tuple(dict.fromkeys((self.workdir, *AGENT_ROOTS)))

    def verifier_path(self) -> str:
        """The folders a command test.sh names is looked up in: the image's PATH, then the homes' .local/bin."""
        return f"{self.image_path}:/root/.local/bin"

    @contextlib.contextmanager
    def as_user(self, user: str | int | None) -> Iterator["Sandbox"]:
        """`exec` runs as `user` inside the block (None: the image's USER); an unknown user is a SandboxError."""
        before, self.user = self.user, user
        try:
            yield self
        finally:
            self.user = before

    def __enter__(self) -> "Sandbox":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_sandbox(settings: Any, task: Task) -> Sandbox:
    """Build the sandbox class named by `settings._target_` for one task."""
    from hydra.utils import get_class

    return get_class(settings._target_).for_task(settings, task)
