"""terminus-2's JSON protocol without a terminal: `agent=terminus_shell` (its old name `terminus_json` still works).

For terminus-2 as Harbor runs it (a tmux pane, Harbor's own prompt) see `agent=terminus_2`
(tbexp/agents/terminus_2.py). This variant stays for what the pane costs: no tmux server, no fixed waits, a
command's exit status known, so it is the cheaper choice where the leaderboard's exact observations do not
matter (small models, quick sweeps).

The model answers with `{"analysis": str, "plan": str, "commands":
[{"keystrokes": str, "duration": float}], "task_complete": bool}`. A reply
that does not parse runs nothing and gets a "parsing errors" message;
`task_complete` must be confirmed by a second consecutive reply.

Simplifications against terminus-2: keystrokes go to `ShellSession`
rather than a tmux pane, so a keystroke string is run as one command once its
trailing newline is stripped; control keys (`C-c`, `C-d`) are no-ops because
nothing keeps running between commands; `duration` (capped at 60 s) becomes
a lower bound on the command's time-out instead of a wait before reading the
pane; the observation is the commands' output rather than the pane's text.
"""

from __future__ import annotations

import json
import re

from tbexp.agents.base import Action, Agent, Turn
from tbexp.tasks.harbor_task import Task

MAX_DURATION_S = 60.0
_CONTROL_KEY = re.compile(r"^(C-[a-z]|M-[a-z]|Escape|Enter|Tab|Up|Down|Left|Right)$")
_CONFIRM = (
    "Are you sure you want to mark the task as complete? This will trigger your solution to be graded "
    'and you will not be able to make further changes. If so, include "task_complete": true in your JSON response again.'
)


class TerminusShellAgent(Agent):
    def prompt(self, task: Task) -> str:
        return (
            "You are an AI assistant tasked with solving command-line tasks in a Linux environment. "
            "You will be given a task description and the output from previously executed commands. "
            "Your goal is to solve the task by providing batches of shell commands.\n\n"
            "Format your response as JSON with the following structure:\n"
            '{"analysis": "...", "plan": "...", "commands": [{"keystrokes": "ls -la\\n", "duration": 0.1}], '
            '"task_complete": false}\n\n'
            f"Task Description:\n{task.instruction.strip()}\n\nCurrent terminal state:\nroot@sandbox:{task.workdir}# "
        )

    def parse(self, reply: str, history: list[Turn]) -> Action:
        try:
            data = json.loads(_json_object(reply))
        except (ValueError, json.JSONDecodeError) as err:
            return Action(error=f"response is not valid JSON: {err}")
        if not isinstance(data, dict):
            return Action(error="response must be a JSON object")
        missing = [k for k in ("analysis", "plan", "commands") if k not in data]
        if missing:
            return Action(error=f"missing required fields: {', '.join(missing)}")
        if not isinstance(data["commands"], list):
            return Action(error="'commands' must be a list")
        commands, timeouts = [], []
        for i, command in enumerate(data["commands"]):
            if not isinstance(command, dict) or not isinstance(command.get("keystrokes"), str):
                return Action(error=f"commands[{i}] needs a 'keystrokes' string")
            keys = command["keystrokes"].rstrip("\n")
            if not keys.strip() or _CONTROL_KEY.match(keys.strip()):
                continue
            duration = command.get("duration", 1.0)
            commands.append(keys)
            timeouts.append(min(float(duration), MAX_DURATION_S) if isinstance(duration, (int, float)) else None)
        complete = bool(data.get("task_complete", False))
        if complete and not (history and _asked_to_confirm(history[-1])):
            return _PendingAction(commands=commands, timeouts_s=timeouts)  # first time: ask to confirm
        return Action(commands=commands, done=complete, timeouts_s=timeouts)

    def format(self, commands: list[str], done: bool) -> str:
        return json.dumps(
            {
                "analysis": "Continuing with the task." if commands else "The task is complete.",
                "plan": "Run the next commands." if commands else "Mark the task complete.",
                "commands": [{"keystrokes": c + "\n", "duration": 1.0} for c in commands],
                "task_complete": done,
            }
        )

    def observe(self, turn: Turn) -> str:
        if turn.action.error:
            return f"Previous response had parsing errors:\nERROR: {turn.action.error}\n\nPlease fix these issues and provide a proper JSON response."
        screen = "".join(f"# {cmd}\n{res.output}" for cmd, res in zip(turn.action.commands, turn.results))
        if _asked_to_confirm(turn):
            return f"Current terminal state:\n{self._clip(screen)}\n\n{_CONFIRM}"
        return f"New Terminal Output:\n{self._clip(screen)}"


class _PendingAction(Action):
    """A first `task_complete: true`: run the commands, then ask for confirmation."""


def _asked_to_confirm(turn: Turn) -> bool:
    return isinstance(turn.action, _PendingAction)


def _json_object(reply: str) -> str:
    """The outermost {...} of a reply, tolerating text or a code fence around it."""
    start, end = reply.find("{"), reply.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object found")
    return reply[start : end + 1]
