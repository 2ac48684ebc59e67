"""From episodes to numbers: rewards per group, per-task rows, and the `eval/…` metrics.

Definitions (docs/architecture.md#metrics repeats them):
* `eval/reward`: mean reward (the `reward` config's function) over valid episodes.
* `eval/strict_success`: share of valid episodes whose tests all passed.
* `eval/pass@1`: for each run index r, the share of tasks solved strictly in
  run r; their mean, with `eval/pass@1_stderr` = std over runs / sqrt(runs).
* `eval/valid_command_rate`: valid commands / attempted commands (see
  `agents.base`); 0 when no command was attempted at all.
* `eval/avg_turns`: mean number of agent replies per valid episode.
* `eval/invalid_episodes`: episodes dropped because the sandbox or verifier broke.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from tbexp.rewards import score_group
from tbexp.rollout import Episode


def score_episodes(episodes: list[Episode], reward_settings: Any) -> dict[int, float]:
    """Reward of every valid episode, keyed by id(episode); groups are the attempts at one task."""
    groups: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        if not ep.invalid:
            groups[ep.task.name].append(ep)
    rewards: dict[int, float] = {}
    for group in groups.values():
        scores = score_group(reward_settings, [ep.report for ep in group], [len(ep.turns) for ep in group])
        rewards.update({id(ep): s for ep, s in zip(group, scores)})
    return rewards


def summarize(episodes: list[Episode], rewards: dict[int, float], prefix: str = "eval") -> dict[str, float]:
    valid = [ep for ep in episodes if not ep.invalid]
    attempted = sum(ep.n_commands for ep in valid)
    runs: dict[int, list[float]] = defaultdict(list)
    for ep in valid:
        runs[ep.run].append(1.0 if ep.report.strict else 0.0)
    run_means = [statistics.fmean(v) for v in runs.values()]
    return {
        f"{prefix}/reward": _mean([rewards[id(ep)] for ep in valid]),
        f"{prefix}/strict_success": _mean([1.0 if ep.report.strict else 0.0 for ep in valid]),
        f"{prefix}/pass@1": _mean(run_means),
        f"{prefix}/pass@1_stderr": statistics.stdev(run_means) / math.sqrt(len(run_means)) if len(run_means) > 1 else 0.0,
        f"{prefix}/valid_command_rate": sum(ep.n_valid_commands for ep in valid) / attempted if attempted else 0.0,
        f"{prefix}/avg_turns": _mean([float(len(ep.turns)) for ep in valid]),
        f"{prefix}/episodes": float(len(episodes)),
        f"{prefix}/invalid_episodes": float(len(episodes) - len(valid)),
        f"{prefix}/tasks": float(len({ep.task.name for ep in episodes})),
    }


def task_rows(episodes: list[Episode], rewards: dict[int, float]) -> list[dict[str, Any]]:
    """One row per task: family, runs, strict successes, mean reward, tests passed, turns."""
    by_task: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        by_task[ep.task.name].append(ep)
    rows = []
    for name in sorted(by_task):
        group = by_task[name]
        valid = [ep for ep in group if not ep.invalid]
        rows.append(
            {
                "task": name,
                "family": group[0].task.family,
                "runs": len(group),
                "invalid": len(group) - len(valid),
                "strict": sum(1 for ep in valid if ep.report.strict),
                "reward": _mean([rewards[id(ep)] for ep in valid]),
                "tests_passed": _mean([ep.report.n_passed / max(ep.report.n_total, 1) for ep in valid]),
                "avg_turns": _mean([float(len(ep.turns)) for ep in valid]),
            }
        )
    return rows


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0
