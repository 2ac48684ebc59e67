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
from typing import Any

from tbexp.build import run_policy
from tbexp.content_key import content_key, resolved, sandbox_part, task_contents
from tbexp.episodes.trajectories import write_conversations
from tbexp.jobs.tracking import write_summary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trajectories:
    """Verified conversations in a jsonl file (tbexp.episodes.trajectories), and how many episodes it took."""

    path: Path
    metrics: dict[str, float]


def run(job: Any) -> dict[str, float]:
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


def collect(job: Any, tasks: list, policy: str, path: Path, runtime: Any = None) -> Trajectories:
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


def oracle_trajectories(job: Any) -> Path:
    """The oracle's verified turns on the SFT tasks, collected once per content key (under the cache): the tasks
    (names and directories), the agent, the sandbox (its limits decide which oracle runs succeed) and the code."""
    cfg = job.cfg
    tasks = job.tasks("sft")
    decided_by = {"agent": resolved(cfg.agent), "sandbox": sandbox_part(cfg.sandbox), "n_runs": cfg.collect.n_runs}
    key = content_key(decided_by, task_contents(tasks), length=16)
    path = job.cache_dir / "trajectories" / f"oracle-{cfg.agent.name}-{len(tasks)}tasks-{key}.jsonl"
    if not path.exists():
        collect(job, tasks, "oracle", path)
    return path
