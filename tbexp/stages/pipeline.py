"""The pipeline stage: the whole recipe in one job, each part handing its chosen checkpoint to the next.

collect (the oracle's verified turns on the train tasks, cached per task set)
→ sft (LoRA SFT; the checkpoint before held-out NLL stops improving) → eval of
the base model and of that checkpoint on the held-out tasks → filter (the RL
tasks the SFT checkpoint solves `lower`–`upper` of the time, sampled at the RL
temperature) → grpo from the SFT checkpoint on the kept tasks (the checkpoint
at peak held-out reward) → eval of that checkpoint → the base / SFT / SFT+RL
table, printed and saved (`table.md`), the RL curve (`rl_curve.png`) and
`summary.json` = {"base": …, "sft": …, "rl": …, plus each part's own numbers}.

Each step is a call that takes typed values and returns one (`Trajectories`,
`SFTResult`, `Scores`, `Selection`, `RLResult`). `Steps` runs them: each result
is kept in `pipeline_state.json` as its `summary()` when the step finishes, and
a re-run of the same command in the same directory rebuilds it from there
(`from_summary`) instead of redoing the step. Each part works in its own folder
under the run directory and resumes there. SFT and the base, SFT and incumbent
evals work in folders under the cache named by everything that decides them
(`tbexp.caches`; `pipeline.cache_sft`, `pipeline.cache_evals`), which the run's
`sft`, `eval_base` and `eval_sft` link to: runs and sweep trials that share
them train and score them once. The job's value (what a sweep optimises) is the
final held-out reward.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

from tbexp import caches
from tbexp.episodes.promotion import read_records
from tbexp.stages import collect, grpo, sft
from tbexp.stages.collect import Trajectories
from tbexp.stages.eval import Scores, evaluate_checkpoint, report
from tbexp.stages.filter import NoTasksKept, Selection, rl_tasks, select_for_rl
from tbexp.stages.grpo import RLResult
from tbexp.stages.sft import SFTResult

if TYPE_CHECKING:
    from tbexp.job import Job
    from tbexp.tasks.harbor_task import Task

log = logging.getLogger(__name__)
# Each held-out row's folder in the run directory, and the step that scores it in pipeline_state.json.
EVAL_FOLDERS = {"base": "eval_base", "sft": "eval_sft", "incumbent": "eval_incumbent", "rl": "eval_final"}
EVAL_FOLDERS["final"] = "eval_final"
ROW_STEPS = {
    "base": "base",
    "sft": "sft_eval",
    "incumbent": "incumbent_eval",
    "rl": "final_eval",
    "final": "final_eval",
}


def run(job: Job) -> dict[str, float]:
    parts, out, steps = job.cfg.pipeline.stages, job.run_dir, Steps(job.run_dir / "pipeline_state.json")
    start = checkpoint = job.cfg.load_checkpoint  # "" = the base model
    tasks: list[Task] = []  # the RL tasks: the filter part's, else as stage=grpo chooses them (filter.rl_tasks)
    data = steps.run("collect", Trajectories.from_summary, _oracle_turns, job) if "collect" in parts else None
    if "sft" in parts:
        checkpoint = steps.run("sft_training", SFTResult.from_summary, _sft, job, data).checkpoint
        steps.run("base", Scores.from_summary, _held_out, job, "base", start)
        steps.run("sft_eval", Scores.from_summary, _held_out, job, "sft", checkpoint)
    try:  # the filter part, or stage=grpo's own filter when there is none, may keep no RL task
        if "filter" in parts:
            restore = partial(Selection.from_summary, candidates=job.tasks("rl"))
            selection = steps.run("filter", restore, select_for_rl, job, out / "filter", checkpoint)
            tasks = selection.rl_tasks(job.cfg.task_filter)
        elif "grpo" in parts:
            tasks = rl_tasks(job, checkpoint, out / "grpo")
    except NoTasksKept:
        _report(job, steps)  # the rows done so far stand; the error says what to change
        raise
    if "grpo" in parts:
        checkpoint = steps.run("grpo", RLResult.from_summary, _rl, job, checkpoint, tasks).checkpoint
    if "eval" in parts and ("grpo" in parts or "sft" not in parts):  # an SFT-only pipeline's last row is the sft row
        steps.run("final_eval", Scores.from_summary, _held_out, job, "rl" if "grpo" in parts else "final", checkpoint)
    if job.cfg.eval.incumbent and "final_eval" in steps:  # a named checkpoint the last row must beat
        steps.run("incumbent_eval", Scores.from_summary, _held_out, job, "incumbent", job.cfg.eval.incumbent)
    return _report(job, steps)


def _oracle_turns(job: Job) -> Trajectories:
    """The oracle's verified turns on the SFT tasks, collected once per content (collect.oracle_trajectories)."""
    return Trajectories(collect.oracle_trajectories(job), {})


def _sft(job: Job, data: Trajectories | None) -> SFTResult:
    """SFT on `data` (else `sft.data`, one file or a mixture, else the oracle's turns) in the run's `sft` folder, or, with
    `pipeline.cache_sft`, in a folder under the cache that it links to (tbexp.caches.sft_folder), one job at a time:
    a second job with the same SFT waits, then resumes the finished run."""
    path = data.path if data else sft.data_file(job)
    folder = caches.sft_folder(job, path, job.run_dir / "sft")
    return caches.one_at_a_time(folder, sft.train, job, path, folder)


def _held_out(job: Job, row: str, checkpoint: str) -> Scores:
    """Row `row` of the table: `checkpoint` ("" = the base model) scored on the held-out tasks in its folder of the
    run directory. The base, SFT and incumbent rows, with `pipeline.cache_evals`, once per content: in a folder under
    the cache that it links to (tbexp.caches.eval_folder), so sweep trials that share an SFT setting score them once."""
    label, out = ("sft+rl" if row == "rl" else row), job.run_dir / EVAL_FOLDERS[row]
    if row in ("rl", "final") or not job.cfg.pipeline.cache_evals:
        return Scores(evaluate_checkpoint(job, out, checkpoint, label=label, quiet=True))
    folder = caches.eval_folder(job, checkpoint, label, out)
    return Scores(caches.one_at_a_time(folder, _scored_once, job, folder, checkpoint, label))


def _scored_once(job: Job, folder: Path, checkpoint: str, label: str) -> dict[str, float]:
    result = folder / "result.json"
    if result.exists() and read_records(folder) is not None:  # an older cache without records is redone
        log.info("pipeline: the %s row from the cache %s", label, folder)
        metrics: dict[str, float] = json.loads(result.read_text())
        return metrics
    metrics = evaluate_checkpoint(job, folder, checkpoint, label=label, quiet=True)
    result.write_text(json.dumps(metrics))
    return metrics


def _rl(job: Job, start: str, tasks: list[Task]) -> RLResult:
    """GRPO from `start` on `tasks` in the run's `grpo` folder; its curve is the run's `rl_curve.png`."""
    out = job.run_dir / "grpo"
    result = grpo.train(job, start, tasks, out)
    if (out / "grpo.png").exists():
        shutil.copyfile(out / "grpo.png", job.run_dir / "rl_curve.png")
    return result


def _report(job: Job, steps: Steps) -> dict[str, float]:
    """The table of the rows done so far (tbexp.stages.eval.report) with each other step's numbers; the last row's."""
    parts = job.cfg.pipeline.stages
    names = [row for row in ROW_STEPS if row != ("final" if "grpo" in parts else "rl")]  # base, sft, incumbent, last
    rows = {row: steps.summaries[ROW_STEPS[row]] for row in names if ROW_STEPS[row] in steps}
    others = {name: result for name, result in steps.summaries.items() if name not in ROW_STEPS.values()}
    report(job, job.run_dir, rows, others, {row: job.run_dir / EVAL_FOLDERS[row] for row in rows})
    final = list(rows.values())[-1] if rows else {}
    return {k: v for k, v in final.items() if isinstance(v, float)}


class Persisted(Protocol):
    def summary(self) -> dict[str, Any]: ...


P = ParamSpec("P")
R = TypeVar("R", bound=Persisted)


class Steps:
    """The pipeline's finished steps, each result kept as its `summary()` in a json file as the step finishes, so
    a re-run rebuilds the result (`restore`) instead of redoing the step."""

    def __init__(self, path: Path):
        self.path = path
        self.summaries: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}

    def __contains__(self, name: str) -> bool:
        return name in self.summaries

    def run(
        self,
        name: str,
        restore: Callable[[dict[str, Any]], R],
        work: Callable[P, R],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> R:
        """`work(*args, **kwargs)`, or its result rebuilt by `restore` when step `name` finished before."""
        if name in self.summaries:
            log.info("pipeline: %s already done in this run directory", name)
            return restore(self.summaries[name])
        result = work(*args, **kwargs)
        self.summaries[name] = result.summary()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.summaries, indent=1))
        tmp.replace(self.path)
        return result
