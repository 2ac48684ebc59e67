"""Episodes through Harbor's own trials: Harbor's agent, Harbor's verifier, tbexp's (or Harbor's) environments.

`run_trials` runs one Harbor `Trial` per (task, run), `concurrency` at a time,
and turns each `TrialResult` into a tbexp `Episode`, so the eval stage scores
them with the same `tbexp.episodes.scoring` as its native episodes:

* the agent: `policy=model` runs `harbor.agent`; by default the one that speaks
  the job's `agent=` protocol: Harbor's terminus-2 for the terminus agents (as
  `tbexp.episodes.harbor_llm.TbexpTerminus2`, rollout details on), tbexp's
  raw_command as a Harbor agent (`tbexp.episodes.harbor_command_agent`) for
  `agent=raw_command`, both sampling from the job's backend; `policy=oracle` /
  `nop` run Harbor's own `oracle` and `nop` agents.
* the environment: `harbor.environment=""` is tbexp's own sandbox as a Harbor
  environment (`tbexp.sandboxes.harbor_env`, `sandbox=bwrap|docker`); any other
  value is a Harbor environment type (daytona, modal, e2b, ...), whose own
  preflight (account, API key) runs before any trial, a failure being a
  `HarborSetupError` that names the setting.
* the verdict: an episode is invalid when Harbor says its reward is not valid
  (an environment, set-up or verifier failure; the reason is the trial's
  exception, or "no verifier result"); an agent time-out or an agent error
  Harbor still grades is scored, as in Harbor. The test report is read from the
  trial's downloaded `verifier/` directory by tbexp's own reader (the reward file,
  per-test results by tbexp.episodes.test_results' sources), else Harbor's rewards alone.
  The episode's tamper record is what tbexp's environment found before the verifier
  (tbexp.sandboxes.harbor_env), read from the trial's folder.
* the turns: the command agent's own, with their exit statuses, as in the
  native eval; terminus-2's are one per LLM call, each reply parsed by Harbor's
  own terminus parser; a reply that parses has its keystrokes counted as valid
  commands (the tmux pane reports no exit status, so "valid" here means "parsed
  and sent to the pane"); one that does not counts as one invalid attempt.
* the tokens: the first rollout detail (the main agent's chat), when its turns
  are one linear conversation, becomes `Episode.sampled` (prompt tokens, the
  sampled tokens at their offsets, their logprobs), which training reads
  (`grpo.harness=harbor`); otherwise `Episode.sampled` holds no turns and the
  episode is not trained on.

Simplified: Harbor's oracle runs `solve.sh` as one step, so its episodes have
no turns (avg_turns 0); multi-step tasks run as Harbor runs them, with their
steps' tokens not kept.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # harbor imports litellm, which goes online otherwise

from harbor.models.trial.config import AgentConfig, EnvironmentConfig, TaskConfig, TrialConfig  # noqa: E402
from harbor.models.trial.paths import TrialPaths  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from tbexp.agents.base import Action, Turn  # noqa: E402
from tbexp.episodes import harbor_command_agent, harbor_llm  # noqa: E402
from tbexp.episodes.policies import SampledTokens, SampledTurn  # noqa: E402
from tbexp.episodes.rollout import Episode  # noqa: E402
from tbexp.episodes.test_results import read_guard  # noqa: E402
from tbexp.episodes.verifier import TestReport, VerifierError, read_results  # noqa: E402
from tbexp.errors import TbexpError  # noqa: E402
from tbexp.sandboxes.base import ExecResult  # noqa: E402

TBEXP_ENVIRONMENTS = {
    "bwrap": "tbexp.sandboxes.harbor_env:BwrapEnvironment",
    "docker": "tbexp.sandboxes.harbor_env:DockerEnvironment",
}
TERMINUS_2 = "terminus-2"
SENT_TO_PANE = ExecResult("(sent to the tmux pane; its exit status is not observed)", 0)


class HarborSetupError(TbexpError, RuntimeError):
    """The Harbor harness cannot run with these settings (an unknown environment, a missing account or key)."""


def environment_config(cfg: Any) -> EnvironmentConfig:
    """The Harbor environment every trial runs in, checked (preflight) before any trial starts."""
    from harbor.environments.factory import EnvironmentFactory

    h = cfg.harbor
    extra = OmegaConf.to_container(h.environment_kwargs, resolve=True) or {}
    if not h.environment:
        if cfg.sandbox.name not in TBEXP_ENVIRONMENTS:
            raise HarborSetupError(
                f"sandbox.name={cfg.sandbox.name!r}: the Harbor harness runs tbexp's {' or '.join(TBEXP_ENVIRONMENTS)}"
                " sandboxes, or set harbor.environment to a Harbor environment type"
            )
        sandbox = {
            k: v for k, v in OmegaConf.to_container(cfg.sandbox, resolve=True).items() if k not in ("_target_", "name")
        }
        return EnvironmentConfig(import_path=TBEXP_ENVIRONMENTS[cfg.sandbox.name], kwargs={"sandbox": sandbox, **extra})
    names = EnvironmentFactory.registered_names()
    if h.environment not in names:
        raise HarborSetupError(f"harbor.environment={h.environment!r}: not a Harbor environment; choose one of {names}")
    config = EnvironmentConfig(type=h.environment, kwargs=extra)
    try:
        EnvironmentFactory.run_preflight(config.type, kwargs=extra)
    except (SystemExit, ImportError, ValueError) as err:  # Harbor exits when an account or key is missing
        raise HarborSetupError(f"harbor.environment={h.environment}: {err}") from err
    return config


def harbor_agent(cfg: Any) -> str:
    """`harbor.agent`, where "" follows `agent=`: Harbor's terminus-2 for the terminus protocols, tbexp's command
    agent (`harbor_command_agent.TbexpCommandAgent`) for raw_command.

    >>> from types import SimpleNamespace as N
    >>> harbor_agent(N(harbor=N(agent=""), agent=N(name="raw_command")))
    'tbexp-command'
    >>> harbor_agent(N(harbor=N(agent=""), agent=N(name="terminus_2")))
    'terminus-2'
    """
    if cfg.harbor.agent == harbor_command_agent.NAME and cfg.agent.name == "terminus_2":
        raise HarborSetupError(
            "harbor.agent=tbexp-command plays a command protocol; agent=terminus_2 in Harbor's trials is Harbor's "
            "own terminus-2: leave harbor.agent unset (or set it to terminus-2)"
        )
    if cfg.harbor.agent:
        return cfg.harbor.agent
    return harbor_command_agent.NAME if cfg.agent.name == "raw_command" else TERMINUS_2


def agent_config(cfg: Any, policy: str, policy_key: str, trial_key: str, seed: int | None, task: Any) -> AgentConfig:
    """Harbor's agent for one trial: terminus-2 or tbexp's command agent over tbexp's sampler, or the agent named."""
    if policy in ("oracle", "nop"):
        return AgentConfig(name=policy)
    h = cfg.harbor
    kwargs = OmegaConf.to_container(h.agent_kwargs, resolve=True) or {}
    name = harbor_agent(cfg)
    served = {"tbexp_policy": policy_key, "tbexp_trial": trial_key, "tbexp_seed": seed}
    if name == harbor_command_agent.NAME:
        kwargs = {
            **kwargs,
            "tbexp_agent": OmegaConf.to_container(cfg.agent, resolve=True),
            "tbexp_workdir": task.workdir,
            "tbexp_command_timeout_s": cfg.sandbox.command_timeout_s,
            **served,
        }
        import_path = f"{harbor_command_agent.__name__}:{harbor_command_agent.TbexpCommandAgent.__name__}"
        return AgentConfig(import_path=import_path, model_name=f"tbexp/{cfg.model.name}", kwargs=kwargs)
    if name != TERMINUS_2:  # any other Harbor agent brings its own model connection
        return AgentConfig(name=name, kwargs=kwargs)
    kwargs = {
        "max_turns": cfg.agent.max_turns,
        "enable_summarize": h.summarize,
        "collect_rollout_details": True,
        "record_terminal_session": False,  # asciinema is not in the sandbox images, and nothing reads the recording
        "suppress_max_turns_warning": True,
        **kwargs,
        **served,
    }
    return AgentConfig(
        import_path=f"{harbor_llm.__name__}:TbexpTerminus2", model_name=f"tbexp/{cfg.model.name}", kwargs=kwargs
    )


def run_trials(
    cfg: Any, tasks: list, n_runs: int, concurrency: int, policy: str, runtime: Any, trials_dir: Path, desc: str
) -> list[Episode]:
    """`n_runs` Harbor trials of every task, `concurrency` at a time, as tbexp episodes."""
    environment = environment_config(cfg)
    if policy == "model" and runtime is None:
        raise HarborSetupError("policy=model needs a sampler: the stage builds it from backend= and model=")
    policy_key = harbor_llm.serve(runtime) if runtime is not None else ""
    jobs = [(task, run) for run in range(n_runs) for task in tasks]
    # Harbor logs every trial step at DEBUG through the root logger, which would bury the job's own log.
    harbor_log = logging.getLogger("harbor.utils.logger")
    level = harbor_log.level
    harbor_log.setLevel(logging.INFO)
    try:
        results = asyncio.run(
            _run_all(cfg, jobs, concurrency, policy, policy_key, runtime, environment, trials_dir, desc)
        )
    finally:
        harbor_log.setLevel(level)
        harbor_llm.withdraw(policy_key)
    parser = _parser(cfg)
    return [
        to_episode(task, run, result, harbor_llm.conversation(_trial_name(task, run)), parser)
        for (task, run), result in zip(jobs, results)
    ]


async def _run_all(cfg, jobs, concurrency, policy, policy_key, runtime, environment, trials_dir, desc) -> list[Any]:
    from harbor.trial.trial import Trial
    from tqdm import tqdm

    gate = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(jobs), desc=desc, unit="ep", dynamic_ncols=True)

    async def one(task, run):
        name = _trial_name(task, run)
        seed = harbor_llm.episode_seed(runtime.seed if runtime is not None else None, task.name, run)
        config = TrialConfig(
            task=TaskConfig(path=task.path),
            trial_name=name,
            trials_dir=trials_dir,
            agent=agent_config(cfg, policy, policy_key, name, seed, task),
            environment=environment,
        )
        async with gate:
            try:
                trial = await Trial.create(config)
                return await trial.run()
            except Exception as err:  # a trial Harbor could not even set up: that episode is invalid, not the run
                return err
            finally:
                bar.update(1)

    try:
        return await asyncio.gather(*(one(task, run) for task, run in jobs))
    finally:
        bar.close()


def _trial_name(task: Any, run: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', task.name)}__run{run}"


def _parser(cfg: Any) -> Any:
    kwargs = cfg.harbor.agent_kwargs or {}
    if kwargs.get("parser_name", "json") == "xml":
        from harbor.agents.terminus_2.terminus_xml_plain_parser import TerminusXMLPlainParser

        return TerminusXMLPlainParser()
    from harbor.agents.terminus_2.terminus_json_plain_parser import TerminusJSONPlainParser

    return TerminusJSONPlainParser()


def to_episode(task: Any, run: int, result: Any, conversation: Any, parser: Any) -> Episode:
    """One TrialResult (or the exception that stopped the trial) as a tbexp episode."""
    episode = Episode(task, run)
    if isinstance(result, BaseException):
        episode.invalid = f"HarborTrialError: {type(result).__name__}: {result}"
        return episode
    if conversation is not None:
        episode.messages = conversation.messages
        # A command agent's turns carry their exit statuses; terminus-2's are its replies, parsed as Harbor parses them.
        episode.turns = conversation.turns or [_turn(text, parser) for text in conversation.texts]
    episode.time_s = _phases(result)
    _read_integrity(episode, result)
    if not result.reward_valid:
        info = result.exception_info
        why = f"{info.exception_type}: {info.exception_message}" if info else "the verifier gave no reward"
        episode.invalid = f"Harbor: {why}"
        return episode
    episode.report = _report(result)
    details = result.agent_result.rollout_details if result.agent_result else None
    # Not one linear conversation (or no model at all): nothing to train on, but the sampling time still counts.
    episode.sampled = (sampled_tokens(details[0]) if details else None) or SampledTokens()
    episode.sampled.sample_s = conversation.sample_s if conversation is not None else 0.0
    return episode


def _read_integrity(episode: Episode, result: Any) -> None:
    """What tbexp's environment found before Harbor's verifier ran (harbor_env.INTEGRITY_FILE), and the imports
    its start-up refused during the tests; neither is there on a Harbor environment that is not tbexp's."""
    trial = Path(result.config.trials_dir) / result.trial_name
    path = trial / "tbexp-integrity.json"
    if path.is_file():
        record = json.loads(path.read_text())
        episode.integrity.add(*record.get("tamper", []))
        episode.integrity.set_aside += record.get("set_aside", [])
        episode.integrity.left_processes += record.get("left_processes", [])
    for refused in read_guard(TrialPaths(trial).verifier_dir):
        episode.integrity.add(f"module planted in place of {refused.get('module')}: {refused.get('path')}")


def _report(result: Any) -> TestReport:
    verifier_dir = TrialPaths(Path(result.config.trials_dir) / result.trial_name).verifier_dir
    try:
        return read_results(verifier_dir, result.task_name)
    except (VerifierError, OSError):  # nothing tbexp can read there: Harbor's rewards are the verdict
        return TestReport(rewards=dict(result.verifier_result.rewards))


def _turn(text: str, parser: Any) -> Turn:
    parsed = parser.parse_response(text)
    action = Action(
        commands=[c.keystrokes for c in parsed.commands],
        done=parsed.is_task_complete,
        error=parsed.error,
        timeouts_s=[c.duration for c in parsed.commands],
    )
    return Turn(text, action, [] if parsed.error else [SENT_TO_PANE] * len(parsed.commands))


def _phases(result: Any) -> dict[str, float]:
    phases = {"start": result.environment_setup, "agent": result.agent_execution, "verify": result.verifier}
    return {
        name: (t.finished_at - t.started_at).total_seconds()
        for name, t in phases.items()
        if t is not None and t.started_at and t.finished_at
    }


def sampled_tokens(detail: dict[str, Any]) -> SampledTokens | None:
    """A rollout detail's turns as one conversation's tokens, or None when they do not extend each other.

    >>> s = sampled_tokens({"prompt_token_ids": [[1, 2], [1, 2, 7, 3]], "completion_token_ids": [[7], [8, 9]],
    ...                     "logprobs": [[-0.1], [-0.2, -0.3]]})
    >>> s.tokens, [(t.offset, t.tokens) for t in s.turns]
    ([1, 2, 7, 3, 8, 9], [(2, [7]), (4, [8, 9])])
    """
    prompts = detail.get("prompt_token_ids") or []
    replies = detail.get("completion_token_ids") or []
    logprobs = detail.get("logprobs") or []
    if not prompts or len(prompts) != len(replies) or len(logprobs) != len(replies):
        return None
    sampled = SampledTokens()
    for prompt, reply, lp in zip(prompts, replies, logprobs):
        if prompt[: len(sampled.tokens)] != sampled.tokens:
            return None  # Harbor rewrote the history (summarization): not one sequence to train on
        sampled.turns.append(SampledTurn(len(prompt), list(reply), list(lp)))
        sampled.tokens = list(prompt) + list(reply)
    return sampled
