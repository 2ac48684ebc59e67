"""The sandbox interface: one fresh isolated environment per episode.

Five methods: `start`, `exec`, `upload`, `download`, `stop`. A sandbox is
single-use: started once, used by one episode, stopped once. `exec` runs
`bash -c command` as a fresh process in the sandbox's working directory; it
never raises for what the command does (a time-out, too much output, a
crash are all part of the `ExecResult`), only for a broken sandbox
(`SandboxError`), which makes the episode invalid rather than failed.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError
from tbexp.tasks.harbor_task import Task

TIMEOUT_EXIT = 124  # what coreutils' timeout(1) returns; used for every kill on time-out
OUTPUT_LIMIT_EXIT = 125  # the command was killed because it printed more than allowed


class SandboxError(TbexpError, RuntimeError):
    """The sandbox itself failed (not the command run in it)."""


class EnvironmentBuildError(SandboxError):
    """A task's environment cannot be built or honoured; the task is unrunnable, not one episode invalid."""


@dataclass(frozen=True)
class ExecResult:
    output: str  # stdout and stderr interleaved, cut at the output limit
    exit_code: int
    timed_out: bool = False
    output_truncated: bool = False
    duration_s: float = 0.0


class Sandbox(abc.ABC):
    """One episode's environment, built from a task's `environment/`."""

    provision: Any = None  # set at start: what provision.py bound in for the task's test.sh, or None

    def __init__(self, settings: Any, task: Task):
        self.settings = settings  # the `sandbox` config node
        self.task = task
        self.workdir = task.workdir  # where exec runs; a Dockerfile's WORKDIR may change it at start

    @classmethod
    def prepare(cls, settings: Any, task: Task) -> None:
        """Build the task's environment once, before any episode (EnvironmentBuildError if it cannot be)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult: ...

    @abc.abstractmethod
    def upload(self, local: Path, remote: str) -> None:
        """Copy a file or a directory's contents from the host to `remote` in the sandbox."""

    @abc.abstractmethod
    def download(self, remote: str, local: Path) -> None:
        """Copy a file or a directory's contents from `remote` in the sandbox to the host."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Release everything; safe to call twice or after a failed start."""

    def __enter__(self) -> "Sandbox":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_sandbox(settings: Any, task: Task) -> Sandbox:
    """Build the sandbox class named by `settings._target_` for one task."""
    from hydra.utils import get_class

    return get_class(settings._target_)(settings, task)
