"""The filter stage: keep the RL tasks a checkpoint solves sometimes, but not always.

build (candidate tasks = the job's `rl` set from `task_filter.split`; the
policy: normally the model from a checkpoint, `select_for_rl`) → sample `k`
episodes per task in fresh sandboxes (or read them from the cache) → strict solve rate per task with a Wilson 95%
interval → keep the tasks whose rate lies in [lower, upper] → write
`kept_tasks.json` and the per-task table → a `Selection`.

Results are cached under `<cache>/filter/` by a content key
(`tbexp.caches.filter_key`) of everything that decides them: the checkpoint (its
files, or its tinker:// URI), the tasks (names and directories), k, the model,
backend, agent, sandbox (its limits decide what a command can do) and sampling
settings, the seed and the code. A second run or a sweep trial with the
same inputs reads the rates instead of resampling.
`task_filter=none` keeps every candidate without sampling.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from tbexp import caches
from tbexp.build import run_policy
from tbexp.episodes.trajectories import DataError
from tbexp.jobs.tracking import write_summary
from tbexp.seeds import stream

if TYPE_CHECKING:
    from tbexp.config import TaskFilterConfig
    from tbexp.job import Job
    from tbexp.tasks.harbor_task import Task

log = logging.getLogger(__name__)


class NoTasksKept(DataError):
    """The filter kept no RL task: nothing for GRPO to train on."""


@dataclass(frozen=True)
class Selection:
    """The RL tasks kept (`tasks`, among the job's `rl` set; their names `kept`), written to `path`
    (kept_tasks.json), and the filter's counts (`filter/…`)."""

    path: Path
    kept: list[str]
    metrics: dict[str, float]
    tasks: list[Task]

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, "filter/kept_tasks": str(self.path)}

    @classmethod
    def from_summary(cls, summary: dict[str, Any], candidates: list[Task]) -> Selection:
        """The selection `summary()` described, its tasks among `candidates` (the job's `rl` set)."""
        metrics = {k: v for k, v in summary.items() if k != "filter/kept_tasks"}
        return cls.read(Path(summary["filter/kept_tasks"]), candidates, metrics)

    @classmethod
    def read(cls, path: Path, candidates: list[Task], metrics: dict[str, float] | None = None) -> Selection:
        """The selection a kept_tasks.json file holds, its tasks among `candidates`; `metrics`: the filter's counts
        (without them, counted from the file: the filter rates task_filter.max_tasks of the candidates)."""
        written = json.loads(path.read_text())
        kept = written["kept"]
        if metrics is None:
            rated = len(written.get("rates") or candidates)
            metrics = {"filter/candidates": float(rated), "filter/kept": float(len(kept))}
        return cls(path, kept, metrics, [t for t in candidates if t.name in set(kept)])

    def rl_tasks(self, bounds: TaskFilterConfig) -> list[Task]:
        """The kept tasks, for RL; none kept is an error that says what to change (`bounds`: task_filter)."""
        if not self.tasks:
            rated = int(self.metrics["filter/candidates"])
            raise NoTasksKept(
                f"{self.path}: no RL tasks kept (solve rate in [{bounds.lower}, {bounds.upper}] of {rated} candidates rated); widen task_filter.lower/upper, raise task_filter.k, or train SFT further"
            )
        return self.tasks


def run(job: Job) -> dict[str, Any]:
    cfg = job.cfg
    metrics = select(job, job.run_dir, cfg.policy, cfg.load_checkpoint, cfg.sampling).summary()
    write_summary(job.run_dir, metrics)
    return metrics


def select_for_rl(job: Job, out: Path, checkpoint: str) -> Selection:
    """`select` as RL needs it: the model from `checkpoint`, sampled at the temperature GRPO rolls out at,
    since that is the rate that decides whether a group teaches anything."""
    settings = OmegaConf.merge(job.cfg.sampling, {"temperature": job.cfg.grpo.temperature})
    return select(job, out, "model", checkpoint, settings)


def select(job: Job, out: Path, policy: str, checkpoint: str, sampling: Any) -> Selection:
    """Rate the candidates with `policy` (policy=model: the weights of `checkpoint`, "" = the base model's,
    sampled with the `sampling` settings); write `out/kept_tasks.json`."""
    f = job.cfg.task_filter
    tasks: list[Task] = job.tasks("rl")
    if f.max_tasks and f.max_tasks < len(tasks):
        tasks = sorted(
            random.Random(stream(job.cfg.seed, "candidates")).sample(tasks, f.max_tasks), key=lambda t: t.name
        )
    if f.name == "none":
        rates = {t.name: (float("nan"), 0) for t in tasks}
        kept = [t.name for t in tasks]
    else:
        _warn_if_k_too_small(f.k, f.lower)
        rates = _solve_rates(job, tasks, policy, checkpoint, sampling)
        kept = [name for name, (rate, _) in sorted(rates.items()) if f.lower <= rate <= f.upper]
    out.mkdir(parents=True, exist_ok=True)
    (out / "kept_tasks.json").write_text(
        json.dumps({"kept": kept, "rates": {n: r for n, (r, _) in rates.items()}}, indent=1)
    )
    if f.name != "none":
        print(_table(rates, f.k, f.lower, f.upper))
    print(
        f"kept {len(kept)} of {len(tasks)} tasks with strict solve rate in [{f.lower}, {f.upper}] -> {out / 'kept_tasks.json'}"
    )
    metrics = {"filter/candidates": float(len(tasks)), "filter/kept": float(len(kept))}
    if f.name != "none":
        metrics["filter/mean_solve_rate"] = sum(r for r, _ in rates.values()) / len(rates)
    tracker = job.tracker(out)
    tracker.log(metrics)
    tracker.finish()
    return Selection(out / "kept_tasks.json", kept, metrics, [t for t in job.tasks("rl") if t.name in set(kept)])


def _solve_rates(
    job: Job, tasks: list[Task], policy: str, checkpoint: str, sampling: Any
) -> dict[str, tuple[float, int]]:
    """{task: (strict solve rate, valid samples)}, from the cache when the same inputs were sampled before."""
    cache = caches.filter_file(job, tasks, policy, checkpoint, sampling)
    if cache.exists():
        log.info("filter: solve rates from the cache %s", cache)
        return {name: tuple(v) for name, v in json.loads(cache.read_text()).items()}
    runtime = (
        job.models.runtime(job.models.sampler(checkpoint), sampling, seed=stream(job.cfg.seed, "filter"))
        if policy == "model"
        else None
    )  # reproducible rates
    episodes = run_policy(job, tasks, job.cfg.task_filter.k, job.cfg.eval.concurrency, policy, runtime, desc="filter")
    rates = {}
    for task in tasks:
        valid = [ep for ep in episodes if ep.task.name == task.name and not ep.invalid]
        # a success whose agent touched what the verifier reads counts as a failure (tbexp.episodes.integrity)
        solved = sum(ep.report.strict and not ep.tamper for ep in valid)
        rates[task.name] = (solved / len(valid) if valid else float("nan"), len(valid))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rates))
    return rates


def rl_tasks(job: Job, start: str, out: Path) -> list[Task]:
    """The kept tasks of `grpo.tasks_file`; without one, the filter rates `start` first, in `out/filter`
    (task_filter=none keeps every candidate)."""
    if job.cfg.grpo.tasks_file:
        return kept_tasks(job, Path(job.cfg.grpo.tasks_file))
    if job.cfg.task_filter.name == "none":
        return job.tasks("rl")
    return select_for_rl(job, out / "filter", start).rl_tasks(job.cfg.task_filter)


def kept_tasks(job: Job, path: Path) -> list[Task]:
    """The RL candidates that a selection file (the filter's kept_tasks.json) keeps; none kept is an error."""
    if not path.exists():
        raise DataError(f"grpo.tasks_file={path}: no such file (the filter stage writes kept_tasks.json)")
    return Selection.read(path, job.tasks("rl")).rl_tasks(job.cfg.task_filter)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a binomial rate.

    >>> [round(x, 3) for x in wilson_interval(1, 8)]
    [0.022, 0.471]
    """
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _warn_if_k_too_small(k: int, lower: float) -> None:
    miss = (1 - lower) ** k
    if lower > 0 and miss > 0.2:
        log.warning(
            "task_filter.k=%d is small for lower=%.2f: a task solved %.0f%% of the time shows no success %.0f%% of the time and is dropped; raise k",
            k,
            lower,
            100 * lower,
            100 * miss,
        )


def _table(rates: dict[str, tuple[float, int]], k: int, lower: float, upper: float) -> str:
    lines = [f"{'task':34} {'solved':>7} {'rate':>6} {'95% CI':>15}  kept"]
    for name, (rate, n) in sorted(rates.items()):
        wins = round(rate * n) if n else 0
        lo, hi = wilson_interval(wins, n)
        lines.append(
            f"{name:34} {wins:>3}/{n:<3} {rate:6.2f} [{lo:5.2f}, {hi:5.2f}]  {'yes' if lower <= rate <= upper else ''}"
        )
    return "\n".join(lines)
