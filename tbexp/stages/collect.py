"""The collect stage: gold trajectories for SFT, executed and verified.

build (train tasks, agent, policy) → run `collect.n_runs` episodes per task in
fresh sandboxes → keep only the episodes whose tests all pass → write them as
`trajectories.jsonl` (format: `tbexp.episodes.trajectories`) → return counts. As in the
published recipe, nothing enters the training set unless it was executed and
verified; a policy's unverified text never does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tbexp import caches
from tbexp.build import run_policy
from tbexp.episodes.trajectories import write_conversations
from tbexp.jobs.tracking import write_summary

if TYPE_CHECKING:
    from tbexp.job import Job
    from tbexp.tasks.harbor_task import Task

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trajectories:
    """Verified conversations in a jsonl file (tbexp.episodes.trajectories), and how many episodes it took."""

    path: Path
    metrics: dict[str, float]

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, "collect/data": str(self.path)}

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Trajectories:
        return cls(Path(summary["collect/data"]), {k: v for k, v in summary.items() if k != "collect/data"})


def run(job: Job) -> dict[str, float]:
    cfg = job.cfg
    path = Path(cfg.collect.data) if cfg.collect.data else job.run_dir / "trajectories.jsonl"
    runtime = (
        job.models.runtime(job.models.sampler(cfg.load_checkpoint), cfg.sampling, None)
        if cfg.policy == "model"
        else None
    )
    metrics = collect(job, job.tasks("sft"), cfg.policy, path, runtime).metrics
    tracker = job.tracker(job.run_dir)
    tracker.log(metrics)
    tracker.finish()
    write_summary(job.run_dir, metrics)
    return metrics


def collect(job: Job, tasks: list[Task], policy: str, path: Path, runtime: Any = None) -> Trajectories:
    """Run `policy` (with `runtime` for policy=model) on `tasks`; write the verified successes to `path`."""
    c = job.cfg.collect
    episodes = run_policy(job, tasks, c.n_runs, c.concurrency, policy, runtime, desc=f"collect {policy}")
    # a success whose agent touched what the verifier reads is never a gold trajectory
    kept = sorted(
        (ep for ep in episodes if not ep.invalid and not ep.tamper and ep.report.strict),
        key=lambda ep: (ep.task.name, ep.run),
    )
    rows = [
        {
            "task": ep.task.name,
            "family": ep.task.family,
            "agent": job.cfg.agent.name,
            "policy": policy,
            "reward": 1.0,
            "messages": ep.messages,
        }
        for ep in kept
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_conversations(path, rows)
    print(f"kept {len(kept)} of {len(episodes)} episodes (verified strict successes) -> {path}")
    return Trajectories(
        path,
        {
            "collect/episodes": float(len(episodes)),
            "collect/kept": float(len(kept)),
            "collect/success_rate": len(kept) / len(episodes) if episodes else 0.0,
            "collect/invalid_episodes": float(sum(1 for ep in episodes if ep.invalid)),
        },
    )


def oracle_trajectories(job: Job) -> Path:
    """The oracle's verified turns on the SFT tasks, collected once per content key (tbexp.caches.trajectories_key:
    the tasks' names and directories, the agent, the sandbox, whose limits decide which oracle runs succeed, the code)."""
    tasks = job.tasks("sft")
    path = caches.trajectories_file(job, tasks)
    if not path.exists():
        collect(job, tasks, "oracle", path)
    return path
