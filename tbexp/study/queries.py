"""What the report and the W&B report read from a study: its best trials, their held-out curves, the tables."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tbexp.study.storage import FAIL_REASON_ATTR, JOB_DIR_ATTR, OBJECTIVE_ATTR, PRUNING_METRIC_ATTR

HELDOUT_REWARD = "heldout/reward"  # GRPO's held-out evaluations during training (tbexp/stages/grpo.py)


def best_trials(study: Any, trials: list[Any], top: int) -> list[Any]:
    """The `top` complete ones of the study's `trials`, best first."""
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    return sorted(complete, key=lambda t: t.value, reverse=study.direction.name == "MAXIMIZE")[:top]


def summary_lines(study: Any, trials: list[Any], best: list[Any]) -> list[str]:
    """Markdown: the objective, the trials by state and the best trial with its parameters."""
    from optuna.trial import TrialState

    objective = study.user_attrs.get(OBJECTIVE_ATTR, "value")
    counts = {s.name: sum(1 for t in trials if t.state == s) for s in TrialState if any(t.state == s for t in trials)}
    lines = [
        f"Objective: `{objective}`, {'maximised' if study.direction.name == 'MAXIMIZE' else 'minimised'}. Trials: "
        + ", ".join(f"{n} {k}" for k, n in counts.items())
        + ".",
        "",
    ]
    if best:
        b = best[0]
        lines += [
            f"**Best: trial {b.number}**, {objective} = {b.value:.4f} with "
            + ", ".join(f"`{k}={_fmt(v)}`" for k, v in b.params.items())
            + f" (`{b.user_attrs.get(JOB_DIR_ATTR, '')}`).",
            "",
        ]
    return lines


def curve_metrics(study: Any) -> list[str]:
    """What a held-out curve can show, most wanted first: the objective, the pruner's metric, GRPO's held-out reward."""
    return list(
        dict.fromkeys(
            m
            for m in (
                study.user_attrs.get(OBJECTIVE_ATTR, "value"),
                study.user_attrs.get(PRUNING_METRIC_ATTR, ""),
                HELDOUT_REWARD,
            )
            if m
        )
    )


def metric_series(job_dir: str, metric: str) -> list[tuple[float, float]]:
    """(step, value) of `metric` over steps in a job directory's metrics.jsonl, or in a stage's under it.

    A pipeline job logs one row of results to its own metrics.jsonl and each
    stage's steps to the stage's folder (grpo/metrics.jsonl); the file with
    the most points of `metric` wins. None if no file has it.
    """
    if not job_dir:
        return []
    files = [Path(job_dir) / "metrics.jsonl", *sorted(Path(job_dir).glob("*/metrics.jsonl"))]
    return max((_series(path, metric) for path in files if path.is_file()), key=len, default=[])


def _series(path: Path, metric: str) -> list[tuple[float, float]]:
    points = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a job killed mid-write leaves half a line
            continue
        value = row.get(metric)
        if isinstance(value, (int, float)) and math.isfinite(value):
            points.append((row.get("step", len(points)), float(value)))
    return points


def trial_table(trials: list[Any]) -> list[str]:
    """Markdown: one row per trial with its parameters, duration and job directory or why it failed."""
    names = list(dict.fromkeys(k for t in trials for k in t.params))
    rows = [
        "| trial | state | value | "
        + " | ".join(f"`{n}`" for n in names)
        + " | seconds | job directory / why it failed |",
        "|---" * (len(names) + 5) + "|",
    ]
    for t in trials:
        seconds = f"{t.duration.total_seconds():.0f}" if t.duration else ""
        value = (
            f"{t.value:.4f}" if t.state.name == "COMPLETE" else ""
        )  # a pruned trial's value is its last intermediate value
        note = t.user_attrs.get(JOB_DIR_ATTR, "")
        if t.state.name == "PRUNED":
            note += f" — pruned at step {t.last_step}"
        if t.user_attrs.get(FAIL_REASON_ATTR):
            note += f" — {t.user_attrs[FAIL_REASON_ATTR]}"
        cells = [_fmt(t.params[n]) if n in t.params else "" for n in names]
        rows.append(
            f"| {t.number} | {t.state.name} | {value} | "
            + " | ".join(cells)
            + f" | {seconds} | {note.replace('|', '/')[:300]} |"
        )
    return rows


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
