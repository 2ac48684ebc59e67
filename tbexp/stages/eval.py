"""The eval stage: score a policy on a task set, n runs per task.

build (tasks, agent, policy) → run every (task, run) episode in a fresh
sandbox, `eval.concurrency` at a time → reward each task's group → write
`summary.json` (flat, keyed by metric name), `metrics.jsonl`, the per-task
table (`tasks.csv`, printed), the per-episode records (`episodes.jsonl`, which
the promotion gate pairs: tbexp.episodes.promotion), a chart (`eval.png`) and a
sample of transcripts under `episodes/` → return the metrics.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tbexp.build import run_policy
from tbexp.episodes.policies import POLICIES, ModelRuntime
from tbexp.episodes.promotion import episode_records, promotion, read_records, write_records
from tbexp.episodes.rewards import per_test
from tbexp.episodes.rollout import Episode
from tbexp.episodes.scoring import apply_tamper, no_valid_reason, score_episodes, summarize, task_rows
from tbexp.jobs.plots import plot_eval
from tbexp.jobs.tracking import write_summary
from tbexp.seeds import stream

if TYPE_CHECKING:
    from tbexp.config import EvalConfig
    from tbexp.job import Job
    from tbexp.tasks.harbor_task import Task

log = logging.getLogger(__name__)
POLICY_NAMES = (*POLICIES, "model")  # an eval.candidates entry that is not one of these is a checkpoint
# The numbers a held-out row is judged by, in the order tables show them, with their names in a table's head.
ROW_METRICS = {
    "eval/strict_success": "strict success",
    "eval/reward": "per-test reward",
    "eval/pass@1": "pass@1",
    "eval/valid_command_rate": "valid-command rate",
    "eval/avg_turns": "avg turns",
}


@dataclass(frozen=True)
class Scores:
    """A policy's numbers on the held-out tasks (`eval/…`, `tasks/unloadable`): one row of a table."""

    metrics: dict[str, float]

    def summary(self) -> dict[str, float]:
        return dict(self.metrics)

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Scores:
        return cls(dict(summary))


def run(job: Job) -> dict[str, float]:
    cfg, out = job.cfg, job.run_dir
    if cfg.eval.candidates:
        return _compare_candidates(job, out)
    if cfg.policy == "model":
        metrics = evaluate_checkpoint(job, out, cfg.load_checkpoint, label="")
    else:
        metrics = evaluate(job, out, cfg.policy)
    write_summary(out, metrics)
    print(f"run directory: {out}")
    return metrics


def evaluate_checkpoint(job: Job, out: Path, checkpoint: str, label: str, quiet: bool = False) -> dict[str, float]:
    """policy=model from `checkpoint`'s weights ("" = the base model) on the held-out tasks, on the eval draws."""
    runtime = job.models.runtime(job.models.sampler(checkpoint), job.cfg.sampling, stream(job.cfg.seed, "eval"))
    return evaluate(job, out, "model", runtime, label=label, quiet=quiet)


def compare(rows: dict[str, dict[str, float]]) -> str:
    """One table, a column per candidate: the numbers a promotion decision reads."""
    keys = list(ROW_METRICS)
    width = max(10, *(len(name) for name in rows))
    lines = [f"{'':26}" + "".join(f" {name:>{width}}" for name in rows)]
    for k in keys:
        lines.append(f"{k:26}" + "".join(f" {m[k]:>{width}.3f}" for m in rows.values()))
    lines.append(
        f"{'eval/pass@1 stderr':26}" + "".join(f" {m['eval/pass@1_stderr']:>{width}.3f}" for m in rows.values())
    )
    return "\n".join(lines)


def _compare_candidates(job: Job, out: Path) -> dict[str, float]:
    """Score every `eval.candidates` entry; the first is the incumbent, the best challenger is promoted if it beats it."""
    cfg = job.cfg
    rows: dict[str, dict[str, float]] = {}
    records = {}
    for candidate in cfg.eval.candidates:
        label = Path(candidate).name if candidate not in POLICY_NAMES else candidate
        folder = out / "candidates" / f"{len(rows):02d}-{label.replace('/', '_')}"
        if candidate in POLICY_NAMES and candidate != "model":
            rows[label] = evaluate(job, folder, candidate, label=label, quiet=True)
        else:  # "model" is the base model
            rows[label] = evaluate_checkpoint(
                job, folder, "" if candidate == "model" else candidate, label=label, quiet=True
            )
        records[label] = read_records(folder)
    verdict = promotion(rows, cfg.eval.promote_by, cfg.eval.promote_margin, cfg.eval.promote_z, records)
    print(compare(rows))
    print(verdict["message"])
    write_summary(out, {**rows, "promotion": verdict})
    print(f"run directory: {out}")
    return rows[verdict["chosen"]]


def evaluate(
    job: Job,
    out: Path,
    policy: str,
    runtime: ModelRuntime | None = None,
    label: str = "",
    quiet: bool = False,
    n_runs: int = 0,
) -> dict[str, float]:
    """Score `policy` (with `runtime` for policy=model) on the held-out tasks, `n_runs` (0: `eval.n_runs`) each;
    files go under `out`. `quiet` prints one line instead of the per-task table (evals inside a training loop).
    """
    cfg = job.cfg
    out.mkdir(parents=True, exist_ok=True)
    tasks = job.tasks("heldout")
    (out / "unloadable_tasks.json").write_text(json.dumps(tasks.unloadable, indent=1))  # task dir -> reason
    if tasks.unloadable:
        reasons = out / "unloadable_tasks.json"
        print(f"{len(tasks.unloadable)} task(s) cannot be loaded and are left out; reasons in {reasons}")
    excluded = getattr(tasks, "excluded", {})
    (out / "excluded_tasks.json").write_text(json.dumps(excluded, indent=1))  # task -> why tasks.manifest left it out
    if excluded:
        print(f"{len(excluded)} task(s) left out by tasks.manifest; reasons in {out / 'excluded_tasks.json'}")
    name = label or policy
    n_runs = n_runs or cfg.eval.n_runs
    log.info(
        "eval %s: %d tasks x %d runs, sandbox=%s, agent=%s, harness=%s",
        *(name, len(tasks), n_runs, cfg.sandbox.name, cfg.agent.name, cfg.eval.harness),
    )
    episodes = apply_tamper(_run(job, tasks, n_runs, policy, runtime, out, desc=f"eval {name}"), cfg.eval.tamper)
    episodes.sort(key=lambda ep: (ep.task.name, ep.run))

    # eval/reward is the per-test fraction whatever reward= trains with, so runs stay comparable;
    # a different training reward is reported beside it as eval/<name>_reward.
    rewards = score_episodes(episodes, per_test)
    metrics = summarize(episodes, rewards)
    metrics["tasks/unloadable"] = float(len(tasks.unloadable))
    metrics["tasks/excluded"] = float(len(excluded))
    if cfg.reward.name != "per_test":
        trained = score_episodes(episodes, job.reward)
        metrics[f"eval/{cfg.reward.name}_reward"] = summarize(episodes, trained)["eval/reward"]
    write_records(out, episode_records(episodes, rewards))  # what a paired promotion gate reads
    rows = task_rows(episodes, rewards)
    why_nan = no_valid_reason(episodes)
    if why_nan:
        log.warning("eval %s: every metric over scored episodes is NaN: %s", name, why_nan)
    tracker = job.tracker(out)
    tracker.log({f"{label}/{k}" if label else k: v for k, v in metrics.items()})
    tracker.log_table(f"{label}/eval/per_task" if label else "eval/per_task", rows)  # tasks.csv, for W&B / Trackio
    tracker.finish()
    _write_table(out / "tasks.csv", rows)
    plot_eval(rows, metrics, out / "eval.png", title=f"{name} on {len(tasks)} {cfg.tasks.split} tasks")
    _save_transcripts(out / "episodes", episodes, rewards, cfg.eval.save_episodes)
    if quiet:
        print(
            f"{name}: reward {metrics['eval/reward']:.3f}, strict {metrics['eval/strict_success']:.3f}, valid commands {metrics['eval/valid_command_rate']:.3f}, turns {metrics['eval/avg_turns']:.2f}"
            + (f" ({why_nan})" if why_nan else "")
        )
    else:
        print(_format_table(rows, metrics, why_nan))
    return metrics


def _run(job: Job, tasks: list[Task], n_runs: int, policy: str, runtime: Any, out: Path, desc: str) -> list[Episode]:
    """The episodes, through tbexp's own agent loop or (eval.harness=harbor) Harbor's trials under `out/trials`."""
    cfg = job.cfg
    if cfg.eval.harness == "harbor":
        from tbexp.episodes.harbor_trials import run_trials

        return run_trials(cfg, tasks, n_runs, cfg.eval.concurrency, policy, runtime, out / "trials", desc)
    return run_policy(job, tasks, n_runs, cfg.eval.concurrency, policy, runtime, desc=desc)


def _write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _format_table(rows: list[dict[str, Any]], metrics: dict[str, float], why_nan: str = "") -> str:
    """The per-task table and the metrics; a NaN says why beside it (no scored episode), a damaged run is counted."""
    head = f"{'task':34} {'family':22} {'strict':>7} {'reward':>7} {'turns':>6} {'invalid':>7} {'damaged':>7} {'tamper':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['task']:34} {r['family']:22} {r['strict']:>3}/{r['runs']:<3} {r['reward']:7.3f} {r['avg_turns']:6.1f} {r['invalid']:7d} {r['damaged']:7d} {r['tamper']:6d}"
        lines.append(line + (f"  {r['note']}" if r["note"] else ""))
    lines.append("-" * len(head))
    lines += [f"{k:28} {v:.4f}" + (f"  ({why_nan})" if why_nan and math.isnan(v) else "") for k, v in metrics.items()]
    return "\n".join(lines)


def _source(ep: Episode) -> str:
    report = ep.verified_report or ep.report
    return report.source if report else ""


def _save_transcripts(folder: Path, episodes: list[Episode], rewards: dict[int, float], limit: int) -> None:
    folder.mkdir(exist_ok=True)
    broken = [ep for ep in episodes if ep.invalid or ep.damage or ep.tamper]
    for ep in (broken + [ep for ep in episodes if not (ep.invalid or ep.damage or ep.tamper)])[
        :limit
    ]:  # the broken ones first: they need a look
        record = {
            "task": ep.task.name,
            "run": ep.run,
            "invalid": ep.invalid,
            "damage": ep.damage,
            "network": ep.network,  # the network the task asked for and did not get; "" = none
            "environment": ep.environment,  # where the environment came from: "docker_image X", "environment/Dockerfile"
            "reward": rewards.get(id(ep)),
            "tests": ep.report.tests if ep.report else {},
            "task_rewards": ep.report.rewards if ep.report else {},  # every named reward the task wrote
            "source": _source(ep),  # which result decided the per-test reward (tbexp.episodes.test_results)
            **ep.integrity.record(),  # tamper, set_aside, left_processes (tbexp.episodes.integrity)
            "verified_tests": ep.verified_report.tests if ep.verified_report else None,  # before a tamper zero
            "time_s": ep.time_s,
            "messages": ep.messages,
            "turns": [
                {
                    "reply": t.reply,
                    "commands": t.action.commands,
                    "exit_codes": [r.exit_code for r in t.results],
                    "error": t.action.error,
                }
                for t in ep.turns
            ],
        }
        name = f"{ep.task.name.replace('/', '__')}-run{ep.run}.json"
        (folder / name).write_text(json.dumps(record, indent=1))


def report(
    job: Job, out: Path, rows: dict[str, dict[str, float]], others: dict[str, Any], folders: dict[str, Path]
) -> None:
    """The table of the held-out `rows` (in order; the last is the challenger), printed and saved in `out` (table.md)
    with `summary.json` (the rows, the `others` parts' numbers and, with two rows or more, the gate's verdict, paired
    on the episodes in each row's folder of `folders`), and sent to the tracker."""
    summary: dict[str, Any] = {**rows, **others}
    table = compare(rows) if rows else "no eval rows (pipeline.stages has no eval part)"
    if len(rows) > 1:
        summary["promotion"] = gate(job.cfg.eval, rows, {name: read_records(folders[name]) for name in rows})
        table += "\n" + summary["promotion"]["message"]
    write_summary(out, summary)
    (out / "table.md").write_text(
        _markdown(rows) + ("\n" + summary["promotion"]["message"] + "\n" if "promotion" in summary else "")
        if rows
        else table + "\n"
    )
    print(table)
    tracker = job.tracker(out)
    tracker.log({f"{name}/{k}": v for name, metrics in rows.items() for k, v in metrics.items()})
    tracker.finish()
    print(f"run directory: {out}")


def gate(settings: EvalConfig, rows: dict[str, dict[str, float]], records: dict[str, Any]) -> dict[str, Any]:
    """The last row against the incumbent: `eval.incumbent`'s row when named, else the row before the last
    (SFT, for the whole recipe; base when there is no SFT row), paired on the same tasks and draws."""
    last = list(rows)[-1]
    incumbent = "incumbent" if "incumbent" in rows else list(rows)[-2]
    pair = {incumbent: rows[incumbent], last: rows[last]}
    return promotion(pair, settings.promote_by, settings.promote_margin, settings.promote_z, records)


def _markdown(rows: dict[str, dict[str, float]]) -> str:
    keys = [(label, key) for key, label in ROW_METRICS.items()]
    lines = ["| held-out | " + " | ".join(label for label, _ in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, m in rows.items():
        cells = [
            f"{m[k]:.3f}" if k != "eval/pass@1" else f"{m[k]:.3f} ± {m['eval/pass@1_stderr']:.3f}" for _, k in keys
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
