"""The eval stage: score a policy on a task set, n runs per task.

build (tasks, agent, policy) → run every (task, run) episode in a fresh
sandbox, `eval.concurrency` at a time → reward each task's group → write
`summary.json` (flat, keyed by metric name), `metrics.jsonl`, the per-task
table (`tasks.csv`, printed), a chart (`eval.png`) and a sample of
transcripts under `episodes/` → return the metrics.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from tbexp.build import model_runtime, run_policy
from tbexp.plots import plot_eval
from tbexp.policies import ModelRuntime
from tbexp.rollout import Episode
from tbexp.scoring import score_episodes, summarize, task_rows
from tbexp.tasks import load_task_set
from tbexp.tracking import Tracker, run_dir, write_summary

log = logging.getLogger(__name__)


def run(cfg: Any) -> dict[str, float]:
    out = run_dir()
    runtime = model_runtime(cfg, out / "checkpoints") if cfg.policy == "model" else None
    metrics = evaluate(cfg, out, runtime)
    write_summary(out, metrics)
    print(f"run directory: {out}")
    return metrics


def evaluate(cfg: Any, out: Path, runtime: ModelRuntime | None = None, label: str = "") -> dict[str, float]:
    """Score `cfg.policy` (with `runtime` for policy=model) on `cfg.tasks`; files go under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = load_task_set(cfg.tasks)
    name = label or cfg.policy
    log.info("eval %s: %d tasks x %d runs, sandbox=%s, agent=%s", name, len(tasks), cfg.eval.n_runs, cfg.sandbox.name, cfg.agent.name)
    episodes = run_policy(cfg, tasks, cfg.eval.n_runs, cfg.eval.concurrency, runtime, desc=f"eval {name}")
    episodes.sort(key=lambda ep: (ep.task.name, ep.run))

    rewards = score_episodes(episodes, cfg.reward)
    metrics = summarize(episodes, rewards)
    rows = task_rows(episodes, rewards)
    tracker = Tracker(out, cfg.logger)
    tracker.log({f"{label}/{k}" if label else k: v for k, v in metrics.items()})
    tracker.finish()
    _write_table(out / "tasks.csv", rows)
    plot_eval(rows, metrics, out / "eval.png", title=f"{name} on {len(tasks)} {cfg.tasks.split} tasks")
    _save_transcripts(out / "episodes", episodes, rewards, cfg.eval.save_episodes)
    print(_format_table(rows, metrics))
    return metrics


def _write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _format_table(rows: list[dict[str, Any]], metrics: dict[str, float]) -> str:
    head = f"{'task':34} {'family':22} {'strict':>7} {'reward':>7} {'turns':>6} {'invalid':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['task']:34} {r['family']:22} {r['strict']:>3}/{r['runs']:<3} {r['reward']:7.3f} {r['avg_turns']:6.1f} {r['invalid']:7d}")
    lines.append("-" * len(head))
    lines += [f"{k:28} {v:.4f}" for k, v in metrics.items()]
    return "\n".join(lines)


def _save_transcripts(folder: Path, episodes: list[Episode], rewards: dict[int, float], limit: int) -> None:
    folder.mkdir(exist_ok=True)
    invalid = [ep for ep in episodes if ep.invalid]
    for ep in (invalid + [ep for ep in episodes if not ep.invalid])[:limit]:  # the broken ones first: they need a look
        record = {
            "task": ep.task.name,
            "run": ep.run,
            "invalid": ep.invalid,
            "reward": rewards.get(id(ep)),
            "tests": ep.report.tests if ep.report else {},
            "time_s": ep.time_s,
            "messages": ep.messages,
            "turns": [{"reply": t.reply, "commands": t.action.commands, "exit_codes": [r.exit_code for r in t.results], "error": t.action.error} for t in ep.turns],
        }
        name = f"{ep.task.name.replace('/', '__')}-run{ep.run}.json"
        (folder / name).write_text(json.dumps(record, indent=1))
