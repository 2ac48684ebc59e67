"""From episodes to numbers: rewards per group, per-task rows, and the `eval/…` metrics.

Definitions (docs/architecture.md#metrics repeats them). An episode is scored unless it is
invalid (`tbexp.episodes.verdicts`); a damaged episode is scored (usually 0).
* `eval/reward`: mean reward (the `reward` config's function) over scored episodes.
* `eval/strict_success`: share of scored episodes whose tests all passed.
* `eval/strict_success_all`: the same over all episodes, invalid ones counted
  as failures: the number to read beside `eval/invalid_episodes`.
* `eval/pass@1`: for each run index r, the share of tasks solved strictly in
  run r; their mean, with `eval/pass@1_stderr` = std over runs / sqrt(runs).
* `eval/valid_command_rate`: valid commands / attempted commands (see
  `agents.base`); 0 when no command was attempted at all.
* `eval/avg_turns`: mean number of agent replies per scored episode.
* `eval/invalid_episodes`: episodes dropped because the sandbox or verifier broke.
* `eval/damaged_episodes`: scored episodes whose agent broke its own sandbox.
* `eval/tamper_episodes`: episodes whose agent touched what the verifier reads (`Episode.tamper`,
  tbexp.episodes.integrity), however the policy (`eval.tamper`, `grpo.tamper`) then scored them.
* `eval/offline_episodes`: episodes whose task asked for a network the sandbox did not give it
  (an `allowlist`, which cannot be enforced here, or `public` with `sandbox.allow_network=false`);
  each episode's `network` says what it asked for.

A mean over no scored episode is NaN, never 0 (`no_valid_reason` says why),
so an eval in which every episode broke cannot pass for one that failed.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any

from tbexp.episodes.rewards import Reward
from tbexp.episodes.rollout import Episode
from tbexp.episodes.test_results import TestReport

TAMPERED = TestReport(source="tamper")  # what a tampered episode is scored on under policy zero: no test, no reward


def apply_tamper(episodes: list[Episode], policy: str) -> list[Episode]:
    """What `eval.tamper` / `grpo.tamper` make of episodes with a tamper record; the same list, changed in place.

    zero: scored on an empty report (every reward gives 0; the verifier's own is kept in `verified_report`);
    drop: invalid (not scored, not trained on), the reason starting "tamper"; keep: as verified.
    """
    for ep in episodes:
        if not ep.tamper or ep.invalid or policy == "keep":
            continue
        if policy == "zero":
            ep.verified_report, ep.report = ep.report, TAMPERED
        elif policy == "drop":
            ep.invalid = f"tamper (dropped): {ep.tamper[0]}"
        else:
            raise ValueError(f"tamper policy {policy!r}: choose zero, drop or keep")
    return episodes


def score_episodes(episodes: list[Episode], reward: Reward) -> dict[int, float]:
    """Reward of every valid episode, keyed by id(episode); groups are the attempts at one task."""
    groups: dict[str, list[Episode]] = defaultdict(list)
    for ep in episodes:
        if not ep.invalid:
            groups[ep.task.name].append(ep)
    rewards: dict[int, float] = {}
    for group in groups.values():
        scores = reward([ep.report for ep in group], [len(ep.turns) for ep in group])
        rewards.update({id(ep): s for ep, s in zip(group, scores)})
    return rewards


def summarize(episodes: list[Episode], rewards: dict[int, float], prefix: str = "eval") -> dict[str, float]:
    valid = [ep for ep in episodes if not ep.invalid]
    attempted = sum(ep.n_commands for ep in valid)
    runs: dict[int, list[float]] = defaultdict(list)
    for ep in valid:
        runs[ep.run].append(1.0 if ep.report.strict else 0.0)
    run_means = [statistics.fmean(v) for v in runs.values()]
    stderr = (
        statistics.stdev(run_means) / math.sqrt(len(run_means))
        if len(run_means) > 1
        else 0.0
        if run_means
        else math.nan
    )
    rate = sum(ep.n_valid_commands for ep in valid) / attempted if attempted else 0.0 if valid else math.nan
    return {
        f"{prefix}/reward": _mean([rewards[id(ep)] for ep in valid]),
        f"{prefix}/strict_success": _mean([1.0 if ep.report.strict else 0.0 for ep in valid]),
        f"{prefix}/strict_success_all": _mean([1.0 if not ep.invalid and ep.report.strict else 0.0 for ep in episodes]),
        f"{prefix}/pass@1": _mean(run_means),
        f"{prefix}/pass@1_stderr": stderr,
        f"{prefix}/valid_command_rate": rate,
        f"{prefix}/avg_turns": _mean([float(len(ep.turns)) for ep in valid]),
        f"{prefix}/episodes": float(len(episodes)),
        f"{prefix}/invalid_episodes": float(len(episodes) - len(valid)),
        f"{prefix}/damaged_episodes": float(sum(1 for ep in valid if ep.damage)),
        f"{prefix}/tamper_episodes": float(sum(1 for ep in episodes if ep.tamper)),
        f"{prefix}/offline_episodes": float(sum(1 for ep in episodes if ep.network)),
        f"{prefix}/tasks": float(len({ep.task.name for ep in episodes})),
    }


def no_valid_reason(episodes: list[Episode]) -> str:
    """Why a mean over these episodes is NaN ('' when some episode was scored).

    The first line of each invalid reason, up to its first colon, counted: "no valid episode: 6 invalid (SandboxError x6)".
    """
    if any(not ep.invalid for ep in episodes):
        return ""
    if not episodes:
        return "no episode"
    kinds = Counter(ep.invalid.splitlines()[0].split(":")[0].strip() for ep in episodes)
    listed = ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common(3)) + (", ..." if len(kinds) > 3 else "")
    first = episodes[0].invalid.splitlines()[0][:160]
    return f"no valid episode: {len(episodes)} invalid ({listed}); first: {first}"


def task_rows(episodes: list[Episode], rewards: dict[int, float]) -> list[dict[str, Any]]:
    """One row per task: family, runs, invalid and damaged runs, strict successes, mean reward, tests passed, turns, a note."""
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
                "damaged": sum(1 for ep in valid if ep.damage),
                "tamper": sum(1 for ep in group if ep.tamper),
                "strict": sum(1 for ep in valid if ep.report.strict),
                "reward": _mean([rewards[id(ep)] for ep in valid]),
                "tests_passed": _mean([ep.report.n_passed / max(ep.report.n_total, 1) for ep in valid]),
                "avg_turns": _mean([float(len(ep.turns)) for ep in valid]),
                "note": no_valid_reason(group),  # why reward, tests_passed and avg_turns are NaN
            }
        )
    return rows


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan
