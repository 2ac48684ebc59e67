"""The pipeline stage: the whole recipe in one job, each part handing its chosen checkpoint to the next.

collect (the oracle's verified turns on the train tasks, cached per task set)
→ sft (LoRA SFT; the checkpoint before held-out NLL stops improving) → eval of
the base model and of that checkpoint on the held-out tasks → filter (the RL
tasks the SFT checkpoint solves `lower`–`upper` of the time, sampled at the RL
temperature) → grpo from the SFT checkpoint on the kept tasks (the checkpoint
at peak held-out reward) → eval of that checkpoint → the base / SFT / SFT+RL
table, printed and saved (`table.md`), the RL curve (`rl_curve.png`) and
`summary.json` = {"base": …, "sft": …, "rl": …, plus each part's own numbers}.

Each part works in its own folder under the run directory and resumes there;
`pipeline_state.json` records the parts already done, so re-running the same
command in the same directory continues where it stopped. SFT and the base
and SFT evals work in folders under the cache named by a hash of everything
that decides them (`pipeline.cache_sft`, `pipeline.cache_evals`), which the
run's `sft`, `eval_base` and `eval_sft` link to: runs and sweep trials that
share them train and score them once. The job's value
(what a sweep optimises) is the final held-out reward.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

from tbexp import caches
from tbexp.episodes.promotion import read_records

log = logging.getLogger(__name__)
EVAL_FOLDERS = {"base": "eval_base", "sft": "eval_sft", "incumbent": "eval_incumbent", "rl": "eval_final"}
EVAL_FOLDERS["final"] = "eval_final"


def run(job: Any) -> dict[str, float]:
    from tbexp.stages import collect, grpo, sft
    from tbexp.stages import filter as filter_stage
    from tbexp.stages.eval import evaluate_checkpoint

    cfg, out = job.cfg, job.run_dir
    done = _Done(out / "pipeline_state.json")
    parts = cfg.pipeline.stages
    checkpoint = cfg.load_checkpoint  # "" = the base model
    data = Path(cfg.sft.data) if cfg.sft.data else None
    rl_tasks = None  # without a filter part: as stage=grpo chooses them (grpo.rl_tasks)

    if "collect" in parts:
        data = Path(
            done.get("collect", lambda: {"collect/data": str(collect.oracle_trajectories(job))})["collect/data"]
        )
    if "sft" in parts:
        folder = _sft_folder(job, out, data)
        trained = done.get(
            "sft_training",
            lambda: caches.one_at_a_time(
                folder, lambda: sft.train(job, data or collect.oracle_trajectories(job), folder).summary()
            ),
        )
        checkpoint = sft.SFTResult.from_summary(trained).checkpoint
        done.get("base", lambda: _eval_once(job, out, "eval_base", cfg.load_checkpoint, label="base"))
        done.get("sft_eval", lambda: _eval_once(job, out, "eval_sft", checkpoint, label="sft"))
    try:  # the filter part, or stage=grpo's own filter when there is none, may keep no RL task
        if "filter" in parts:
            selection = filter_stage.Selection.from_summary(
                done.get("filter", lambda: filter_stage.select_for_rl(job, out / "filter", checkpoint).summary())
            )
            rl_tasks = grpo.kept_tasks(job, selection.path)
        if "grpo" in parts and rl_tasks is None:
            rl_tasks = grpo.rl_tasks(job, checkpoint, out / "grpo")
    except grpo.NoTasksKept:
        _report(job, out, done, parts)  # the rows done so far stand; the error says what to change
        raise
    if "grpo" in parts:
        rl = grpo.RLResult.from_summary(
            done.get("grpo", lambda: grpo.train(job, checkpoint, rl_tasks, out / "grpo").summary())
        )
        checkpoint = rl.checkpoint
        if (out / "grpo" / "grpo.png").exists():
            shutil.copyfile(out / "grpo" / "grpo.png", out / "rl_curve.png")
    if "eval" in parts and ("grpo" in parts or "sft" not in parts):  # an SFT-only pipeline's last row is the sft row
        label = "sft+rl" if "grpo" in parts else "final"
        done.get(
            "final_eval", lambda: evaluate_checkpoint(job, out / "eval_final", checkpoint, label=label, quiet=True)
        )

    if cfg.eval.incumbent and "final_eval" in done.results:  # a named checkpoint the last row must beat
        done.get("incumbent_eval", lambda: _eval_once(job, out, "eval_incumbent", cfg.eval.incumbent, "incumbent"))

    rows = _report(job, out, done, parts)
    final = list(rows.values())[-1] if rows else {}
    return {k: v for k, v in final.items() if isinstance(v, float)}


def _report(job: Any, out: Path, done: _Done, parts: Any) -> dict[str, dict[str, float]]:
    """The table of the rows done so far (tbexp.stages.eval.report), with each other part's numbers."""
    from tbexp.stages.eval import report

    names = {"base": "base", "sft_eval": "sft", "incumbent_eval": "incumbent"}
    names["final_eval"] = "rl" if "grpo" in parts else "final"
    rows = {name: done.results[key] for key, name in names.items() if key in done.results}
    others = {k: v for k, v in done.results.items() if k not in names}
    report(job, out, rows, others, {name: out / EVAL_FOLDERS[name] for name in rows})
    return rows


def _sft_folder(job: Any, out: Path, data: Path | None) -> Path:
    """Where SFT trains: with `pipeline.cache_sft`, a folder under the cache named by everything that decides its
    result (tbexp.caches.sft_key), which `<run>/sft` links to; sweep trials and re-runs that share it train once."""
    from tbexp.stages import collect

    return caches.sft_folder(job, data or collect.oracle_trajectories(job), out / "sft")


def _eval_once(job: Any, out: Path, name: str, checkpoint: str, label: str) -> dict[str, float]:
    """The held-out eval of `checkpoint` ("" = the base model) in `out/name`.

    With `pipeline.cache_evals` it runs once per content: in a folder named by everything that decides it
    (tbexp.caches.eval_key), which `out/name` links to, so sweep trials that share an SFT setting score base and SFT
    once.
    """
    from tbexp.stages.eval import evaluate_checkpoint

    if not job.cfg.pipeline.cache_evals:
        return evaluate_checkpoint(job, out / name, checkpoint, label=label, quiet=True)
    folder = caches.eval_folder(job, checkpoint, label, out / name)

    def work() -> dict[str, float]:
        result = folder / "result.json"
        if result.exists() and read_records(folder) is not None:  # an older cache without records is redone
            log.info("pipeline: the %s row from the cache %s", label, folder)
            return json.loads(result.read_text())
        metrics = evaluate_checkpoint(job, folder, checkpoint, label=label, quiet=True)
        result.write_text(json.dumps(metrics))
        return metrics

    return caches.one_at_a_time(folder, work)


class _Done:
    """Results of the parts already finished, kept in a json file so a re-run skips them."""

    def __init__(self, path: Path):
        self.path = path
        self.results: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}

    def get(self, part: str, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if part not in self.results:
            self.results[part] = work()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.results, indent=1))
            tmp.replace(self.path)
        else:
            log.info("pipeline: %s already done in this run directory", part)
        return self.results[part]
