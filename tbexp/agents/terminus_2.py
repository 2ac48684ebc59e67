"""terminus-2 as Harbor runs it: a tmux pane in the sandbox, and Harbor's own templates, parser and messages.

What the model sees is what Harbor's `Terminus2` sends it, byte for byte (tests/test_terminus_2_parity.py
holds the two side by side). Harbor's code is used wherever it can be imported:
* the pane is Harbor's `TmuxSession` (its `tmux new-session` command, `send-keys` batching and paste fallback,
  `capture-pane`, incremental output), over a small adapter that gives it the sandbox's `exec`; the command
  that starts the tmux server runs through `Sandbox.start_daemon`, so the server outlives that exec;
* a turn's keystrokes are Harbor's `Terminus2._execute_commands`: each command's keys sent non-blocking
  (control keys such as `C-c` and `Enter` are tmux key names), then `duration` waited, capped at 60 s as
  Harbor caps it; the observation is the incremental pane output through Harbor's 10,000-byte limit;
* the prompt and time-out templates are read from the installed harbor package; `agent.parser` picks the
  JSON or XML variant and Harbor's matching parser, whose warnings and auto-corrections are shown as Harbor
  shows them; the completion confirmation and error-type texts are Harbor's own methods.
What is re-implemented, because it is a loop inside Harbor's `_run_agent_loop`: the order of a turn (session
alive? -> reply -> parse -> run -> observe), the parse-error and warning messages, and `task_complete`'s double
confirmation (a first `true` runs the turn's commands and asks; a second consecutive one ends the episode;
an unparseable reply in between keeps the question pending, as in Harbor).

Differences from Harbor, on purpose or by necessity:
* Context summarization is refused (`agent.summarize=true` is an error): its three extra model calls are not
  one linear conversation, so the episode's tokens could not be trained on as sampled. With it off, as here,
  Harbor ends the episode when the context is full; tbexp's model policy ends it when the next reply would
  not fit in `model.max_length_tokens` (the model config's context, never a default of this module).
* No asciinema recording (Harbor's `record_terminal_session`): it would type `asciinema rec` into the pane.
* A tmux that is missing is an error naming the environment, not an install attempt (tbexp's environments
  all have tmux: scripts/build_rootfs.sh, sandboxes/debian_roots.py, sandboxes/docker_images.py).
* Commands run as the sandbox's user; MCP servers and skills are not added to the instruction.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tbexp.agents.base import Action, Agent, AgentSession, Outcome, Turn
from tbexp.config import ConfigError
from tbexp.sandboxes.base import ExecResult, Sandbox, SandboxError
from tbexp.tasks.harbor_task import Task

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise

MAX_DURATION_S = 60  # Harbor's cap on a command's `duration` (inline in Terminus2._handle_llm_interaction)
PANE_LOG = "/logs/agent/terminus_2.pane"  # Harbor's: EnvironmentPaths.agent_dir / "terminus_2.pane"
PARSERS = ("json", "xml")
TEMPLATES = {"json": "terminus-json-plain.txt", "xml": "terminus-xml-plain.txt"}
FORMAT_DURATION_S = 0.1  # what `format` gives a command: the templates' advice for immediate commands


class Terminus2Agent(Agent):
    """The protocol (parse, format, observe); the pane is the `Terminus2Session` that `open` starts."""

    def __init__(self, settings: Any):
        super().__init__(settings)
        if settings.parser not in PARSERS:
            raise ConfigError(f"agent.parser={settings.parser!r}: choose one of {', '.join(PARSERS)}")
        if settings.summarize:
            raise ConfigError(
                "agent.summarize=true: context summarization is not supported by tbexp's terminus_2 (its extra "
                "model calls are not one conversation, so its tokens cannot be trained on as sampled); set it false"
            )
        from harbor.agents.terminus_2 import terminus_2 as harbor_terminus

        # Harbor sets its logger to DEBUG on import and its TmuxSession logs every keystroke there: hundreds of
        # lines a minute on the console that bury the job's own log (run_trials quiets Harbor's trials alike).
        logging.getLogger("harbor.utils.logger").setLevel(logging.INFO)
        self.harbor = harbor_terminus
        templates = Path(harbor_terminus.__file__).parent / "templates"
        self.prompt_template = (templates / TEMPLATES[settings.parser]).read_text()
        self.timeout_template = (templates / "timeout.txt").read_text()
        parsers = {"json": harbor_terminus.TerminusJSONPlainParser, "xml": harbor_terminus.TerminusXMLPlainParser}
        self.parser = parsers[settings.parser]()
        # Harbor's own methods read only these attributes of the agent: they are called on this stand-in.
        self.harbor_self = SimpleNamespace(
            options=SimpleNamespace(parser_name=settings.parser),
            _timeout_template=self.timeout_template,
            _limit_output_length=partial(harbor_terminus.Terminus2._limit_output_length, None),
        )

    def open(self, sandbox: Sandbox) -> "Terminus2Session":
        return Terminus2Session(self, sandbox)

    def prompt(self, task: Task, terminal_state: str = "") -> str:
        """Harbor's first message: the template with the instruction and the pane as it stood at the start."""
        return self.prompt_template.format(instruction=task.instruction, terminal_state=terminal_state)

    def parse(self, reply: str, history: list[Turn]) -> Action:
        result = self.parser.parse_response(reply)
        feedback = ""  # as Terminus2._handle_llm_interaction builds it
        if result.error:
            feedback += f"ERROR: {result.error}"
            if result.warning:
                feedback += f"\nWARNINGS: {result.warning}"
        elif result.warning:
            feedback += f"WARNINGS: {result.warning}"
        if "ERROR:" in feedback:  # Harbor's own test: nothing runs, the reply is asked for again
            return Action(error=feedback)
        commands = [c.keystrokes for c in result.commands]
        durations = [min(c.duration, MAX_DURATION_S) for c in result.commands]
        warning = feedback if "WARNINGS:" in feedback else ""
        if result.is_task_complete and not _pending(history):
            return PendingAction(commands=commands, timeouts_s=durations, warning=warning)  # run, then ask
        return TerminusAction(commands=commands, done=result.is_task_complete, timeouts_s=durations, warning=warning)

    def format(self, commands: list[str], done: bool, duration_s: float = FORMAT_DURATION_S) -> str:
        """A reply this agent parses without warnings: each command typed with a newline, waited `duration_s`."""
        keys = [command + "\n" if command else "" for command in commands]
        analysis = "Continuing with the task." if commands else "The task is complete."
        plan = "Run the next commands." if commands else "Mark the task complete."
        if self.settings.parser == "json":
            return json.dumps(
                {
                    "analysis": analysis,
                    "plan": plan,
                    "commands": [{"keystrokes": k, "duration": duration_s} for k in keys],
                    "task_complete": done,
                },
                indent=2,
            )
        body = "".join(f'<keystrokes duration="{duration_s}">{k}</keystrokes>\n' for k in keys)
        return (
            f"<response>\n<analysis>{analysis}</analysis>\n<plan>{plan}</plan>\n<commands>\n{body}</commands>\n"
            f"<task_complete>{str(done).lower()}</task_complete>\n</response>"
        )

    def settle_reply(self, wait_s: float) -> str:
        """A reply that types nothing and waits `wait_s`: the oracle's way to let a command finish."""
        return self.format([""], done=False, duration_s=wait_s)

    def observe(self, turn: Turn) -> str:
        """The next user message, as Terminus2._run_agent_loop builds it from the turn's terminal output."""
        action, limit = turn.action, self.harbor_self._limit_output_length
        if action.error:
            kind = self.harbor.Terminus2._get_error_response_type(self.harbor_self)
            return (
                f"Previous response had parsing errors:\n{action.error}\n\n"
                f"Please fix these issues and provide a proper {kind}."
            )
        if isinstance(action, PendingAction):
            return self.harbor.Terminus2._get_completion_confirmation_message(self.harbor_self, turn.screen)
        if action.done:
            return turn.screen  # Harbor's observation for a confirmed completion (never sent: the episode ends)
        if action.warning:
            return f"Previous response had warnings:\n{action.warning}\n\n{limit(turn.screen)}"
        return limit(turn.screen)


@dataclass(frozen=True)
class TerminusAction(Action):
    """A parsed reply; `timeouts_s` holds each command's `duration` (capped at MAX_DURATION_S)."""

    warning: str = ""  # Harbor's "WARNINGS: ..." feedback on the reply, shown above the next observation


@dataclass(frozen=True)
class PendingAction(TerminusAction):
    """A first `task_complete: true`: its commands run, then the model is asked to confirm."""


def _pending(history: list[Turn]) -> bool:
    """Harbor's `_pending_completion` after `history`: set by a first completion, cleared by a turn without one,
    left as it was by an unparseable reply."""
    for turn in reversed(history):
        if not turn.action.error:
            return isinstance(turn.action, PendingAction)
    return False


class Terminus2Session(AgentSession):
    """One episode's tmux pane: Harbor's TmuxSession over the sandbox, driven on an event loop of its own."""

    stops_out_of_context = True  # as Harbor with summarization off: the episode ends, no reply is made up

    def __init__(self, agent: Terminus2Agent, sandbox: Sandbox):
        self.agent, self.sandbox = agent, sandbox
        self.loop = asyncio.new_event_loop()
        self.tmux: Any = None

    def begin(self, task: Task) -> str:
        if self.tmux is None:
            self.tmux = _tmux_session(self.agent, self.sandbox)
            self.loop.run_until_complete(self.tmux.start())
        limit = self.agent.harbor_self._limit_output_length
        return self.agent.prompt(task, limit(self.loop.run_until_complete(self.tmux.get_incremental_output())))

    def alive(self) -> bool:
        return self.loop.run_until_complete(self.tmux.is_session_alive())

    def step(self, reply: str, history: list[Turn], deadline: float) -> Outcome:
        turn = Turn(reply, self.agent.parse(reply, history))
        if turn.action.error:
            return Outcome(turn, self.agent.observe(turn))
        Command = self.agent.harbor.Command
        commands = [Command(keys, duration) for keys, duration in zip(turn.action.commands, turn.action.timeouts_s)]
        run = self.agent.harbor.Terminus2._execute_commands(self.agent.harbor_self, commands, self.tmux)
        try:
            _, turn.screen = self.loop.run_until_complete(asyncio.wait_for(run, max(deadline - time.monotonic(), 0)))
        except TimeoutError:  # the agent's time ran out mid-turn: graded as it stands, as Harbor grades a time-out
            return Outcome(turn, None)
        except (SandboxError, OSError, RuntimeError) as err:  # keys that could not be sent: the pane is broken
            return Outcome(turn, None, f"the terminal broke: {type(err).__name__}: {err}")
        turn.results = [ExecResult("", 0) for _ in commands]  # sent to the pane; its exit codes are not known
        return Outcome(turn, None if turn.action.done else self.agent.observe(turn))

    def close(self) -> None:
        self.loop.close()


def _tmux_session(agent: Terminus2Agent, sandbox: Sandbox) -> Any:
    from harbor.agents.terminus_2.tmux_session import TmuxSession

    class TbexpTmuxSession(TmuxSession):
        async def _attempt_tmux_installation(self) -> None:
            """tmux is part of every environment tbexp builds; where it is not, say so rather than install it."""
            if (await self.environment.exec("tmux -V")).return_code != 0:
                raise SandboxError(
                    f"{sandbox.task.name}: no tmux in its environment (agent=terminus_2 drives a tmux pane); "
                    "tbexp's own environments install it, a prebuilt image must have it"
                )

    environment = _SandboxAsEnvironment(sandbox)
    environment.run("mkdir -p " + shlex.quote(str(Path(PANE_LOG).parent)))  # Harbor's agent dir, a mount there
    s = agent.settings
    return TbexpTmuxSession(
        session_name="terminus-2",  # Terminus2.name(): the pane's name is part of no message, but kept the same
        environment=environment,
        logging_path=Path(PANE_LOG),
        local_asciinema_recording_path=None,
        remote_asciinema_recording_path=None,
        pane_width=s.pane_width,
        pane_height=s.pane_height,
    )


class _SandboxAsEnvironment:
    """What TmuxSession calls of Harbor's BaseEnvironment (`exec`, `session_id`), over a tbexp sandbox.

    As in sandboxes/harbor_env.py: stdout and stderr come back together in `stdout`, and a command that starts
    the tmux server runs through `start_daemon`."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox
        self.session_id = sandbox.task.name

    def run(self, command: str, timeout_s: float | None = None) -> ExecResult:
        from tbexp.sandboxes.harbor_env import TMUX_SERVER_START

        start = self.sandbox.start_daemon if TMUX_SERVER_START in command else self.sandbox.exec
        return start(command, timeout_s)

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict | None = None,
        timeout_sec: int | None = None,
        user: Any = None,
    ) -> Any:
        from harbor.environments.base import ExecResult as HarborResult

        result = self.run(command, float(timeout_sec) if timeout_sec else None)
        return HarborResult(stdout=result.output, stderr="", return_code=result.exit_code)
