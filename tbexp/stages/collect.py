"""The collect stage: gold trajectories for SFT, executed and verified.

build (train tasks, agent, policy) → run `collect.n_runs` episodes per task in
fresh sandboxes → keep only the episodes whose tests all pass → write them as
`trajectories.jsonl` (format: `tbexp.trajectories`) → return counts. As in the
published recipe, nothing enters the training set unless it was executed and
verified; a policy's unverified text never does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tbexp.build import model_runtime, run_policy
from tbexp.tasks import load_task_set
from tbexp.tracking import Tracker, run_dir, write_summary
from tbexp.trajectories import write_conversations

log = logging.getLogger(__name__)


def run(cfg: Any) -> dict[str, float]:
    out = run_dir()
    path = Path(cfg.collect.data) if cfg.collect.data else out / "trajectories.jsonl"
    metrics = collect(cfg, path)
    tracker = Tracker(out, cfg.logger)
    tracker.log(metrics)
    tracker.finish()
    write_summary(out, metrics)
    return metrics


def collect(cfg: Any, path: Path) -> dict[str, float]:
    """Run `cfg.policy` on the `cfg.collect.split` tasks; write the verified successes to `path`."""
    tasks = load_task_set(cfg.tasks, split=cfg.collect.split, part="sft")
    runtime = model_runtime(cfg, path.parent / "checkpoints") if cfg.policy == "model" else None
    episodes = run_policy(cfg, tasks, cfg.collect.n_runs, cfg.collect.concurrency, runtime, desc=f"collect {cfg.policy}")
    kept = sorted((ep for ep in episodes if not ep.invalid and ep.report.strict), key=lambda ep: (ep.task.name, ep.run))
    rows = [{"task": ep.task.name, "family": ep.task.family, "agent": cfg.agent.name, "policy": cfg.policy, "reward": 1.0, "messages": ep.messages} for ep in kept]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_conversations(path, rows)
    print(f"kept {len(kept)} of {len(episodes)} episodes (verified strict successes) -> {path}")
    return {
        "collect/episodes": float(len(episodes)),
        "collect/kept": float(len(kept)),
        "collect/success_rate": len(kept) / len(episodes) if episodes else 0.0,
        "collect/invalid_episodes": float(sum(1 for ep in episodes if ep.invalid)),
    }
