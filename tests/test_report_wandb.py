"""`python -m tbexp.report --wandb`: the sweep report as a W&B Report (tbexp/study/report_wandb.py).

W&B's service cannot be reached from the machine these tests were written on
(only 127.0.0.1 is), so the two calls that talk to it are replaced by
stand-ins: `Report.save()` (which uploads the report) and `wandb.Api` (which
checks the key with the server when made, and names the account's entity and
the app's URL). Everything up to them is real: the Report object, its blocks,
panels and run-set filters are those the server would get. The failures are
real too: no API key, and a server that does not answer (a closed port on
127.0.0.1), each run as the command a user types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tbexp.study.storage import FAIL_REASON_ATTR, JOB_DIR_ATTR, OBJECTIVE_ATTR, PRUNING_METRIC_ATTR
from tests.conftest import REPO

STUDY = "wb-demo"


@pytest.fixture
def study(tmp_path):
    """Three complete trials and a failed one, each with a job directory as a sweep leaves it."""
    import optuna

    study = optuna.create_study(study_name=STUDY, storage=f"sqlite:///{tmp_path}/optuna.db", direction="maximize")
    study.set_user_attr(OBJECTIVE_ATTR, "eval/reward")
    study.set_user_attr(PRUNING_METRIC_ATTR, "eval/reward")
    for number in range(4):
        trial = study.ask()
        trial.suggest_float("grpo.learning_rate", 1e-4, 1e-2, log=True)
        trial.suggest_categorical("model.lora_rank", [8, 16])
        job = tmp_path / "multirun" / STUDY / str(number)
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "config.yaml").write_text(
            "logger:\n  name: wandb\n  project: sweeps\n  entity: ''\n  group: ''\n"
        )
        trial.set_user_attr(JOB_DIR_ATTR, str(job))
        if number == 3:
            trial.set_user_attr(FAIL_REASON_ATTR, "the job raised")
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        # As GRPO logs its held-out evaluations; the final eval/reward comes once, so it makes no curve.
        rows = [{"step": step, "heldout/reward": 0.1 * number + 0.01 * step} for step in (0, 5, 10)] + [
            {"step": 0, "eval/reward": 0.2 * number}
        ]
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        study.tell(trial, 0.2 * number)
    return study


def test_the_report_holds_the_local_reports_content_over_the_studys_runs(study):
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces import expr

    from tbexp.study.report_wandb import build_report

    report = build_report(study, top=2, project="sweeps", entity="me", group=STUDY)
    assert (report.title, report.project, report.entity) == (f"Sweep report: {STUDY}", "sweeps", "me")
    assert [type(b).__name__ for b in report.blocks] == [
        "MarkdownBlock",
        "H2",
        "PanelGrid",
        "H2",
        "PanelGrid",
        "H2",
        "MarkdownBlock",
    ]
    summary, _, study_grid, _, best_grid, _, table = report.blocks
    assert "Objective: `eval/reward`, maximised" in summary.text and "**Best: trial 2**" in summary.text
    assert (
        table.text.startswith("| trial | state | value |")
        and "| 3 | FAIL |" in table.text
        and "the job raised" in table.text
    )

    (runs,), (best,) = study_grid.runsets, best_grid.runsets
    assert _leaves(expr.expr_to_filters(runs.filters)) == [("=", "group", STUDY)]
    assert _leaves(expr.expr_to_filters(best.filters)) == [
        ("=", "group", STUDY),
        ("IN", "displayName", [f"{STUDY}/2", f"{STUDY}/1"]),
    ]
    assert {(r.entity, r.project) for r in (runs, best)} == {("me", "sweeps")}

    panels = {type(p).__name__: p for p in study_grid.panels}
    assert panels["ParameterImportancePlot"].with_respect_to == "eval/reward"
    assert panels["ScatterPlot"].y == wr.SummaryMetric("eval/reward")
    columns = [c.metric for c in panels["ParallelCoordinatesPlot"].columns]
    assert columns == [wr.Config("grpo.learning_rate"), wr.Config("model.lora_rank"), wr.SummaryMetric("eval/reward")]
    # The accessors the server gets: nested config keys as W&B stores them (`<key>.value.<rest>`).
    accessors = [c.accessor for c in panels["ParallelCoordinatesPlot"]._to_model().config.columns]
    assert accessors == ["config:grpo.value.learning_rate", "config:model.value.lora_rank", "summary:eval/reward"]
    for grid in (study_grid, best_grid):  # only the metric the jobs log over steps; eval/reward is logged once
        curves = [p for p in grid.panels if isinstance(p, wr.LinePlot)]
        assert [(p.x, p.y) for p in curves] == [("step", ["heldout/reward"])]


def test_the_command_saves_the_report_and_prints_its_url(study, tmp_path, monkeypatch, capsys):
    import wandb
    import wandb_workspaces.reports.v2 as wr

    from tbexp.study.report import main

    saved = []

    def save(report, draft=False, clone=False):  # stands in for the upload to W&B's server
        saved.append(report)
        report.id = "abc123"
        return report

    monkeypatch.setattr(
        wandb,
        "Api",
        lambda **_: SimpleNamespace(default_entity="me", _service_api=SimpleNamespace(app_url="https://wandb.example")),
    )
    monkeypatch.setattr(wr.Report, "save", save)
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    assert (
        main(
            [
                "--storage",
                f"sqlite:///{tmp_path}/optuna.db",
                "--study",
                STUDY,
                "--out",
                str(tmp_path / "report"),
                "--wandb",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'report' / 'report.md'}" in out
    assert f"W&B report: https://wandb.example/me/sweeps/reports/Sweep-report:-{STUDY}--abc123" in out
    (report,) = saved
    assert (report.project, report.entity) == ("sweeps", "me")  # the project from the jobs' logger config


def test_without_an_api_key_it_says_what_to_set_and_keeps_the_local_report(tmp_path, study):
    done = _report(
        tmp_path, NETRC=str(tmp_path / "no-netrc"), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_MODE="online"
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip().splitlines()[-1]
        == f"tbexp.report: no W&B report ({tmp_path / 'report' / 'report.md'} is written): no W&B API key: set WANDB_API_KEY (or run `wandb login`)"
    )
    assert "**Best: trial 2**" in (tmp_path / "report" / "report.md").read_text()


def test_without_the_network_it_says_so_in_one_line(tmp_path, study):
    # Port 9 of 127.0.0.1 is closed: a server that does not answer, found without waiting W&B's default 19 s.
    done = _report(
        tmp_path,
        "--wandb-project",
        "sweeps",
        WANDB_API_KEY="0" * 40,
        WANDB_BASE_URL="http://127.0.0.1:9",
        WANDB_HTTP_TIMEOUT="3",
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("tbexp.report: no W&B report (")
        and "could not log in to W&B (" in last
        and last.endswith("check the network, WANDB_BASE_URL and WANDB_API_KEY")
    )
    assert (tmp_path / "report" / "report.md").is_file()


def test_the_local_report_does_not_import_the_reports_api(tmp_path, study):
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    code = f"import sys; from tbexp.study.report import main; main(['--storage', 'sqlite:///{tmp_path}/optuna.db', '--study', '{STUDY}', '--out', '{tmp_path}/report']); print('wandb_workspaces' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_best_trials_are_found_by_the_run_name_tracking_gives_their_jobs(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from tbexp.jobs import tracking

    names = []

    class Recorder(tracking._Run):  # stands in for wandb.init: only the name tracking gives the run matters here
        def __init__(self, settings, run_dir, name, *rest):
            names.append(name)

    monkeypatch.setattr(tracking, "_Wandb", Recorder)
    job = tmp_path / "multirun" / STUDY / "7"
    tracking.Tracker(job, OmegaConf.create({"name": "wandb", "project": "sweeps"})).finish()
    assert names == [f"{STUDY}/7"]  # what report_wandb looks the best trials up by (tracking.run_name)


def _report(tmp_path, *args, **env):
    """The command a user types, with no W&B settings but `env`, and a home of its own (no ~/.netrc key)."""
    command = [
        sys.executable,
        "-m",
        "tbexp.report",
        "--storage",
        f"sqlite:///{tmp_path}/optuna.db",
        "--study",
        STUDY,
        "--out",
        str(tmp_path / "report"),
        *args,
    ]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}, "HOME": str(tmp_path), **env}
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def _leaves(tree) -> list[tuple]:
    """(op, key, value) of each condition of an AND filter tree (one condition comes as a leaf)."""
    return [(f.op, f.key.name, f.value) for f in (tree.filters if tree.op == "AND" else [tree])]
