"""Policies that need no model, for checking tasks, sandboxes and the eval stage.

A policy answers the conversation so far with one reply in the agent's
protocol. `oracle` replays the task's `solution/solve.sh`: one line per
turn when the script is a plain list of one-line commands (the built-in
tasks are written that way, so their solutions double as agent turns), or
else a single turn that runs the uploaded script. `nop` declares the task
done at once. `model` samples each reply from a backend's sampler and keeps
the episode's tokens exactly as sampled (`SampledTokens`, which the episode
carries as `Episode.sampled`), so training on an episode uses the sampled
tokens, never a re-tokenised copy.
"""

from __future__ import annotations

import shlex
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tbexp.agents.base import Agent
from tbexp.errors import TbexpError
from tbexp.tasks.harbor_task import Task

# A line opening a block must close it on the same line; a line starting with a closer continues an earlier one.
_OPENERS = {"if": "fi", "for": "done", "while": "done", "until": "done", "case": "esac", "{": "}"}
_CLOSERS = {"then", "else", "elif", "fi", "do", "done", "esac", "}"}


class EpisodePolicy(Protocol):
    uploads: dict[Path, str]  # host path -> sandbox path, copied in before the first turn

    def act(self, messages: list[dict[str, str]]) -> str: ...


class PolicyError(TbexpError, RuntimeError):
    """A policy that cannot act on this task (e.g. the oracle without a solution)."""


class OraclePolicy:
    def __init__(self, task: Task, agent: Agent):
        script = task.solution_script
        if script is None:
            raise PolicyError(
                f"{task.path / 'solution' / 'solve.sh'}: missing, so policy=oracle cannot solve {task.name}"
            )
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


@dataclass
class ModelRuntime:
    """What every model-policy episode shares: a sampler over fixed weights, a renderer, sampling settings."""

    sampler: Any  # tbexp.backends.base.Sampler
    renderer: Any  # tbexp.renderers.Renderer
    params: Any  # tinker.types.SamplingParams
    max_context_tokens: int = 2048
    seed: int | None = (
        None  # set: each reply's seed is a function of (seed, task, run, turn), so thread order does not matter
    )
    lock: threading.Lock = field(default_factory=threading.Lock)  # one sample at a time: the CPU is shared anyway
    queue: Any = None  # a sampler that answers many prompts at once gets its concurrent requests batched

    def __post_init__(self):
        if self.queue is None and hasattr(self.sampler, "request_queue"):  # the local sampler: batched or continuous
            self.queue = self.sampler.request_queue()
        elif self.queue is None and hasattr(self.sampler, "sample_batch"):
            from tbexp.backends.batch_sampling import BatchQueue

            self.queue = BatchQueue(self.sampler.sample_batch)


@dataclass
class SampledTurn:
    offset: int  # where the reply starts in the episode's tokens
    tokens: list[int]
    logprobs: list[float]


@dataclass
class SampledTokens:
    """An episode's tokens as the model saw and sampled them, and which of them it sampled, with their logprobs."""

    tokens: list[int] = field(default_factory=list)  # the whole episode so far: prompt, replies, observations
    turns: list[SampledTurn] = field(default_factory=list)  # each reply: where it starts, its tokens, their logprobs
    sample_s: float = 0.0  # time spent sampling, waiting for the sampler included

    @property
    def n_sampled(self) -> int:
        return sum(len(turn.tokens) for turn in self.turns)


class ModelPolicy:
    def __init__(self, task: Task, agent: Agent, runtime: ModelRuntime, run: int = 0):
        self.uploads: dict[Path, str] = {}
        self.runtime = runtime
        self.sampled = SampledTokens()
        self.done_reply = agent.format([], done=True)
        self._seed = None if runtime.seed is None else zlib.crc32(f"{runtime.seed}/{task.name}/{run}".encode())

    def act(self, messages: list[dict[str, str]]) -> str:
        r, s = self.runtime, self.sampled
        if not s.tokens:
            s.tokens = r.renderer.initial_tokens(messages[0]["content"])
        else:
            s.tokens = s.tokens + r.renderer.continuation_tokens(messages[-1]["content"], s.turns[-1].tokens)
        if len(s.tokens) + r.params.max_tokens > r.max_context_tokens:
            return self.done_reply  # out of context: end the episode rather than truncate what the model saw
        from tinker import types

        params = r.params if self._seed is None else r.params.model_copy(update={"seed": self._seed + len(s.turns)})
        start = time.perf_counter()
        if r.queue is not None:
            from tbexp.backends.batch_sampling import Request

            sequence = r.queue.submit(Request(s.tokens, params))
        else:
            with r.lock:
                sequence = r.sampler.sample(types.ModelInput.from_ints(s.tokens), 1, params).result()[0]
        s.sample_s += time.perf_counter() - start
        s.turns.append(SampledTurn(len(s.tokens), list(sequence.tokens), list(sequence.logprobs)))
        s.tokens = s.tokens + list(sequence.tokens)
        return r.renderer.decode_reply(sequence.tokens)


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


def make_policy(
    name: str, task: Task, agent: Agent, runtime: ModelRuntime | None = None, run: int = 0
) -> EpisodePolicy:
    if name == "model":
        if runtime is None:
            raise PolicyError("policy=model needs a sampler: the stage builds it from backend= and model=")
        return ModelPolicy(task, agent, runtime, run)
    if name not in POLICIES:
        raise PolicyError(f"policy={name!r}: choose one of {sorted(POLICIES)} or model")
    return POLICIES[name](task, agent)
