"""The promotion gate: does a challenger beat the incumbent on the same tasks and draws, by more than chance?

Every held-out eval writes its per-episode records (`episodes.jsonl`: task, run,
invalid, strict, reward, turns; `episode_records`). Two checkpoints evaluated in
one run meet the same tasks with the same sampling seeds per (task, run)
(`tbexp.seeds.stream(seed, "eval")`: common random numbers), so their episodes pair up by
(task, run). The gate reads, on the pairs where both episodes were scored:

* the paired difference d̄ = mean over pairs of (challenger − incumbent) on the
  metric's per-episode value (strict: 1/0; reward: the per-test reward);
* its standard error, clustered by task: the runs of one task share the task's
  difficulty, so the sampled unit is the task: s.e. = sd over tasks of the
  per-task mean difference / √tasks (with one task, or none, it is NaN).

Promote when d̄ > margin + z·s.e. (`eval.promote_margin`, `eval.promote_z`;
z = 1.96 asks that the difference's 95% interval lie above the margin). With no
records on one side (an eval cached before they were written) the gate falls
back to the rows' difference, says so, and has no s.e. to demand.
Simplified: the s.e. is the normal approximation; with a handful of tasks it is rough.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

RECORDS = "episodes.jsonl"
# The per-episode value each pairable metric is the mean of (pass@1 averages strict success over runs).
PER_EPISODE = {
    "eval/strict_success": "strict",
    "eval/pass@1": "strict",
    "eval/reward": "reward",
    "eval/avg_turns": "turns",
}


def episode_records(episodes: list, rewards: dict[int, float]) -> list[dict[str, Any]]:
    """One record per episode, in (task, run) order: what a paired comparison needs, nothing more."""
    records = []
    for ep in sorted(episodes, key=lambda e: (e.task.name, e.run)):
        scored = not ep.invalid
        records.append(
            {
                "task": ep.task.name,
                "run": ep.run,
                "invalid": bool(ep.invalid),
                "tamper": len(ep.tamper),  # findings of tbexp.episodes.integrity (0: none)
                "strict": float(ep.report.strict) if scored else None,
                "reward": rewards.get(id(ep)) if scored else None,
                "turns": float(len(ep.turns)) if scored else None,
            }
        )
    return records


def write_records(folder: Path, records: list[dict[str, Any]]) -> None:
    (folder / RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))


def read_records(folder: Path | None) -> list[dict[str, Any]] | None:
    """The records an eval wrote in `folder`, or None when it wrote none."""
    path = folder / RECORDS if folder is not None else None
    if path is None or not path.exists():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def paired_difference(
    challenger: list[dict[str, Any]], incumbent: list[dict[str, Any]], metric: str
) -> dict[str, float]:
    """d̄, its task-clustered s.e., and how many pairs and tasks they rest on (see the module docstring)."""
    field = PER_EPISODE[metric]
    theirs = {(r["task"], r["run"]): r for r in incumbent if not r["invalid"] and r[field] is not None}
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in challenger:
        other = theirs.get((r["task"], r["run"]))
        if other is not None and not r["invalid"] and r[field] is not None:
            by_task[r["task"]].append(r[field] - other[field])
    diffs = [d for ds in by_task.values() for d in ds]
    task_means = [statistics.fmean(ds) for ds in by_task.values()]
    stderr = statistics.stdev(task_means) / math.sqrt(len(task_means)) if len(task_means) > 1 else math.nan
    return {
        "difference": statistics.fmean(diffs) if diffs else math.nan,
        "stderr": stderr,
        "pairs": float(len(diffs)),
        "tasks": float(len(by_task)),
    }


def promotion(
    rows: dict[str, dict[str, float]],
    metric: str,
    margin: float,
    z: float = 0.0,
    records: dict[str, list[dict[str, Any]] | None] | None = None,
    incumbent: str = "",
) -> dict[str, Any]:
    """Promote the best challenger when it beats `incumbent` (default: the first row) by more than
    margin + z·s.e. on `metric`, paired on `records` (name → that row's per-episode records) where both have them.

    >>> promotion({"old": {"m": 0.30}, "new": {"m": 0.36}}, "m", 0.05)["chosen"]
    'new'
    >>> promotion({"old": {"m": 0.30}, "new": {"m": 0.33}}, "m", 0.05)["chosen"]
    'old'
    >>> promotion({"old": {"m": 0.30}, "broken": {"m": float("nan")}, "new": {"m": 0.40}}, "m", 0.05)["chosen"]
    'new'
    """
    names = list(rows)
    incumbent = incumbent or names[0]
    challengers = [n for n in names if n != incumbent]
    verdict: dict[str, Any] = {"metric": metric, "incumbent": incumbent, "margin": margin, "z": z}
    if not challengers:
        return {**verdict, "chosen": incumbent, "promoted": False, "message": f"only {incumbent}: nothing to compare"}
    # NaN: no valid episode
    challenger = max(challengers, key=lambda n: (not math.isnan(rows[n][metric]), rows[n][metric]))
    gain = rows[challenger][metric] - rows[incumbent][metric]
    verdict |= {"challenger": challenger, "gain": gain}
    if math.isnan(gain):  # a side with no valid episode proves nothing: keep what is there, and say so
        unscored = " and ".join(n for n in (incumbent, challenger) if math.isnan(rows[n][metric]))
        message = f"KEEP {incumbent}: {metric} of {unscored} is NaN (no valid episode), nothing to compare"
        return {**verdict, "chosen": incumbent, "promoted": False, "message": message}
    paired = _paired(records or {}, challenger, incumbent, metric)
    difference, stderr = (paired["difference"], paired["stderr"]) if paired else (gain, math.nan)
    bar = margin + (z * stderr if z and not math.isnan(stderr) else 0.0)
    promoted = difference > bar
    chosen = challenger if promoted else incumbent
    if paired:
        basis = f"paired on {paired['pairs']:.0f} episodes of {paired['tasks']:.0f} tasks"
        spread = f" ± {stderr:.3f}" if not math.isnan(stderr) else " (s.e. needs 2+ tasks)"
    else:
        basis, spread = "unpaired: no per-episode records on both sides", ""
    rule = f"margin {margin}" + (f" + {z} s.e. = {bar:.3f}" if z and not math.isnan(stderr) else "")
    verdict |= {"difference": difference, "stderr": stderr, "pairs": paired.get("pairs", 0.0) if paired else 0.0}
    message = (
        f"{'PROMOTE' if promoted else 'KEEP'} {chosen}: {challenger} {difference:+.3f}{spread} {metric} "
        f"over {incumbent} ({basis}; needs > {rule})"
    )
    return {**verdict, "chosen": chosen, "promoted": promoted, "message": message}


def _paired(
    records: dict[str, list[dict[str, Any]] | None], challenger: str, incumbent: str, metric: str
) -> dict[str, float] | None:
    mine, theirs = records.get(challenger), records.get(incumbent)
    if metric not in PER_EPISODE or not mine or not theirs:
        return None
    paired = paired_difference(mine, theirs, metric)
    return paired if paired["pairs"] else None
