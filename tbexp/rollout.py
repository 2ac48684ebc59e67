"""Episodes: one policy, one task, one fresh sandbox, then the verifier.

`run_episode` is the whole life of a sandbox: start → agent turns until the
agent is done or `max_turns` → tests → stop. It never raises. Its verdict
follows `tbexp.verdicts`: a sandbox or verifier that fails for reasons the
agent cannot cause makes the episode *invalid* (with the reason), which
callers drop instead of scoring 0; damage the agent's own commands do to its
sandbox is the agent's failure, so that episode is scored (0 where the
verifier could check nothing) with `damage` saying what broke.
`run_episodes` runs many at once on threads (the work happens in sandbox
processes, so threads suffice) with a progress bar.
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
from tbexp.verdicts import INFRA_ERRORS, NO_RESULT, judge, second_look
from tbexp.verifier import TestReport, VerifierError, verify

PolicyFactory = Callable[[Task, Agent], Any]


@dataclass
class Episode:
    task: Task
    run: int  # which attempt at this task (0-based)
    turns: list[Turn] = field(default_factory=list)
    report: TestReport | None = None
    invalid: str = ""  # why the episode cannot be scored; "" when it can
    damage: str = ""  # what the agent's commands broke (the episode is still scored); "" when nothing
    time_s: dict[str, float] = field(default_factory=dict)  # start, agent, verify, stop
    messages: list[dict[str, str]] = field(default_factory=list)
    sampled: SampledTokens | None = (
        None  # policy=model: the tokens as sampled, with their logprobs (training reads them)
    )
    step_reports: dict[str, TestReport] = field(default_factory=dict)  # a multi-step task's tests, step by step

    @property
    def n_commands(self) -> int:
        return sum(t.n_commands for t in self.turns)

    @property
    def n_valid_commands(self) -> int:
        return sum(t.n_valid for t in self.turns)


def run_episode(
    task: Task, run: int, agent: Agent, policy_factory: PolicyFactory, sandbox_settings: Any, max_turns: int
) -> Episode:
    episode = Episode(task, run)
    clock = time.perf_counter()
    sandbox = make_sandbox(sandbox_settings, task)
    failure = health = ""  # a verifier that gave no result after the agent acted, and the sandbox's state then
    try:
        if len(task.steps) > 1:
            sandbox.start()
            clock = _lap(episode, "start", clock)
            clock = _run_steps(episode, agent, policy_factory, sandbox, max_turns, clock)
        else:
            policy = policy_factory(task, agent)
            episode.sampled = getattr(policy, "sampled", None)  # the model policy fills it in as it acts
            sandbox.start()
            clock = _lap(episode, "start", clock)
            for local, remote in policy.uploads.items():
                sandbox.upload(local, remote)
            _agent_loop(episode, agent, policy, ShellSession(sandbox, sandbox.workdir), max_turns)
            clock = _lap(episode, "agent", clock)
            try:
                episode.report = verify(sandbox, task)
            except INFRA_ERRORS as err:
                if not _agent_acted(episode):
                    raise  # the agent ran nothing: the failure cannot be its
                episode.report, failure, health = second_look(sandbox, task, err)
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
    if failure and not episode.invalid:  # after the stop: the control sandbox must not share this one's resources
        episode.invalid, damage = judge(failure, health, task, sandbox_settings)
        episode.damage = "; ".join(d for d in (episode.damage, damage) if d)
        episode.report = None if episode.invalid else NO_RESULT
    return episode


def _agent_acted(episode: Episode) -> bool:
    """The agent ran at least one command (one that broke the sandbox counts)."""
    return bool(episode.damage) or any(turn.results for turn in episode.turns)


def _agent_loop(
    episode: Episode, agent: Agent, policy: Any, shell: ShellSession, max_turns: int, task: Task | None = None
) -> None:
    """The agent's turns on `task` (a step of a multi-step task; default: the episode's) until done or out of time."""
    task = task or episode.task
    episode.messages = [{"role": "user", "content": agent.prompt(task)}]
    deadline = time.monotonic() + task.agent_timeout_s
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
            try:
                turn.results.append(shell.run(command, limit))
            except (SandboxError, OSError) as err:  # the agent's command broke its sandbox: its failure, still scored
                episode.turns.append(turn)
                episode.damage = f"a command broke the sandbox: {type(err).__name__}: {err}"
                return
        episode.turns.append(turn)
        if turn.action.done or time.monotonic() >= deadline:
            return  # an agent time-out is still graded, as in Harbor
        episode.messages.append({"role": "user", "content": agent.observe(turn)})


def _run_steps(
    episode: Episode, agent: Agent, policy_factory: PolicyFactory, sandbox: Any, max_turns: int, clock: float
) -> float:
    """A multi-step task's steps in order in one sandbox, as Harbor's MultiStepTrial runs them.

    Each step: its `workdir/` is copied into the working directory and its `setup.sh` run; the agent starts a
    fresh conversation on the step's instruction (a new policy, so the oracle plays that step's solution) with
    the step's turn budget and time-out, in the same shell; then the step's tests (the task's tests/, the
    step's own over them) run and are cleared before the next step. A step below its `min_reward` ends the
    episode. The report is Harbor's trial reward: per-key means over the steps (or the last step's, with
    `multi_step_reward_strategy = "final"`), and every step's tests, named `step::test`.
    Simplified: a model policy's sampled tokens are kept for the last step only (`episode.sampled`).
    """
    task, messages, shell = episode.task, [], ShellSession(sandbox, sandbox.workdir)
    spent_s = {"agent": 0.0, "verify": 0.0}  # summed over the steps
    for step in task.steps:
        step_task = task.for_step(step)
        _prepare_step(sandbox, step)
        policy = policy_factory(step_task, agent)
        episode.sampled = getattr(policy, "sampled", None)
        for local, remote in policy.uploads.items():
            sandbox.upload(local, remote)
        _agent_loop(episode, agent, policy, shell, max_turns, step_task)
        messages += episode.messages
        clock = _lap(episode, "agent", clock)
        spent_s["agent"] += episode.time_s["agent"]
        # the task's shared tests/ first, the step's own over them
        report = episode.step_reports[step.name] = verify(sandbox, step_task, shared_tests=step.tests_dirs[:-1])
        sandbox.exec("rm -rf /tests/* /tests/.[!.]* /logs/verifier", timeout_s=30)  # the next step must not see them
        clock = _lap(episode, "verify", clock)
        spent_s["verify"] += episode.time_s["verify"]
        if _below(report.rewards, step.min_reward):
            break
    episode.messages = messages
    episode.time_s.update(spent_s)
    episode.report = _combine_steps(episode.step_reports, task)
    return clock


def _prepare_step(sandbox: Any, step: Any) -> None:
    if step.workdir_dir:
        sandbox.upload(step.workdir_dir, sandbox.workdir)
    if step.setup_script:
        setup = sandbox.exec("bash ./setup.sh", timeout_s=step.agent_timeout_s)
        if setup.exit_code != 0:  # the task's own set-up failing is not the agent's doing
            raise SandboxError(f"step {step.name!r}: setup.sh exited {setup.exit_code}: {setup.output[-500:]}")


def _below(rewards: dict[str, float], min_reward: float | dict[str, float] | None) -> bool:
    """Harbor's gate: a float gates the "reward" key, a dict each of its keys; a missing key is -inf."""
    if min_reward is None:
        return False
    thresholds = min_reward if isinstance(min_reward, dict) else {"reward": min_reward}
    return any(rewards.get(key, float("-inf")) < threshold for key, threshold in thresholds.items())


def _combine_steps(reports: dict[str, TestReport], task: Task) -> TestReport:
    strategy = getattr(task.harbor, "multi_step_reward_strategy", None)
    final = getattr(strategy, "value", strategy) == "final"  # Harbor's default (unset) is the mean
    chosen = dict(list(reports.items())[-1:]) if final else reports
    keys = {key for report in chosen.values() for key in report.rewards}
    rewards = {key: sum(r.rewards.get(key, 0.0) for r in chosen.values()) / len(chosen) for key in keys}  # missing = 0
    tests = {f"{name}::{test}": status for name, report in chosen.items() for test, status in report.tests.items()}
    return TestReport(tests=tests, rewards=rewards, log_tail=list(reports.values())[-1].log_tail)


def _lap(episode: Episode, phase: str, since: float) -> float:
    now = time.perf_counter()
    episode.time_s[phase] = now - since
    return now


def run_episodes(
    jobs: Iterable[tuple[Task, int]],
    concurrency: int,
    run_one: Callable[[Task, int], Episode],
    on_done: Callable[[Episode], None] | None = None,
    desc: str = "episodes",
) -> list[Episode]:
    """Run `run_one(task, run)` for every job, `concurrency` at a time, with a progress bar."""
    import sys

    from tqdm import tqdm

    jobs = list(jobs)
    episodes: list[Episode] = []
    refresh_s = 0.2 if sys.stderr.isatty() else 15.0  # a log file gets a line every 15 s, not every episode
    with (
        ThreadPoolExecutor(max_workers=concurrency) as pool,
        tqdm(total=len(jobs), desc=desc, unit="ep", dynamic_ncols=True, mininterval=refresh_s) as bar,
    ):
        futures = [pool.submit(run_one, task, run) for task, run in jobs]
        for future in as_completed(futures):
            episode = future.result()
            episodes.append(episode)
            if on_done:
                on_done(episode)
            bar.update(1)
            if episode.invalid:
                bar.write(f"invalid episode {episode.task.name} run {episode.run}: {episode.invalid.splitlines()[0]}")
            elif episode.damage:
                bar.write(
                    f"damaged episode {episode.task.name} run {episode.run} (scored): {episode.damage.splitlines()[0]}"
                )
    return episodes
