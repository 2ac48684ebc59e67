"""The collect stage: SFT data from a teacher, executed, verified, and selected by rejection sampling.

build (train tasks, agent, policy: the oracle, the model being trained, or a teacher endpoint) → run
`collect.n_runs` episodes per task in fresh sandboxes, `collect.concurrency` at a time, each entered in the
ledger as it ends (tbexp.episodes.ledger: a killed collection resumes where it stopped, no episode run twice)
→ rejection sampling over the ledger (tbexp.episodes.selection: verified successes only, identical
trajectories once, at most `collect.max_per_task` per task, shortest first) → decontamination against the
held-out (= eval) tasks and `collect.decontaminate_dirs` (tbexp.tasks.decontamination: overlapping tasks' rows
dropped and listed) → write them
(`collect.format`: tbexp rows, tbexp.episodes.trajectories, or chat rows) with a data card beside them
(tbexp.episodes.data_card) → return counts. As in the published
recipe, nothing enters the training set unless it was executed and verified; a policy's unverified text never does.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tbexp import caches
from tbexp.build import run_policy
from tbexp.episodes.data_card import length_counter, write_card
from tbexp.episodes.ledger import Ledger, episode_row, ledger_path
from tbexp.episodes.selection import select, verified
from tbexp.episodes.teacher import TeacherClient, teacher_settings
from tbexp.episodes.trajectories import write_conversations
from tbexp.jobs.tracking import write_summary
from tbexp.tasks.decontamination import Overlap, References, decontaminate

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
    runtime: Any = None
    if cfg.policy == "model":
        runtime = job.models.runtime(job.models.sampler(cfg.load_checkpoint), cfg.sampling, None)
    elif cfg.policy == "teacher":
        runtime = TeacherClient(teacher_settings(cfg.collect, cfg.sampling, cfg.seed))
    metrics = collect(job, job.tasks("sft"), cfg.policy, path, runtime, str(cfg.collect.format)).metrics
    tracker = job.tracker(job.run_dir)
    tracker.log(metrics)
    tracker.finish()
    write_summary(job.run_dir, metrics)
    return metrics


def collect(
    job: Job, tasks: list[Task], policy: str, path: Path, runtime: Any = None, data_format: str = "tbexp"
) -> Trajectories:
    """Run `policy` (with `runtime`: a sampler for policy=model, a TeacherClient for policy=teacher) on `tasks`,
    resuming the ledger beside `path`; write the rows rejection sampling keeps to `path`."""
    c = job.cfg.collect
    teacher = _teacher_name(job, policy, runtime)
    who = runtime.settings.model if policy == "teacher" else teacher  # the teacher's URL is where it lies: not in it
    ledger = Ledger(ledger_path(path), _identity(job, policy, who))
    failed = getattr(runtime, "failed", {})  # a teacher's calls that failed for good: not entered, run again on resume

    def enter(episode: Any) -> None:
        if (episode.task.name, episode.run) not in failed:
            tokens = _tokens(episode, runtime)
            ledger.append(episode_row(episode, policy, teacher, job.cfg.agent.name, job.cfg.sandbox.name, tokens))

    start = time.perf_counter()
    ran = run_policy(
        job, tasks, c.n_runs, c.concurrency, policy, runtime, f"collect {policy}", done=ledger.done(), on_done=enter
    )
    elapsed_s = time.perf_counter() - start  # sandboxes' environments are prepared inside: counted
    names = {task.name for task in tasks}
    rows = [row for row in ledger.rows if row["task"] in names and row["run"] < c.n_runs]
    kept, dropped = select(rows, c.min_pass_fraction, c.max_per_task)
    overlaps: list[Overlap] = []
    if c.decontaminate:
        references = References(reference_tasks(job), c.decontaminate_ngram)
        selected, (kept, overlaps) = kept, decontaminate(kept, tasks, references)
        bad = {o.task for o in overlaps}
        dropped += [{**row, "dropped": "overlaps a held-out or named task"} for row in selected if row["task"] in bad]
        for o in overlaps:
            print(f"decontamination: dropped {o.task}: {o.why} overlap with {o.reference} ({o.evidence})")
        itself = references.same_directory(tasks)
        if itself:  # tasks.source=dir: every split is the one directory, the user's choice
            print(f"decontamination: {len(itself)} collected tasks are held-out tasks themselves (kept): {itself[:3]}…")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_conversations(path, [{"messages": row["messages"]} for row in kept] if data_format == "chat" else kept)
    count, unit = length_counter(job.cfg.model)
    overlap_rows = [o.row() for o in overlaps]
    write_card(path, rows, kept, dropped, overlap_rows, count, unit, lambda row: verified(row, c.min_pass_fraction))
    print(f"kept {len(kept)} of {len(rows)} episodes (verified, distinct, at most max_per_task) -> {path}")
    metrics = _metrics(rows, kept, dropped, ledger.resumed, runtime)
    metrics["collect/contaminated_tasks"] = float(len({o.task for o in overlaps}))
    metrics["time/collect_s"] = elapsed_s
    metrics["collect/episodes_per_s"] = len(ran) / elapsed_s if ran else 0.0  # this run's, not the resumed ones
    return Trajectories(path, metrics)


def reference_tasks(job: Job) -> list[Task]:
    """What the collected data is checked against: the held-out tasks (the eval stage's) and the named directories."""
    from tbexp.tasks import load_tasks

    named = [task for folder in job.cfg.collect.decontaminate_dirs for task in load_tasks(folder)]
    return [*job.tasks("heldout"), *named]


def _metrics(rows: list[Any], kept: list[Any], dropped: list[Any], resumed: int, runtime: Any) -> dict[str, float]:
    reasons = [row["dropped"] for row in dropped]
    verified = len(rows) - reasons.count("not verified")
    metrics = {
        "collect/episodes": float(len(rows)),
        "collect/resumed_episodes": float(resumed),
        "collect/verified": float(verified),
        "collect/kept": float(len(kept)),
        "collect/success_rate": verified / len(rows) if rows else 0.0,
        "collect/invalid_episodes": float(sum(1 for row in rows if row["verdict"]["invalid"])),
        "collect/duplicates": float(reasons.count("duplicate trajectory")),
        "collect/over_max_per_task": float(sum(1 for r in reasons if r.startswith("over max_per_task"))),
        "collect/contaminated_rows": float(sum(1 for r in reasons if r.startswith("overlaps"))),
    }
    if hasattr(runtime, "retried"):  # a teacher: what its endpoint cost
        metrics["collect/teacher_retries"] = float(sum(runtime.retried.values()))
        metrics |= {f"collect/teacher_retries/{why}": float(n) for why, n in runtime.retried.items()}
        metrics["collect/teacher_failed_episodes"] = float(len(runtime.failed))
    return metrics


def _teacher_name(job: Job, policy: str, runtime: Any) -> str:
    """Who wrote the replies, as rows record it."""
    if policy == "teacher":
        return str(runtime.settings.name)
    if policy == "model":  # backend=tinker: a sampling client of any model the service serves is the teacher
        where = "tinker" if job.cfg.backend.name == "tinker" else "model"
        return f"{where}:{job.cfg.model.name}:{job.cfg.load_checkpoint or 'base'}"
    return policy


def _identity(job: Job, policy: str, teacher: str) -> dict[str, Any]:
    """What decides an episode of this collection: a ledger of another one is refused."""
    cfg: Any = job.cfg  # a DictConfig at run time (the schema class is not indexable)
    chosen = {group: caches.settings(group, cfg[group]) for group in ("agent", "sandbox", "verifier")}
    sampling = caches.settings("sampling", cfg.sampling) if policy in ("model", "teacher") else {}
    identity = {"policy": policy, "teacher": teacher, **chosen, "sampling": sampling}
    return dict(json.loads(json.dumps(identity)))  # as the ledger's first line reads back (enums as strings)


def _tokens(episode: Any, runtime: Any) -> dict[str, int]:
    """The tokens an episode's replies took: the teacher's usage, the model's sampled tokens; none for a script."""
    usage = getattr(runtime, "usage", {}).get((episode.task.name, episode.run))
    if usage is not None:
        return {"calls": usage.calls, "prompt": usage.prompt_tokens, "completion": usage.completion_tokens}
    sampled = episode.sequences
    if sampled:
        return {"calls": sum(len(s.turns) for s in sampled), "completion": sum(s.n_sampled for s in sampled)}
    return {}


def oracle_trajectories(job: Job) -> Path:
    """The oracle's verified turns on the SFT tasks, collected once per content key (tbexp.caches.trajectories_key:
    the tasks' names and directories, the agent, the sandbox, whose limits decide which oracle runs succeed, the code)."""
    tasks = job.tasks("sft")
    path = caches.trajectories_file(job, tasks, reference_tasks(job) if job.cfg.collect.decontaminate else [])
    if not path.exists():
        collect(job, tasks, "oracle", path)
    return path
