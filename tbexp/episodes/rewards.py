"""Rewards: plain functions of test results.

Every reward scores a *group* of attempts at one task (an eval task's n runs,
or a GRPO group), because the efficiency bonus is relative to the group.
Invalid episodes (broken sandbox or verifier) are never passed in: callers
drop them first, so an infrastructure failure is not a score of 0. A damaged
episode (the agent broke its own sandbox) is passed in, with an empty report.

A task may write several named rewards (`reward.json`); every one is kept in
the report. `reward.task_reward` names the one a reward reads: where a task
reports no per-test results, `binary`, `per_test` and `per_test_efficiency`
fall back to it (default `reward`, what `reward.txt` is read as), and
`task_reward` scores it alone, whatever the tests say.

The `reward` config node chooses the function by `_target_` (as the sandbox
and the agent are chosen); its other fields but `name` are the function's
keyword arguments (`make_reward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tbexp.episodes.verifier import TestReport
from tbexp.errors import TbexpError


def binary(reports: Sequence[TestReport], turns: Sequence[int], task_reward: str = "reward") -> list[float]:
    """1 when every test passed, else 0.

    >>> from tbexp.episodes.verifier import TestReport
    >>> binary([TestReport({"a": "passed", "b": "failed"}), TestReport({"a": "passed"})], [3, 2])
    [0.0, 1.0]
    """
    return [1.0 if r.solved(task_reward) else 0.0 for r in reports]


def per_test(reports: Sequence[TestReport], turns: Sequence[int], task_reward: str = "reward") -> list[float]:
    """The fraction of the task's tests that pass.

    >>> from tbexp.episodes.verifier import TestReport
    >>> per_test([TestReport({"a": "passed", "b": "failed", "c": "passed", "d": "skipped"})], [1])
    [0.6666666666666666]
    """
    return [r.fraction(task_reward) for r in reports]


def per_test_efficiency(
    reports: Sequence[TestReport],
    turns: Sequence[int],
    tests_weight: float = 0.8,
    efficiency_weight: float = 0.2,
    task_reward: str = "reward",
) -> list[float]:
    """Per-test fraction plus a bonus for the faster successes of the group.

    Among the strict successes, the bonus falls linearly from 1 (fewest turns)
    to 0 (most turns); when all successes took as many turns, each gets 1.
    Failures get no bonus. The published recipe weights these 0.8 / 0.2.

    >>> from tbexp.episodes.verifier import TestReport
    >>> ok, half = TestReport({"a": "passed"}), TestReport({"a": "passed", "b": "failed"})
    >>> [round(x, 3) for x in per_test_efficiency([ok, ok, half], [2, 4, 1])]
    [1.0, 0.8, 0.4]
    """
    wins = [t for r, t in zip(reports, turns) if r.solved(task_reward)]
    fewest, most = (min(wins), max(wins)) if wins else (0, 0)
    scores = []
    for report, n_turns in zip(reports, turns):
        bonus = 0.0
        if report.solved(task_reward):
            bonus = 1.0 if most == fewest else (most - n_turns) / (most - fewest)
        scores.append(tests_weight * report.fraction(task_reward) + efficiency_weight * bonus)
    return scores


def task_reward(reports: Sequence[TestReport], turns: Sequence[int], task_reward: str = "reward") -> list[float]:
    """The task's own reward called `task_reward` (from reward.json or reward.txt), as written; 0 for a report with
    none.

    >>> from tbexp.episodes.verifier import TestReport
    >>> task_reward([TestReport({"a": "passed"}, {"reward": 1.0, "quality": 0.3}), TestReport()], [1, 1], "quality")
    [0.3, 0.0]
    """
    name = task_reward
    scores = []
    for report in reports:
        if report.rewards and name not in report.rewards:
            raise ValueError(f"reward.task_reward={name!r}: the task's reward file has only {sorted(report.rewards)}")
        scores.append(report.rewards.get(name, 0.0))
    return scores


Reward = Callable[[Sequence[TestReport], Sequence[int]], list[float]]  # one group's reports and turns -> scores


class RewardError(TbexpError, ValueError):
    """A `reward` node whose `_target_` is not a reward function."""


def make_reward(settings: Any) -> Reward:
    """The function `settings._target_` names, bound to the node's other fields (but `name`) as keyword arguments.

    >>> from types import SimpleNamespace
    >>> score = make_reward(SimpleNamespace(_target_="tbexp.episodes.rewards.binary", name="binary"))
    >>> score([TestReport({"a": "passed"})], [1])
    [1.0]
    """
    from functools import partial

    from hydra.utils import get_method
    from omegaconf import DictConfig, OmegaConf

    fields = OmegaConf.to_container(settings, resolve=True) if isinstance(settings, DictConfig) else vars(settings)
    options = {k: v for k, v in fields.items() if k not in ("_target_", "name")}
    try:
        function = get_method(settings._target_)
    except Exception as err:  # hydra wraps an import failure in its own error types
        raise RewardError(f"reward._target_={settings._target_!r}: no such function ({err})") from None
    return partial(function, **options)
