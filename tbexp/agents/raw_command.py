"""The raw-command protocol: one bash command per turn, its output as the observation.

The reply is the command itself (a surrounding ``` fence is tolerated); the
reply `exit` ends the episode. This is the protocol small models are trained
on in the raw-command recipe: no JSON to get wrong, one decision per turn.
"""

from __future__ import annotations

import re

from tbexp.agents.base import Action, Agent, Turn
from tbexp.tasks.harbor_task import Task

DONE = "exit"
_FENCE = re.compile(r"^```[a-z]*\n(.*?)\n?```$", re.DOTALL)


class RawCommandAgent(Agent):
    def prompt(self, task: Task) -> str:
        return (
            f"{task.instruction.strip()}\n\n"
            f"You are in a bash shell in {task.workdir}. Reply with exactly one bash command per turn; "
            f"you will see its output. Reply `{DONE}` when the task is done."
        )

    def parse(self, reply: str, history: list[Turn]) -> Action:
        text = reply.strip()
        fenced = _FENCE.match(text)
        if fenced:
            text = fenced.group(1).strip()
        if not text:
            return Action(error="empty reply: expected one bash command")
        if text == DONE:
            return Action(done=True)
        return Action(commands=[text])

    def format(self, commands: list[str], done: bool) -> str:
        if done and not commands:
            return DONE
        if len(commands) != 1 or done:
            raise ValueError("raw_command replies carry exactly one command, or `exit` alone")
        return commands[0]

    def observe(self, turn: Turn) -> str:
        if turn.action.error:
            return f"Could not run that: {turn.action.error}"
        result = turn.results[-1]
        note = " (timed out)" if result.timed_out else " (output cut: too much)" if result.output_truncated else ""
        return f"{self._clip(result.output)}\n[exit {result.exit_code}{note}]"
