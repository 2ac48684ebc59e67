"""The Optuna sweeper end to end, on a Hydra app whose jobs cost nothing (tests/sweep_app).

Each test runs `python -m tests.sweep_app.app -m ...` as a user would and then
reads the study back from its storage: sqlite, Optuna's journal file and a real
PostgreSQL server, two trials at a time; no batch barrier; failing, NaN,
killed and timed-out jobs; pruning in the jobs; a sweeper killed with SIGKILL
and restarted; grids over an ordered pair; job directories never reused; the
report; hydra-submitit-launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from tbexp.study.storage import (
    FAIL_REASON_ATTR,
    INTERRUPTED_ATTR,
    JOB_DIR_ATTR,
    PRUNED_AT_ATTR,
    RETRY_OF_ATTR,
    open_storage,
)
from tests.conftest import REPO
from tests.postgres_service import postgres_url  # noqa: F401

APP = "tests.sweep_app.app"


def sweep(
    tmp_path: Path,
    *overrides: str,
    storage: str | None = None,
    config_name: str = "",
    timeout: int = 300,
    check: bool = True,
    script: bool = False,
) -> subprocess.CompletedProcess:
    storage = storage or f"sqlite:///{tmp_path}/optuna.db"
    entry = [str(REPO / "tests" / "sweep_app" / "app.py")] if script else ["-m", APP]
    command = [
        sys.executable,
        *entry,
        *(["--config-name", config_name] if config_name else []),
        "-m",
        f"hydra.sweep.dir={tmp_path}/multirun",
        f"hydra.sweeper.storage='{storage}'",
        *overrides,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def load(storage: str, name: str = "app") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def overlapped(trials) -> bool:
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    return any(later_start < end for (_, end), (later_start, _) in zip(spans, spans[1:]))


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """The process has exited (a zombie waiting for init to reap it counts as gone)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def ran_once_each(tmp_path: Path, trials) -> None:
    """Every trial had its own job directory, run exactly once."""
    dirs = [t.user_attrs[JOB_DIR_ATTR] for t in trials]
    assert len(set(dirs)) == len(dirs)
    for t in trials:
        lines = (Path(t.user_attrs[JOB_DIR_ATTR]) / "ran.txt").read_text().splitlines()
        assert [line.split()[0] for line in lines] == [str(t.number)], (t.number, lines)


def check_two_at_a_time(tmp_path: Path, storage: str, name: str = "app") -> optuna.Study:
    sweep(
        tmp_path,
        "hydra.sweeper.n_trials=4",
        "steps=2",
        "sleep_s=0.5",
        f"hydra.sweeper.study_name={name}",
        storage=storage,
    )
    study = load(storage, name)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4
    assert overlapped(study.trials), "n_jobs=2 should run two trials at once"
    assert all(len(t.intermediate_values) == 2 for t in study.trials)  # the jobs reported through the storage
    ran_once_each(tmp_path, study.trials)
    assert (tmp_path / "multirun" / "optimization_results.yaml").exists() and (
        tmp_path / "multirun" / "study.yaml"
    ).exists()
    return study


def test_two_trials_at_a_time_on_sqlite(tmp_path):
    check_two_at_a_time(tmp_path, f"sqlite:///{tmp_path}/optuna.db")


def test_two_trials_at_a_time_on_a_journal_file(tmp_path):
    check_two_at_a_time(tmp_path, str(tmp_path / "studies.journal"))


def test_two_trials_at_a_time_on_postgresql(tmp_path, postgres_url):  # noqa: F811
    check_two_at_a_time(tmp_path, postgres_url, name=f"app-{tmp_path.name}")


def test_a_new_trial_starts_as_soon_as_one_ends(tmp_path):
    sweep(tmp_path, "hydra.sweeper.n_trials=4", "slow_on=[0]", "slow_s=15")
    trials = load(f"sqlite:///{tmp_path}/optuna.db").trials
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert max(t.datetime_complete for t in trials[1:]) < trials[0].datetime_complete, (
        "trials 1-3 should not wait for the slow trial 0"
    )


def test_failed_nan_killed_and_timed_out_trials_fail_and_the_sweep_goes_on(tmp_path):
    done = sweep(
        tmp_path,
        "hydra.sweeper.n_trials=5",
        "raise_on=[0]",
        "nan_on=[1]",
        "kill_on=[2]",
        "hang_on=[3]",
        "hydra.sweeper.trial_timeout_s=5",
    )
    trials = load(f"sqlite:///{tmp_path}/optuna.db").trials
    assert [t.state for t in trials] == [TrialState.FAIL] * 4 + [TrialState.COMPLETE]
    reasons = [t.user_attrs[FAIL_REASON_ATTR] for t in trials[:4]]
    assert "RuntimeError: trial 0 raises on purpose" in reasons[0]
    assert "not a finite number" in reasons[1] and "no valid episode" in reasons[1]  # a NaN objective says why
    assert "SIGKILL" in reasons[2]
    assert "timed out after 5 s" in reasons[3]
    assert "raises on purpose" in done.stdout + done.stderr  # the failed job's output is shown
    hung = (Path(trials[3].user_attrs[JOB_DIR_ATTR]) / "ran.txt").read_text().split()[1]
    assert gone(int(hung)), "the timed-out job must be killed"


def test_median_pruning_ends_jobs_early(tmp_path):
    sweep(
        tmp_path,
        "hydra.sweeper.n_trials=8",
        "steps=4",
        "hydra.sweeper.pruner.name=median",
        "hydra.sweeper.pruner.n_startup_trials=2",
    )
    trials = load(f"sqlite:///{tmp_path}/optuna.db").trials
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    assert pruned and not [t for t in trials if t.state == TrialState.FAIL]
    for t in pruned:
        assert len(t.intermediate_values) < 4 and t.user_attrs[PRUNED_AT_ATTR] == t.last_step
    assert all(len(t.intermediate_values) == 4 for t in trials if t.state == TrialState.COMPLETE)


def test_hyperband_pruner_is_rebuilt_in_the_jobs(tmp_path):
    storage = str(tmp_path / "studies.journal")
    sweep(
        tmp_path,
        "hydra.sweeper.n_trials=8",
        "steps=4",
        "hydra.sweeper.pruner.name=hyperband",
        "hydra.sweeper.pruner.max_resource=4",
        "hydra.sweeper.pruner.reduction_factor=2",
        storage=storage,
    )
    study = load(storage)
    assert study.user_attrs["tbexp:pruner"]["name"] == "hyperband"
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)
    # Random search (seed 0) draws trials 3-7 worse than an earlier one of their bracket: successive halving stops
    # them at a rung (steps 1 or 2 of 0-3), in the job that reported the value; a pruner that never prunes fails here.
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert len(pruned) >= 2, [(t.number, t.state.name, len(t.intermediate_values)) for t in study.trials]
    for t in pruned:
        assert t.last_step in (1, 2) and t.user_attrs[PRUNED_AT_ATTR] == t.last_step
    assert all(len(t.intermediate_values) == 4 for t in study.trials if t.state == TrialState.COMPLETE)


def test_killed_sweeper_resumes_without_losing_or_repeating_trials(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    args = ["hydra.sweeper.n_trials=6", "steps=3", "sleep_s=1"]
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            APP,
            "-m",
            f"hydra.sweep.dir={tmp_path}/multirun",
            f"hydra.sweeper.storage='{storage}'",
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "multirun" / "2" / "ran.txt").exists():  # trials 0 and 1 done or nearly, 2 running
        assert first.poll() is None and time.monotonic() < deadline, (
            first.stdout.read() if first.poll() is not None else "timed out"
        )
        time.sleep(0.2)
    jobs = [
        int(pid)
        for pid in subprocess.run(["pgrep", "-P", str(first.pid)], capture_output=True, text=True).stdout.split()
    ]
    first.send_signal(signal.SIGKILL)
    first.wait()
    before = load(storage).trials
    running = [t for t in before if t.state == TrialState.RUNNING]
    assert running, "the sweeper should have died with trials running"
    assert jobs and all(gone(pid) for pid in jobs), "the jobs must die with their sweeper (PR_SET_PDEATHSIG)"

    done = sweep(tmp_path, *args)
    trials = load(storage).trials
    interrupted = [t for t in trials if t.state == TrialState.FAIL and t.user_attrs.get(INTERRUPTED_ATTR)]
    assert {t.number for t in interrupted} == {t.number for t in running}
    assert len([t for t in trials if t.state == TrialState.COMPLETE]) == 6 and len(trials) == 6 + len(interrupted)
    retries = {t.user_attrs[RETRY_OF_ATTR]: t for t in trials if RETRY_OF_ATTR in t.user_attrs}
    assert set(retries) == {t.number for t in interrupted}  # nothing lost ...
    for t in interrupted:
        assert retries[t.number].params == t.params and retries[t.number].state == TrialState.COMPLETE
    finished_before = [t for t in before if t.state == TrialState.COMPLETE]
    assert all(t.number not in retries for t in finished_before)  # ... nothing repeated
    ran_once_each(tmp_path, [t for t in trials if t.number not in {i.number for i in interrupted}])
    job_dirs = {t.number: int(Path(t.user_attrs[JOB_DIR_ATTR]).name) for t in trials if JOB_DIR_ATTR in t.user_attrs}
    assert all(number == job for number, job in job_dirs.items()), "job numbering continues after the study's trials"
    assert all(
        t.number in job_dirs for t in trials if t not in interrupted
    )  # none only where the kill came before the job's directory was known
    assert "orphaned, re-queued" in done.stdout + done.stderr


def test_grid_runs_each_feasible_ordered_pair_once(tmp_path):
    sweep(tmp_path, config_name="bounds")
    trials = load(f"sqlite:///{tmp_path}/optuna.db", "bounds").trials
    assert all(t.state == TrialState.COMPLETE for t in trials)  # the app raises on lo >= hi
    pairs = sorted((round(t.params["lo"], 6), round(t.params["hi"], 6)) for t in trials)
    assert pairs == [(0.0, 0.3), (0.0, 0.6), (0.0, 0.9), (0.3, 0.6), (0.3, 0.9), (0.6, 0.9)]


def test_a_new_study_in_an_old_sweep_directory_does_not_overwrite_its_jobs(tmp_path):
    for n in (0, 1):
        (tmp_path / "multirun" / str(n)).mkdir(parents=True)
        (tmp_path / "multirun" / str(n) / "ran.txt").write_text(f"old {n}\n")
    sweep(tmp_path, "hydra.sweeper.n_trials=2", "hydra.sweeper.study_name=fresh")
    trials = load(f"sqlite:///{tmp_path}/optuna.db", "fresh").trials
    assert sorted(Path(t.user_attrs[JOB_DIR_ATTR]).name for t in trials) == ["2", "3"]
    assert [(tmp_path / "multirun" / str(n) / "ran.txt").read_text() for n in (0, 1)] == ["old 0\n", "old 1\n"]


def test_a_script_app_runs_too(tmp_path):
    sweep(tmp_path, "hydra.sweeper.n_trials=2", script=True)
    assert [t.state for t in load(f"sqlite:///{tmp_path}/optuna.db").trials] == [TrialState.COMPLETE] * 2


def test_command_line_sweeps_are_refused(tmp_path):
    done = sweep(tmp_path, "steps=1,2", check=False)
    assert done.returncode != 0 and "takes its search space from the sweep file" in done.stderr


def test_a_config_that_does_not_compose_stops_the_sweep_without_spending_budget(tmp_path):
    done = sweep(tmp_path, "hydra.sweeper.trial_key=nowhere", check=False)
    assert done.returncode != 0 and "does not compose" in done.stderr and "nowhere" in done.stderr
    trials = load(f"sqlite:///{tmp_path}/optuna.db").trials
    assert trials and all(t.state == TrialState.FAIL and t.user_attrs.get(INTERRUPTED_ATTR) for t in trials)


def test_report_from_local_data(tmp_path):
    sweep(tmp_path, "hydra.sweeper.n_trials=5", "steps=3", "nan_on=[4]")
    done = subprocess.run(
        [sys.executable, "-m", "tbexp.report", str(tmp_path / "multirun")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "multirun" / "report"
    text = (out / "report.md").read_text()
    for image in ("history.png", "importances.png", "parallel_coordinates.png", "intermediate.png", "curves.png"):
        assert f"]({image})" in text and (out / image).stat().st_size > 1000, image
    assert "| 4 | FAIL |" in text and "not a finite number" in text
    assert "**Best: trial" in text


def test_report_curves_find_a_pipeline_jobs_steps_in_its_stage_folder(tmp_path):
    """A pipeline job's own metrics.jsonl holds one row of results; GRPO's held-out curve is in grpo/metrics.jsonl."""
    from tbexp.study.queries import metric_series

    (tmp_path / "grpo").mkdir()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "rl/eval/reward": 0.5}) + "\n")
    (tmp_path / "grpo" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "heldout/reward": r}) + "\n" for s, r in ((0, 0.4), (4, 0.5), (8, 0.45)))
    )
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 3, "heldout/reward": 0.1}) + "\n")
    assert metric_series(str(tmp_path), "heldout/reward") == [(0, 0.4), (4, 0.5), (8, 0.45)]
    assert metric_series(str(tmp_path), "rl/eval/reward") == [(0, 0.5)]
    assert metric_series(str(tmp_path), "eval/nll") == [] and metric_series("", "heldout/reward") == []


@pytest.mark.skipif(
    not os.path.isdir(Path(optuna.__file__).parents[1] / "hydra_plugins" / "hydra_submitit_launcher"),
    reason="hydra-submitit-launcher is not installed",
)
def test_submitit_local_launcher_runs_trials_side_by_side(tmp_path):
    sweep(
        tmp_path,
        "hydra/launcher=submitit_local",
        "hydra.sweeper.n_trials=3",
        "steps=2",
        "sleep_s=1",
        "hydra.sweeper.pruner.name=median",
        "hydra.sweeper.pruner.n_startup_trials=5",
    )
    trials = load(f"sqlite:///{tmp_path}/optuna.db").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert overlapped(trials) and all(len(t.intermediate_values) == 2 for t in trials)
