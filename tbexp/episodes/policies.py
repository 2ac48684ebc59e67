"""Policies that need no model, for checking tasks, sandboxes and the eval stage.

A policy answers the conversation so far with one reply in the agent's
protocol. `oracle` replays the task's `solution/solve.sh`: one line per
turn when the script is a plain list of one-line commands (the built-in
tasks are written that way, so their solutions double as agent turns), or
else a single turn that runs the uploaded script; with a pane agent
(terminus_2), whose keystrokes do not wait for their command, it then types
a marker and waits, turn by turn, until the marker's output shows. `nop` declares the task
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


SETTLE_COMMAND, SETTLE_OUTPUT = "echo tbexp-oracle-$((40 + 2))", "tbexp-oracle-42"
SETTLE_WAIT_S, MAX_SETTLE_WAIT_S = 1.0, 60.0  # the first waiting turn's wait, doubling up to Harbor's cap


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
        # A pane agent (terminus_2) types keys and waits a fixed time, not for the command: before saying done,
        # the oracle types a marker and waits until its output shows (the typed line shows the unexpanded form).
        self.settle = getattr(agent, "settle_reply", None)
        if self.settle:
            self.replies.append(agent.format([SETTLE_COMMAND], done=False))
        self.settled, self.waits = not self.settle, 0

    def act(self, messages: list[dict[str, str]]) -> str:
        if self.replies:
            return self.replies.pop(0)
        if not self.settled and SETTLE_OUTPUT not in messages[-1]["content"]:
            self.waits += 1  # 1, 2, 4, ... s: a long solution is waited for within a few turns
            return self.settle(min(SETTLE_WAIT_S * 2 ** (self.waits - 1), MAX_SETTLE_WAIT_S))
        self.settled = True
        return self.done_reply


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
    renderer: Any  # tbexp.models.renderers.Renderer
    params: Any  # tinker.types.SamplingParams
    max_context_tokens: int = 2048
    seed: int | None = (
        None  # set: each reply's seed is a function of (seed, task, run, turn), so thread order does not matter
    )
    # Held while a request is submitted, never while its reply is awaited: a sampler that works in the caller's thread
    # (the local one) still samples one reply at a time, as the CPU is shared anyway, while a remote one (Tinker's
    # SamplingClient.sample returns a future at once) gets every concurrent episode's request in flight together.
    lock: threading.Lock = field(default_factory=threading.Lock)
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


def sampled_sequences(episode: Any) -> list[SampledTokens]:
    """Every token sequence the model sampled in an episode: one per step of a multi-step task, else its one."""
    steps = getattr(episode, "step_sampled", None)
    if steps:
        return list(steps)
    return [episode.sampled] if getattr(episode, "sampled", None) is not None else []


class ModelPolicy:
    def __init__(self, task: Task, agent: Agent, runtime: ModelRuntime, run: int = 0):
        self.uploads: dict[Path, str] = {}
        self.runtime = runtime
        self.sampled = SampledTokens()
        self.done_reply = agent.format([], done=True)
        self.out_of_context = False
        self._seed = None if runtime.seed is None else zlib.crc32(f"{runtime.seed}/{task.name}/{run}".encode())

    def act(self, messages: list[dict[str, str]]) -> str:
        r, s = self.runtime, self.sampled
        if not s.tokens:
            s.tokens = r.renderer.initial_tokens(messages[0]["content"])
        else:
            s.tokens = s.tokens + r.renderer.continuation_tokens(messages[-1]["content"], s.turns[-1].tokens)
        if len(s.tokens) + r.params.max_tokens > r.max_context_tokens:
            self.out_of_context = True  # a session that stops_out_of_context ends here, the reply unused
            return self.done_reply  # out of context: end the episode rather than truncate what the model saw
        params = r.params if self._seed is None else r.params.model_copy(update={"seed": self._seed + len(s.turns)})
        start = time.perf_counter()
        sequence = sample_reply(r, s.tokens, params)
        s.sample_s += time.perf_counter() - start
        s.turns.append(SampledTurn(len(s.tokens), list(sequence.tokens), list(sequence.logprobs)))
        s.tokens = s.tokens + list(sequence.tokens)
        return r.renderer.decode_reply(sequence.tokens)


def sample_reply(runtime: ModelRuntime, tokens: list[int], params: Any) -> Any:
    """One reply to `tokens`: through the runtime's batch queue when it has one, else submitted under the lock and
    awaited outside it (ModelRuntime.lock says why)."""
    if runtime.queue is not None:
        from tbexp.backends.batch_sampling import Request

        return runtime.queue.submit(Request(tokens, params))
    from tinker import types

    with runtime.lock:
        reply = runtime.sampler.sample(types.ModelInput.from_ints(tokens), 1, params)
    return reply.result()[0]


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
    if name == "teacher":
        from tbexp.episodes.teacher import TeacherClient, TeacherPolicy

        if not isinstance(runtime, TeacherClient):
            raise PolicyError(
                "policy=teacher needs a teacher client: the collect stage builds it from collect.teacher_*"
            )
        return TeacherPolicy(task, agent, runtime, run)
    if name == "model":
        if runtime is None:
            raise PolicyError("policy=model needs a sampler: the stage builds it from backend= and model=")
        return ModelPolicy(task, agent, runtime, run)
    if name not in POLICIES:
        raise PolicyError(f"policy={name!r}: choose one of {sorted(POLICIES)}, model or teacher")
    return POLICIES[name](task, agent)
