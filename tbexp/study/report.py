"""A sweep's report from local data alone: `python -m tbexp.report multirun/smoke`.

Writes `report.md` and its plots into `<sweep dir>/report/` (or `--out`):
the optimisation history, parameter importances (PED-ANOVA, which needs no
scikit-learn and copes with a bound that moves with another parameter),
parallel coordinates, the intermediate values the trials reported to the
pruner, and the held-out curves of the best trials read from their run
directories' `metrics.jsonl`, plus a table of every trial with its job
directory and, for failures, the reason. Nothing needs a server: the study
comes from its storage (sqlite or journal file, or a PostgreSQL URL), found
through the `study.yaml` the sweeper leaves in the sweep directory, or given
with `--storage URL --study NAME`.

With `--wandb` (or WANDB_MODE=online) the same report is also saved as a W&B
Report over the study's runs (tbexp/study/report_wandb.py), after report.md is
written: without the network or an API key that part fails with one line
saying what to set, and report.md stays.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from tbexp.study.queries import best_trials, curve_metrics, metric_series, summary_lines, trial_table
from tbexp.study.storage import (
    JOB_DIR_ATTR,
    OBJECTIVE_ATTR,
    POINTER_FILE,
    SWEEP_DIR_ATTR,
    load_study,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tbexp.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", nargs="?", help="a sweep directory (holds study.yaml), e.g. multirun/smoke")
    parser.add_argument("--storage", help="the study's storage, instead of a sweep directory")
    parser.add_argument("--study", help="the study's name, with --storage")
    parser.add_argument("--out", help="where to write report.md and the plots (default: <sweep dir>/report)")
    parser.add_argument("--top", type=int, default=5, help="held-out curves of this many best trials")
    online = parser.add_argument_group(
        "W&B Report (also made when WANDB_MODE=online; needs the network and WANDB_API_KEY or `wandb login`)"
    )
    online.add_argument(
        "--wandb",
        action="store_true",
        help="also save the report as a W&B Report over the study's runs and print its URL",
    )
    online.add_argument(
        "--wandb-project",
        help="the W&B project of the study's runs (implies --wandb; default: the jobs' logger.project)",
    )
    online.add_argument(
        "--wandb-entity",
        help="its team or user (implies --wandb; default: the jobs' logger.entity, else $WANDB_ENTITY, else the account's default)",
    )
    args = parser.parse_args(argv)
    try:
        storage, study_name, sweep_dir = _locate(args)
    except ValueError as err:
        parser.error(str(err))
    study = load_study(storage, study_name, create_tables=False)
    out = Path(args.out) if args.out else Path(study.user_attrs.get(SWEEP_DIR_ATTR) or sweep_dir or ".") / "report"
    path = write_report(study, out, args.top)
    print(f"report: {path}")
    if not (args.wandb or args.wandb_project or args.wandb_entity or os.environ.get("WANDB_MODE") == "online"):
        return 0
    from tbexp.study.report_wandb import WandbUnavailable, publish  # only here: the reports API takes seconds to import

    try:
        url = publish(study, args.top, project=args.wandb_project, entity=args.wandb_entity)
    except WandbUnavailable as err:
        print(f"tbexp.report: no W&B report ({path} is written): {err}", file=sys.stderr)
        return 1
    print(f"W&B report: {url}")
    return 0


def write_report(study: Any, out: Path, top: int = 5) -> Path:
    """report.md and its plots in `out`; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    best = best_trials(study, trials, top)
    plots = {
        "Optimisation history": _optuna_plot(study, out / "history.png", "plot_optimization_history"),
        "Parameter importances (PED-ANOVA)": _optuna_plot(
            study, out / "importances.png", "plot_param_importances", importance=True
        ),
        "Parallel coordinates": _optuna_plot(study, out / "parallel_coordinates.png", "plot_parallel_coordinate"),
        "Intermediate values reported to the pruner": _optuna_plot(
            study, out / "intermediate.png", "plot_intermediate_values"
        ),
        f"Held-out curves of the {len(best)} best trials": _curves(
            best, out / "curves.png", curve_metrics(study), study.user_attrs.get(OBJECTIVE_ATTR, "value")
        ),
    }
    lines = [f"# Sweep report: study `{study.study_name}`", "", *summary_lines(study, trials, best)]
    for title, image in plots.items():
        lines += [f"## {title}", "", f"![{title}]({image.name})" if isinstance(image, Path) else f"_{image}_", ""]
    lines += ["## Trials", "", *trial_table(trials)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _locate(args: argparse.Namespace) -> tuple[str, str, Path | None]:
    if args.storage or args.study:
        if not (args.storage and args.study):
            raise ValueError("--storage and --study go together")
        return args.storage, args.study, None
    if not args.sweep_dir:
        raise ValueError("give a sweep directory (e.g. multirun/smoke) or --storage URL --study NAME")
    pointer = Path(args.sweep_dir) / POINTER_FILE
    if not pointer.is_file():
        raise ValueError(f"{pointer} does not exist: is {args.sweep_dir} the directory of a tbexp_optuna sweep?")
    from omegaconf import OmegaConf

    info = OmegaConf.load(pointer)
    return str(info.storage), str(info.study_name), Path(args.sweep_dir)


def _optuna_plot(study: Any, path: Path, name: str, importance: bool = False) -> Path | str:
    """One of Optuna's matplotlib plots, or why it cannot be drawn (too few trials, say)."""
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as ovm

    kwargs: dict[str, Any] = {}
    if importance:
        from optuna.importance import PedAnovaImportanceEvaluator

        kwargs["evaluator"] = PedAnovaImportanceEvaluator()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the matplotlib backend is marked experimental
            ax = getattr(ovm, name)(study, **kwargs)
    except Exception as err:  # noqa: BLE001 - a plot that cannot be drawn is noted in the report instead
        plt.close("all")
        return f"not drawn: {type(err).__name__}: {err}"
    figure = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
    figure.set_size_inches(8, 4.5)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close("all")
    return path


def _curves(best: list[Any], path: Path, metrics: list[str], objective: str) -> Path | str:
    """The first of `metrics` that a best trial's metrics.jsonl (or a stage's) holds over steps, for each best trial."""
    import matplotlib.pyplot as plt

    for metric in metrics:
        series = {t.number: metric_series(t.user_attrs.get(JOB_DIR_ATTR, ""), metric) for t in best}
        if any(len(points) > 1 for points in series.values()):
            break
    else:
        return f"not drawn: no best trial's metrics.jsonl (or its stages') has any of {metrics} at more than one step"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for t in best:
        points = series[t.number]
        if points:
            ax.plot(
                [s for s, _ in points], [v for _, v in points], marker="o", label=f"trial {t.number} ({t.value:.3g})"
            )
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} of the best trials (legend: final {objective})")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
