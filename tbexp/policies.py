"""Policies that need no model, for checking tasks, sandboxes and the eval stage.

A policy answers the conversation so far with one reply in the agent's
protocol. `oracle` replays the task's `solution/solve.sh`: one line per
turn when the script is a plain list of one-line commands (the built-in
tasks are written that way, so their solutions double as agent turns), or
else a single turn that runs the uploaded script. `nop` declares the task
done at once. `policy=model` (sampling from a training backend) arrives with
the backends.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Protocol

from tbexp.agents.base import Agent
from tbexp.tasks.harbor_task import Task

# A line opening a block must close it on the same line; a line starting with a closer continues an earlier one.
_OPENERS = {"if": "fi", "for": "done", "while": "done", "until": "done", "case": "esac", "{": "}"}
_CLOSERS = {"then", "else", "elif", "fi", "do", "done", "esac", "}"}


class EpisodePolicy(Protocol):
    uploads: dict[Path, str]  # host path -> sandbox path, copied in before the first turn

    def act(self, messages: list[dict[str, str]]) -> str: ...


class PolicyError(RuntimeError):
    """A policy that cannot act on this task (e.g. the oracle without a solution)."""


class OraclePolicy:
    def __init__(self, task: Task, agent: Agent):
        script = task.solution_script
        if script is None:
            raise PolicyError(f"{task.path / 'solution' / 'solve.sh'}: missing, so policy=oracle cannot solve {task.name}")
        lines = solution_turns(script.read_text())
        self.uploads: dict[Path, str] = {}
        if lines is None:
            self.uploads = {script.parent: "/solution"}
            lines = ["bash /solution/solve.sh"]
        self.replies = [agent.format([line], done=False) for line in lines]
        self.done_reply = agent.format([], done=True)

    def act(self, messages: list[dict[str, str]]) -> str:
        return self.replies.pop(0) if self.replies else self.done_reply


class NopPolicy:
    def __init__(self, task: Task, agent: Agent):
        self.uploads: dict[Path, str] = {}
        self.done_reply = agent.format([], done=True)

    def act(self, messages: list[dict[str, str]]) -> str:
        return self.done_reply


def solution_turns(script: str) -> list[str] | None:
    """The script's commands, one per line, or None when a line is not a whole command.

    >>> solution_turns("#!/bin/bash\\ncd /app\\n\\nwc -l a.txt > n.txt\\n")
    ['cd /app', 'wc -l a.txt > n.txt']
    >>> solution_turns("for f in *; do\\n  echo $f\\ndone\\n") is None
    True
    >>> solution_turns("for f in *.log; do gzip $f; done")
    ['for f in *.log; do gzip $f; done']
    """
    turns = []
    for line in script.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\") or "<<" in line or line.endswith(("{", "(", "|", "&&", "||")):
            return None
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unclosed quote: the command goes on past this line
            return None
        if words and (words[0] in _CLOSERS or (words[0] in _OPENERS and _OPENERS[words[0]] not in words)):
            return None
        turns.append(line)
    return turns


POLICIES = {"oracle": OraclePolicy, "nop": NopPolicy}


def make_policy(name: str, task: Task, agent: Agent, settings: Any = None) -> EpisodePolicy:
    if name == "model":
        raise PolicyError("policy=model samples from a training backend, which this version does not ship yet; use policy=oracle or policy=nop")
    if name not in POLICIES:
        raise PolicyError(f"policy={name!r}: choose one of {sorted(POLICIES)} or model")
    return POLICIES[name](task, agent)
