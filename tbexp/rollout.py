"""Episodes: one policy, one task, one fresh sandbox, then the verifier.

`run_episode` is the whole life of a sandbox: start → agent turns until the
agent is done or `max_turns` → tests → stop. It never raises: a broken
sandbox or verifier makes the episode *invalid* (with the reason), which
callers drop instead of scoring 0; whatever the agent's commands do only
shapes the test results. `run_episodes` runs many at once on threads (the
work happens in sandbox processes, so threads suffice) with a progress bar.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from tbexp.agents.base import Agent, ShellSession, Turn
from tbexp.policies import SampledTokens
from tbexp.sandboxes.base import SandboxError, make_sandbox
from tbexp.tasks.harbor_task import Task
from tbexp.verifier import TestReport, VerifierError, verify

PolicyFactory = Callable[[Task, Agent], Any]


@dataclass
class Episode:
    task: Task
    run: int  # which attempt at this task (0-based)
    turns: list[Turn] = field(default_factory=list)
    report: TestReport | None = None
    invalid: str = ""  # why the episode cannot be scored; "" when it can
    time_s: dict[str, float] = field(default_factory=dict)  # start, agent, verify, stop
    messages: list[dict[str, str]] = field(default_factory=list)
    sampled: SampledTokens | None = None  # policy=model: the tokens as sampled, with their logprobs (training reads them)

    @property
    def n_commands(self) -> int:
        return sum(t.n_commands for t in self.turns)

    @property
    def n_valid_commands(self) -> int:
        return sum(t.n_valid for t in self.turns)


def run_episode(task: Task, run: int, agent: Agent, policy_factory: PolicyFactory, sandbox_settings: Any, max_turns: int) -> Episode:
    episode = Episode(task, run)
    clock = time.perf_counter()
    sandbox = make_sandbox(sandbox_settings, task)
    try:
        policy = policy_factory(task, agent)
        episode.sampled = getattr(policy, "sampled", None)  # the model policy fills it in as it acts
        sandbox.start()
        clock = _lap(episode, "start", clock)
        for local, remote in policy.uploads.items():
            sandbox.upload(local, remote)
        _agent_loop(episode, agent, policy, ShellSession(sandbox, sandbox.workdir), max_turns)
        clock = _lap(episode, "agent", clock)
        episode.report = verify(sandbox, task)
        clock = _lap(episode, "verify", clock)
    except (SandboxError, VerifierError, OSError) as err:
        episode.invalid = f"{type(err).__name__}: {err}"
    except Exception as err:  # anything else is a bug, but one episode's bug must not end a run of hundreds
        episode.invalid = f"unexpected {type(err).__name__}: {err}\n{traceback.format_exc()}"
    finally:
        try:
            sandbox.stop()
        except Exception as err:  # a sandbox that cannot be stopped must not take the run down with it
            episode.invalid = episode.invalid or f"stop failed: {err}"
        _lap(episode, "stop", clock)
    return episode


def _agent_loop(episode: Episode, agent: Agent, policy: Any, shell: ShellSession, max_turns: int) -> None:
    episode.messages = [{"role": "user", "content": agent.prompt(episode.task)}]
    deadline = time.monotonic() + episode.task.agent_timeout_s
    for _ in range(max_turns):
        reply = policy.act(episode.messages)
        episode.messages.append({"role": "assistant", "content": reply})
        turn = Turn(reply, agent.parse(reply, episode.turns))
        timeouts = turn.action.timeouts_s or [None] * len(turn.action.commands)
        for command, timeout_s in zip(turn.action.commands, timeouts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            limit = min(left, max(timeout_s or 0.0, shell.sandbox.settings.command_timeout_s))
            turn.results.append(shell.run(command, limit))
        episode.turns.append(turn)
        if turn.action.done or time.monotonic() >= deadline:
            return  # an agent time-out is still graded, as in Harbor
        episode.messages.append({"role": "user", "content": agent.observe(turn)})


def _lap(episode: Episode, phase: str, since: float) -> float:
    now = time.perf_counter()
    episode.time_s[phase] = now - since
    return now


def run_episodes(jobs: Iterable[tuple[Task, int]], concurrency: int, run_one: Callable[[Task, int], Episode], on_done: Callable[[Episode], None] | None = None, desc: str = "episodes") -> list[Episode]:
    """Run `run_one(task, run)` for every job, `concurrency` at a time, with a progress bar."""
    import sys

    from tqdm import tqdm

    jobs = list(jobs)
    episodes: list[Episode] = []
    refresh_s = 0.2 if sys.stderr.isatty() else 15.0  # a log file gets a line every 15 s, not every episode
    with ThreadPoolExecutor(max_workers=concurrency) as pool, tqdm(total=len(jobs), desc=desc, unit="ep", dynamic_ncols=True, mininterval=refresh_s) as bar:
        futures = [pool.submit(run_one, task, run) for task, run in jobs]
        for future in as_completed(futures):
            episode = future.result()
            episodes.append(episode)
            if on_done:
                on_done(episode)
            bar.update(1)
            if episode.invalid:
                bar.write(f"invalid episode {episode.task.name} run {episode.run}: {episode.invalid.splitlines()[0]}")
    return episodes
