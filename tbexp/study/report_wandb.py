"""The sweep report as a W&B Report: `python -m tbexp.report multirun/smoke --wandb`.

The same content as report.md, drawn by W&B from the study's runs (one run
per job, group = the study, job_type = the stage: tbexp/jobs/tracking.py): the
summary, the objective over the runs' start times (the optimisation
history), parameter importances (W&B's own, against the objective),
parallel coordinates over the swept parameters and the objective, the
held-out curves of every run and of the best trials, and the trial table.
It is built with the reports API (`wandb_workspaces.reports.v2`) and saved
on W&B's server, so it needs the network and an API key; without them
`publish` raises WandbUnavailable with one line that says what to set.

What it simplifies:
* W&B reads the objective from each run's summary, where `python -m tbexp`
  puts the job's returned numbers under their own names (tracking.note_result).
* The best trials' runs are found by run name, `<sweep dir>/<job>`, as
  tracking.py names them, within the study's group.
* Where the runs went (project, entity, group) is read from the first job's
  `.hydra/config.yaml`; a study whose jobs logged to different projects shows
  only the runs of that one.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

from tbexp.errors import TbexpError
from tbexp.jobs.tracking import run_name
from tbexp.study.queries import best_trials, curve_metrics, metric_series, summary_lines, trial_table
from tbexp.study.storage import JOB_DIR_ATTR, OBJECTIVE_ATTR


class WandbUnavailable(TbexpError):
    """No W&B Report could be made; the message is one line that says what to set."""


def publish(study: Any, top: int = 5, project: str | None = None, entity: str | None = None) -> str:
    """Save the study's report on W&B; returns its URL."""
    logger = _job_logger(study)
    if logger.get("name") not in (None, "wandb"):
        print(
            f"tbexp.report: note: the study's jobs ran with logger={logger['name']}, so W&B may hold none of their runs",
            file=sys.stderr,
        )
    api = _api()
    from tbexp.config import LoggerConfig

    project = project or logger.get("project") or LoggerConfig.project
    entity = entity or logger.get("entity") or os.environ.get("WANDB_ENTITY") or _ask(lambda: api.default_entity)
    if not entity:
        raise WandbUnavailable("W&B names no entity for this account: set --wandb-entity (or WANDB_ENTITY)")
    report = build_report(study, top, project, entity, group=logger.get("group") or study.study_name)
    return _ask(lambda: report.save().url)


def build_report(study: Any, top: int, project: str, entity: str, group: str) -> Any:
    """The W&B Report object, not yet saved (nothing here touches the network)."""
    wr, expr = _reports_api()
    trials = study.get_trials(deepcopy=False)
    best = best_trials(study, trials, top)
    objective = study.user_attrs.get(OBJECTIVE_ATTR, "value")
    order = [
        wr.OrderBy(wr.SummaryMetric(objective), ascending=study.direction.name != "MAXIMIZE")
    ]  # best first in the runs table
    in_study = expr.Metric("Group") == group
    runs = wr.Runset(
        entity=entity, project=project, name=f"study {study.study_name}", filters=expr.And(in_study), order=order
    )
    params = list(dict.fromkeys(k for t in trials for k in t.params))
    metrics = _curve_metrics(study, best)
    blocks = [
        wr.MarkdownBlock(text="\n".join(summary_lines(study, trials, best))),
        wr.H2(text="The study's runs"),
        wr.PanelGrid(
            runsets=[runs],
            panels=[
                wr.ScatterPlot(
                    title="Optimisation history", x=wr.Metric("CreatedTimestamp"), y=wr.SummaryMetric(objective)
                ),
                wr.ParameterImportancePlot(with_respect_to=objective),
                wr.ParallelCoordinatesPlot(
                    title="Parallel coordinates",
                    columns=[wr.ParallelCoordinatesPlotColumn(metric=wr.Config(p)) for p in params]
                    + [wr.ParallelCoordinatesPlotColumn(metric=wr.SummaryMetric(objective))],
                ),
                *_line_plots(wr, metrics),
            ],
        ),
    ]
    names = [run_name(t.user_attrs[JOB_DIR_ATTR]) for t in best if t.user_attrs.get(JOB_DIR_ATTR)]
    if names:
        best_runs = wr.Runset(
            entity=entity,
            project=project,
            name=f"best {len(names)} trials",
            filters=expr.And(in_study, expr.Metric("Name").isin(names)),
            order=order,
        )
        blocks += [
            wr.H2(text=f"Held-out curves of the {len(names)} best trials"),
            wr.PanelGrid(runsets=[best_runs], panels=_line_plots(wr, metrics)),
        ]
    blocks += [wr.H2(text="Trials"), wr.MarkdownBlock(text="\n".join(trial_table(trials)))]
    direction = "maximised" if study.direction.name == "MAXIMIZE" else "minimised"
    return wr.Report(
        project=project,
        entity=entity,
        title=f"Sweep report: {study.study_name}"[:128],
        description=f"Optuna study {study.study_name}: {objective}, {direction}; made by python -m tbexp.report",
        blocks=blocks,
    )


def _curve_metrics(study: Any, best: list[Any]) -> list[str]:
    """The curve metrics the best trials' metrics.jsonl (or their stages', see metric_series) hold over steps; all of them if none is on this disk (W&B may still have them)."""
    candidates = curve_metrics(study)
    found = [m for m in candidates if any(len(metric_series(t.user_attrs.get(JOB_DIR_ATTR, ""), m)) > 1 for t in best)]
    return found or candidates


def _line_plots(wr: Any, metrics: list[str]) -> list[Any]:
    # x = tracking.py's `step` metric: W&B's own _step counts log calls, and a job logs several step series.
    return [wr.LinePlot(title=f"{m} over steps", x="step", y=[m]) for m in metrics]


def _job_logger(study: Any) -> dict[str, Any]:
    """The logger settings of the study's first job that kept its composed config: where its runs went."""
    from omegaconf import OmegaConf

    configs = (
        Path(t.user_attrs[JOB_DIR_ATTR]) / ".hydra" / "config.yaml"
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get(JOB_DIR_ATTR)
    )
    path = next((p for p in configs if p.is_file()), None)
    logger = OmegaConf.select(OmegaConf.load(path), "logger") if path else None
    try:
        return OmegaConf.to_container(logger, resolve=True) if logger is not None else {}
    except Exception:  # noqa: BLE001 - e.g. a ${hydra:...} that resolves only inside the job: use the defaults
        return {}


def _reports_api() -> tuple[Any, Any]:
    try:
        import wandb_workspaces.reports.v2 as wr
        from wandb_workspaces import expr
    except ModuleNotFoundError as err:
        raise WandbUnavailable(f"{err.name} is not installed: pip install wandb-workspaces") from None
    return wr, expr


def _api() -> Any:
    """A logged-in wandb.Api, or WandbUnavailable saying what to set."""
    import wandb

    # On a terminal W&B would ask for a key; this command says what to set instead, so it shows W&B no terminal.
    stdin, sys.stdin = sys.stdin, io.StringIO()
    try:
        return wandb.Api()
    except wandb.errors.UsageError:
        raise WandbUnavailable("no W&B API key: set WANDB_API_KEY (or run `wandb login`)") from None
    except wandb.errors.Error as err:
        raise WandbUnavailable(
            f"could not log in to W&B ({_first_line(err)}): check the network, WANDB_BASE_URL and WANDB_API_KEY"
        ) from None
    finally:
        sys.stdin = stdin


def _ask(call: Any) -> Any:
    """`call()`, a request to W&B's server; whatever it raises becomes one line."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - the server's answer, of whatever type, is the message; report.md stands
        raise WandbUnavailable(
            f"W&B refused the report ({type(err).__name__}: {_first_line(err)}): check --wandb-project, --wandb-entity and WANDB_API_KEY"
        ) from None


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
