"""What every agent protocol shares: actions, turn records, and a persistent shell.

An agent protocol turns a task into the first prompt, a model's reply into
commands (`parse`), commands back into a reply (`format`, used by the
oracle and for training data), and command results into the next
observation. A command is *valid* when its reply parsed, it was executed,
and its exit status is not 126 (found but not executable) or 127 (not
found): the shell ran it. A time-out or a failing exit status is still valid.
"""

from __future__ import annotations

import abc
import shlex
from dataclasses import dataclass, field
from typing import Any

from tbexp.sandboxes.base import ExecResult, Sandbox
from tbexp.tasks.harbor_task import Task

INVALID_EXIT_CODES = (126, 127)


@dataclass(frozen=True)
class Action:
    commands: list[str] = field(default_factory=list)
    done: bool = False  # the agent says the task is complete
    error: str = ""  # why the reply did not parse; "" when it did
    timeouts_s: list[float | None] = field(default_factory=list)  # per command; None = the sandbox default


@dataclass
class Turn:
    reply: str
    action: Action
    results: list[ExecResult] = field(default_factory=list)

    @property
    def n_commands(self) -> int:
        """Commands this turn attempted; an unparseable reply counts as one failed attempt."""
        return 1 if self.action.error else len(self.action.commands)

    @property
    def n_valid(self) -> int:
        if self.action.error:
            return 0
        return sum(1 for r in self.results if r.exit_code not in INVALID_EXIT_CODES)


class Agent(abc.ABC):
    def __init__(self, settings: Any):
        self.settings = settings  # the `agent` config node

    @abc.abstractmethod
    def prompt(self, task: Task) -> str:
        """The first user message."""

    @abc.abstractmethod
    def parse(self, reply: str, history: list[Turn]) -> Action: ...

    @abc.abstractmethod
    def format(self, commands: list[str], done: bool) -> str:
        """A reply this protocol parses back into `commands` and `done`."""

    @abc.abstractmethod
    def observe(self, turn: Turn) -> str:
        """The next user message after `turn` ran."""

    def _clip(self, text: str) -> str:
        limit = self.settings.observation_limit_chars
        if len(text) <= limit:
            return text
        half = limit // 2
        return f"{text[:half]}\n[... {len(text) - limit} characters cut ...]\n{text[-half:]}"


class ShellSession:
    """Runs commands one at a time as if typed into one terminal.

    Each `Sandbox.exec` is a fresh process, so the working directory and
    exported variables are saved after every command and restored before the
    next. Simplification: background processes do not survive between
    commands, as they would in a real terminal.
    """

    STATE = "/tmp/.tbexp-shell"

    def __init__(self, sandbox: Sandbox, workdir: str):
        self.sandbox = sandbox
        self.workdir = workdir

    def run(self, command: str, timeout_s: float | None = None) -> ExecResult:
        if "\x00" in command:  # no process can receive it as an argument: a bash that cannot run it says 126
            return ExecResult("bash: the command contains a NUL byte and cannot be run", 126)
        s = self.STATE
        # Shell builtins only (no `cat`, no `mkdir` unless needed): every fork is CPU the tests need.
        script = (
            f'{{ IFS= read -r __tbexp_cwd < {s}/cwd && cd "$__tbexp_cwd"; }} 2>/dev/null || cd {shlex.quote(self.workdir)} 2>/dev/null; '
            f"[ -f {s}/env ] && . {s}/env 2>/dev/null; "
            f"eval {shlex.quote(command)}\n"
            f"__tbexp_rc=$?; {{ [ -d {s} ] || mkdir -p {s}; }} && pwd > {s}/cwd && export -p > {s}/env; exit $__tbexp_rc"
        )
        return self.sandbox.exec(script, timeout_s)


def make_agent(settings: Any) -> Agent:
    from hydra.utils import get_class

    return get_class(settings._target_)(settings)
