"""What every agent protocol shares: actions, turn records, and a persistent shell.

An agent protocol turns a task into the first prompt, a model's reply into
commands (`parse`), commands back into a reply (`format`, used by the
oracle and for training data), and command results into the next
observation. The episode drives it through an `AgentSession` that the agent
opens on the sandbox (`Agent.open`): the default, `CommandSession`, runs each
command through a `ShellSession`; terminus-2 opens a tmux pane instead. A command is *valid* when its reply parsed, it was executed,
and its exit status is not 126 (found but not executable) or 127 (not
found): the shell ran it. A time-out or a failing exit status is still valid.
"""

from __future__ import annotations

import abc
import shlex
from dataclasses import dataclass, field
from typing import Any

from tbexp.sandboxes.base import ExecResult, Sandbox, SandboxError
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
    screen: str = ""  # a terminal agent's: what the terminal showed after the turn ("" for command agents)

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

    def open(self, sandbox: Sandbox) -> "AgentSession":
        """This protocol's terminal in one episode's sandbox (a multi-step task's steps share it)."""
        return CommandSession(self, ShellSession(sandbox, sandbox.workdir))

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
        if "\x00" in command:
            return NUL_COMMAND
        return self.sandbox.exec(shell_script(command, self.workdir), timeout_s)


# No process can receive a NUL byte as an argument: a bash that cannot run the command says 126.
NUL_COMMAND = ExecResult("bash: the command contains a NUL byte and cannot be run", 126)


def shell_script(command: str, workdir: str) -> str:
    """`command` wrapped to run in the directory and with the exports the previous command left (ShellSession.STATE)."""
    s = ShellSession.STATE
    # Shell builtins only (no `cat`, no `mkdir` unless needed): every fork is CPU the tests need.
    return (
        f'{{ IFS= read -r __tbexp_cwd < {s}/cwd && cd "$__tbexp_cwd"; }} 2>/dev/null || cd {shlex.quote(workdir)} 2>/dev/null; '
        f"[ -f {s}/env ] && . {s}/env 2>/dev/null; "
        f"eval {shlex.quote(command)}\n"
        f"__tbexp_rc=$?; {{ [ -d {s} ] || mkdir -p {s}; }} && pwd > {s}/cwd && export -p > {s}/env; exit $__tbexp_rc"
    )


@dataclass
class Outcome:
    """What one reply did: the turn as run, and the next user message (None: the episode ends)."""

    turn: Turn
    observation: str | None
    damage: str = ""  # the agent's own actions broke the sandbox (the episode is still scored); "" when not


class AgentSession(abc.ABC):
    """One episode's terminal, as an agent protocol sees it: the first prompt, then one `step` per reply."""

    stops_out_of_context = False  # a policy out of context ends the episode at once, with no reply of its own
    sandbox: Sandbox  # the episode's, which the session's commands run in

    @abc.abstractmethod
    def begin(self, task: Task) -> str:
        """The first user message for `task` (a step of a multi-step task: the next step's)."""

    @abc.abstractmethod
    def step(self, reply: str, history: list[Turn], deadline: float) -> Outcome:
        """Run `reply`; stop what it runs at `deadline` (time.monotonic()), the agent's time-out."""

    def alive(self) -> bool:
        """Whether the terminal can take another turn."""
        return True

    def close(self) -> None:
        """Release what the session holds; the sandbox itself is stopped by the episode."""


class CommandSession(AgentSession):
    """A command protocol's turns: each parsed command through a `ShellSession`, its results observed."""

    def __init__(self, agent: Agent, shell: ShellSession):
        self.agent, self.shell = agent, shell
        self.sandbox = shell.sandbox

    def begin(self, task: Task) -> str:
        return self.agent.prompt(task)

    def step(self, reply: str, history: list[Turn], deadline: float) -> Outcome:
        import time

        turn = Turn(reply, self.agent.parse(reply, history))
        timeouts = turn.action.timeouts_s or [None] * len(turn.action.commands)
        for command, timeout_s in zip(turn.action.commands, timeouts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            limit = min(left, max(timeout_s or 0.0, self.shell.sandbox.settings.command_timeout_s))
            try:
                turn.results.append(self.shell.run(command, limit))
            except (SandboxError, OSError) as err:  # the agent's command broke its sandbox: its failure, still scored
                return Outcome(turn, None, f"a command broke the sandbox: {type(err).__name__}: {err}")
        return Outcome(turn, None if turn.action.done else self.agent.observe(turn))


def make_agent(settings: Any) -> Agent:
    from hydra.utils import get_class

    return get_class(settings._target_)(settings)
