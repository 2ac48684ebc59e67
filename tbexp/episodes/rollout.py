"""Episodes: one policy, one task, one fresh sandbox, then the verifier.

`run_episode` is the whole life of a sandbox: start → agent turns until the
agent is done or `max_turns` → tests → stop. It never raises. Its verdict
follows `tbexp.episodes.verdicts`: a sandbox or verifier that fails for reasons the
agent cannot cause makes the episode *invalid* (with the reason), which
callers drop instead of scoring 0; damage the agent's own commands do to its
sandbox is the agent's failure, so that episode is scored (0 where the
verifier could check nothing) with `damage` saying what broke.
`run_episodes` runs many at once on threads (the work happens in sandbox
processes, so threads suffice) with a progress bar.

The agent's commands run as task.toml's `[agent] user`, test.sh as its `[verifier] user`
(`Sandbox.as_user`); a separate verifier runs in a sandbox of its own
(`tbexp.episodes.separate_verifier`). A task that asks for a network the
sandbox does not give it (an `allowlist`, which nothing here can enforce, or
`public` with `sandbox.allow_network=false`) runs offline, and `Episode.network`
says so, so such episodes can be counted and told apart.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tbexp.agents.base import Agent, AgentSession, Turn
from tbexp.episodes import integrity
from tbexp.episodes.integrity import Integrity
from tbexp.episodes.policies import SampledTokens, sampled_sequences
from tbexp.episodes.separate_verifier import CONVENTION_DIR, verify_task
from tbexp.episodes.verdicts import INFRA_ERRORS, NO_RESULT, judge, second_look
from tbexp.episodes.verifier import TestReport, VerifierError
from tbexp.sandboxes.base import SandboxError, make_sandbox
from tbexp.tasks.harbor_task import Task

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
        None  # policy=model: the tokens as sampled, with their logprobs; a multi-step task's: its last step's
    )
    step_reports: dict[str, TestReport] = field(default_factory=dict)  # a multi-step task's tests, step by step
    step_sampled: list[SampledTokens] = field(default_factory=list)  # policy=model: every step's tokens, in order
    network: str = ""  # "" = the sandbox had the network the task asked for; else what it asked and what it got
    environment: str = ""  # where the sandbox's environment came from (Sandbox.environment_source); "" = never started
    integrity: Integrity = field(default_factory=Integrity)  # what the agent left where the verifier reads
    verified_report: TestReport | None = None  # the verifier's report of an episode its tamper policy scored 0

    @property
    def tamper(self) -> list[str]:
        """What the agent touched that the verifier reads (tbexp.episodes.integrity); [] for none."""
        return self.integrity.tamper

    @property
    def sequences(self) -> list[SampledTokens]:
        """Every token sequence the model sampled in this episode (one per step), for training."""
        return sampled_sequences(self)

    @property
    def n_commands(self) -> int:
        return sum(t.n_commands for t in self.turns)

    @property
    def n_valid_commands(self) -> int:
        return sum(t.n_valid for t in self.turns)


def run_episode(
    task: Task,
    run: int,
    agent: Agent,
    policy_factory: PolicyFactory,
    sandbox_settings: Any,
    max_turns: int,
    isolation: str = "shared",
) -> Episode:
    """One episode; `isolation` (verifier.isolation): shared = the tests run in the agent's sandbox, hardened
    (tbexp.episodes.integrity); fresh = in a fresh sandbox of the task's environment with the agent's work copied in."""
    episode = Episode(task, run, network=network_note(task, sandbox_settings))
    clock = time.perf_counter()
    sandbox = make_sandbox(sandbox_settings, task)
    failure = health = ""  # a verifier that gave no result after the agent acted, and the sandbox's state then
    judged = task  # the task (or the step) whose verifier gave no result
    shared: tuple = ()  # the tests copied under it (a step's task-level tests)
    try:
        if len(task.steps) > 1:
            sandbox.start()
            clock = _lap(episode, "start", clock)
            clock, failure, health, judged, shared = _run_steps(
                episode, agent, policy_factory, sandbox, max_turns, clock, isolation
            )
        else:
            policy = policy_factory(task, agent)
            episode.sampled = getattr(policy, "sampled", None)  # the model policy fills it in as it acts
            sandbox.start()
            _start_phase(sandbox, task)
            clock = _lap(episode, "start", clock)
            for local, remote in policy.uploads.items():
                sandbox.upload(local, remote)
            sandbox.mark_agent_start()  # what runs and what changes from here on is the agent's
            with sandbox.as_user(task.agent_user):  # a terminal the session starts is the agent user's
                session = agent.open(sandbox)
            try:
                _agent_loop(episode, policy, session, max_turns)
            finally:
                session.close()
            clock = _lap(episode, "agent", clock)
            episode.report, failure, health = _verify(episode, sandbox, task, (), isolation)
            clock = _lap(episode, "verify", clock)
    except (SandboxError, VerifierError, OSError) as err:
        episode.invalid = f"{type(err).__name__}: {err}"
    except Exception as err:  # anything else is a bug, but one episode's bug must not end a run of hundreds
        episode.invalid = f"unexpected {type(err).__name__}: {err}\n{traceback.format_exc()}"
    finally:
        episode.environment = getattr(sandbox, "environment_source", "")  # which of docker_image / Dockerfile ran
        episode.integrity.merge(getattr(sandbox, "integrity", None))
        try:
            sandbox.stop()
        except Exception as err:  # a sandbox that cannot be stopped must not take the run down with it
            episode.invalid = episode.invalid or f"stop failed: {err}"
        _lap(episode, "stop", clock)
    if failure and not episode.invalid:  # after the stop: the control sandbox must not share this one's resources
        episode.invalid, damage = judge(failure, health, judged, sandbox_settings, shared)
        episode.damage = "; ".join(d for d in (episode.damage, damage) if d)
        episode.report = None if episode.invalid else NO_RESULT
    return episode


def network_note(task: Task, sandbox_settings: Any) -> str:
    """'' when the sandbox gives the task the network it asks for, else what it asked and what it ran with.

    >>> from pathlib import Path
    >>> class Node: allow_network = False
    >>> network_note(Task("x/t", Path("/t"), "", {}, network_mode="allowlist"), Node())
    'the task asks for network_mode "allowlist", which cannot be enforced here; it ran with no network'
    >>> network_note(Task("x/t", Path("/t"), "", {}, network_mode="no-network"), Node())
    ''
    """
    mode = task.network_mode
    if mode == "allowlist":
        hosts = getattr(task.harbor.environment, "allowed_hosts", None) if task.harbor is not None else None
        listed = f" ({', '.join(map(str, hosts))})" if hosts else ""
        cannot = "which cannot be enforced here; it ran with no network"
        return f'the task asks for network_mode "allowlist"{listed}, {cannot}'
    if mode == "public" and not getattr(sandbox_settings, "allow_network", False):
        said = {"network_mode", "allow_internet"} & set(task.config.get("environment", {}))
        default = "" if said else " (Harbor's default: task.toml names no network_mode)"
        return f'the task asks for network_mode "public"{default}; it ran with no network (sandbox.allow_network=false)'
    return ""


def _start_phase(sandbox: Any, task: Task) -> None:
    """What Harbor's environments have at start that a task's files may expect: /logs/artifacts, for a separate
    verifier (the agent publishes there), writable by the agent's user."""
    if task.separate_verifier is not None:
        with sandbox.as_user("root"):  # the image's USER may not own /logs
            sandbox.exec(f"mkdir -p {CONVENTION_DIR} && chmod 777 {CONVENTION_DIR}", timeout_s=30)


def _verify(
    episode: Episode, sandbox: Any, task: Task, shared_tests: tuple = (), isolation: str = "shared"
) -> tuple[TestReport | None, str, str]:
    """(report, failure, health): the task's tests; a failure after the agent acted gets the second look."""
    try:
        return verify_task(sandbox, task, shared_tests, isolation), "", ""
    except INFRA_ERRORS as err:
        if not _agent_acted(episode):
            raise  # the agent ran nothing: the failure cannot be its
        return second_look(sandbox, task, err, shared_tests, isolation)


def _agent_acted(episode: Episode) -> bool:
    """The agent ran at least one command (one that broke the sandbox counts)."""
    return bool(episode.damage) or any(turn.results for turn in episode.turns)


def _agent_loop(episode: Episode, policy: Any, session: AgentSession, max_turns: int, task: Task | None = None) -> None:
    """The agent's turns on `task` (a step of a multi-step task; default: the episode's) until done or out of time."""
    task = task or episode.task
    episode.messages = [{"role": "user", "content": session.begin(task)}]
    deadline = time.monotonic() + task.agent_timeout_s
    with session.sandbox.as_user(task.agent_user):  # task.toml's [agent] user
        _turns(episode, policy, session, max_turns, deadline)


def _turns(episode: Episode, policy: Any, session: AgentSession, max_turns: int, deadline: float) -> None:
    for _ in range(max_turns):
        if not session.alive():  # the terminal is gone (the agent ended its shell): graded as it stands
            return
        reply = policy.act(episode.messages)
        if session.stops_out_of_context and getattr(policy, "out_of_context", False):
            return
        episode.messages.append({"role": "assistant", "content": reply})
        outcome = session.step(reply, episode.turns, deadline)
        episode.turns.append(outcome.turn)
        if outcome.damage:
            episode.damage = outcome.damage
            return
        if outcome.observation is None or time.monotonic() >= deadline:
            return  # an agent time-out is still graded, as in Harbor
        episode.messages.append({"role": "user", "content": outcome.observation})


def _run_steps(
    episode: Episode,
    agent: Agent,
    policy_factory: PolicyFactory,
    sandbox: Any,
    max_turns: int,
    clock: float,
    isolation: str = "shared",
) -> tuple[float, str, str, Task, tuple]:
    """A multi-step task's steps in order in one sandbox, as Harbor's MultiStepTrial runs them.

    Each step: its `workdir/` is copied into the working directory and its `setup.sh` run; the agent starts a
    fresh conversation on the step's instruction (a new policy, so the oracle plays that step's solution) with
    the step's turn budget and time-out, in the same shell; then the step's tests (the task's tests/, the
    step's own over them) run and are cleared before the next step. A step below its `min_reward` ends the
    episode. The report is Harbor's trial reward: per-key means over the steps (or the last step's, with
    `multi_step_reward_strategy = "final"`), and every step's tests, named `step::test`. A model policy's
    tokens are kept for every step (`episode.step_sampled`: each step's conversation is its own sequence).
    A step whose verifier gives no result after the agent acted gets the same second look as a one-step task's;
    if it still gives none, the episode ends there and `run_episode` judges it: returned as (clock, failure,
    health, the step's task, its shared tests), failure '' when every step verified.
    """
    task, messages = episode.task, []
    with sandbox.as_user(task.agent_user):  # a terminal the session starts is the agent user's
        session = agent.open(sandbox)
    spent_s = {"agent": 0.0, "verify": 0.0}  # summed over the steps
    failure = health = ""
    step_task, shared = task, ()
    try:
        for step in task.steps:
            step_task, shared = (
                task.for_step(step),
                step.tests_dirs[:-1],
            )  # the task's shared tests/, the step's over them
            _prepare_step(sandbox, step)
            _start_phase(sandbox, step_task)
            policy = policy_factory(step_task, agent)
            episode.sampled = getattr(policy, "sampled", None)
            if episode.sampled is not None:
                episode.step_sampled.append(episode.sampled)
            for local, remote in policy.uploads.items():
                sandbox.upload(local, remote)
            sandbox.mark_agent_start()
            with sandbox.as_user(task.agent_user):  # a terminal the session starts is the agent user's
                session = agent.open(sandbox)
            _agent_loop(episode, policy, session, max_turns, step_task)
            session.close()
            session = None
            messages += episode.messages
            clock = _lap(episode, "agent", clock)
            spent_s["agent"] += episode.time_s["agent"]
            report, failure, health = _verify(episode, sandbox, step_task, shared, isolation)
            clock = _lap(episode, "verify", clock)
            spent_s["verify"] += episode.time_s["verify"]
            if report is None:
                break
            episode.step_reports[step.name] = report
            with sandbox.as_user("root"):
                sandbox.exec(
                    "rm -rf /tests/* /tests/.[!.]* /logs/verifier", timeout_s=30
                )  # the next step must not see them
            integrity.end(sandbox)
            if _below(report.rewards, step.min_reward):
                break
    finally:
        if session is not None:
            session.close()
    episode.messages = messages
    episode.time_s.update(spent_s)
    if not failure:
        episode.report = _combine_steps(episode.step_reports, task)
    return clock, failure, health, step_task, shared


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
    lockstep: Any = None,
) -> list[Episode]:
    """Run `run_one(task, run)` for every job on `min(concurrency, jobs)` threads, with a progress bar; the episodes
    in job order. Exactly that many threads take jobs until none is left, so `lockstep` (a BatchQueue the jobs
    sample through) can batch one request from each of them (batch_sampling.BatchQueue.lockstep); a job that
    raises is re-raised once every job has run."""
    import sys

    from tqdm import tqdm

    if concurrency < 1:  # no thread would take a job, and the caller would wait for ever
        raise ValueError(f"concurrency={concurrency}: at least one episode at a time")
    jobs = list(jobs)
    results: list[Any] = [None] * len(jobs)
    finished: queue.Queue = queue.Queue()  # (job index, raised) as each job ends
    pending = iter(range(len(jobs)))
    take = threading.Lock()

    def work() -> None:
        while True:
            with take:
                i = next(pending, None)
            if i is None:
                return
            try:
                results[i] = run_one(*jobs[i])
                finished.put((i, None))
            except BaseException as err:  # handed to the caller's thread, raised there
                finished.put((i, err))
            finally:
                if lockstep is not None:
                    lockstep.job_done()

    threads = [threading.Thread(target=work, name=f"{desc}-{n}") for n in range(min(concurrency, len(jobs)))]
    if lockstep is not None:
        lockstep.lockstep(len(threads), len(jobs))
    for thread in threads:
        thread.start()
    first_error = None
    refresh_s = 0.2 if sys.stderr.isatty() else 15.0  # a log file gets a line every 15 s, not every episode
    with tqdm(total=len(jobs), desc=desc, unit="ep", dynamic_ncols=True, mininterval=refresh_s) as bar:
        for _ in jobs:
            i, err = finished.get()
            if err is not None:
                first_error = first_error or err
                continue
            episode = results[i]
            if on_done:
                on_done(episode)
            bar.update(1)
            if episode.invalid:
                bar.write(f"invalid episode {episode.task.name} run {episode.run}: {episode.invalid.splitlines()[0]}")
            elif episode.damage:
                bar.write(
                    f"damaged episode {episode.task.name} run {episode.run} (scored): {episode.damage.splitlines()[0]}"
                )
    for thread in threads:
        thread.join()
    if first_error is not None:
        raise first_error
    return results  # job order, not the order they finished in
