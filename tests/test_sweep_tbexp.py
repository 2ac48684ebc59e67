"""tbexp itself under the Optuna sweeper: a cheap eval-stage study, and the smoke sweep the README shows."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState

from tbexp.study.storage import JOB_DIR_ATTR, open_storage
from tests.conftest import REPO


def tbexp_sweep(tmp_path, storage: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "tbexp",
        "-m",
        *overrides,
        f"hydra.sweep.dir={tmp_path}/multirun",
        f"hydra.sweeper.storage='{storage}'",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_oracle_eval_study_through_a_sweep_file_on_the_search_path(tmp_path, rootfs):
    """A sweep file outside sweeps/ (hydra.searchpath), over a harmless key; every trial scores the oracle."""
    (tmp_path / "extra" / "sweep").mkdir(parents=True)
    (tmp_path / "extra" / "sweep" / "oracle_eval.yaml").write_text(
        textwrap.dedent("""\
        # @package _global_
        # python -m tbexp -m hydra.searchpath=[file://DIR] +sweep=oracle_eval
        defaults:
          - override /stage: eval
          - override /hydra/sweeper: tbexp_optuna
        policy: oracle
        tasks: {limit: 2}
        eval: {n_runs: 1}
        hydra:
          sweeper:
            study_name: oracle_eval
            n_trials: 2
            n_jobs: 2
            sampler: {name: grid}
            params:
              eval.concurrency: {type: categorical, choices: [1, 2]}
        """)
    )
    storage = str(tmp_path / "studies.journal")
    tbexp_sweep(tmp_path, storage, f"hydra.searchpath=[file://{tmp_path}/extra]", "+sweep=oracle_eval")
    trials = optuna.load_study(study_name="oracle_eval", storage=open_storage(storage)).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 and [t.value for t in trials] == [1.0, 1.0]
    assert sorted(t.params["eval.concurrency"] for t in trials) == [1, 2]
    for t in trials:
        job = OmegaConf.load(f"{t.user_attrs[JOB_DIR_ATTR]}/.hydra/config.yaml")
        assert (job.trial.number, job.trial.study, job.trial.storage, job.eval.concurrency) == (
            t.number,
            "oracle_eval",
            storage,
            t.params["eval.concurrency"],
        )


@pytest.mark.slow
def test_smoke_sweep_end_to_end_with_report(tmp_path, rootfs):
    """`python -m tbexp -m +sweep=smoke`: six SFT trials, two at a time, NLL reported for pruning, reward objective."""
    storage = f"sqlite:///{tmp_path}/optuna.db"
    done = tbexp_sweep(tmp_path, storage, "+sweep=smoke", timeout=900)
    study = optuna.load_study(study_name="smoke", storage=open_storage(storage))
    states = [t.state for t in study.trials]
    assert len(states) == 6 and set(states) <= {TrialState.COMPLETE, TrialState.PRUNED}, done.stdout[-3000:]
    for t in study.trials:
        assert t.intermediate_values and all(v < 0 for v in t.intermediate_values.values())  # -NLL in a maximised study
        if t.state == TrialState.COMPLETE:
            assert 0.0 <= t.value <= 1.0 and math.isfinite(t.value)
    report = subprocess.run(
        [sys.executable, "-m", "tbexp.report", f"{tmp_path}/multirun"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr
    report_md = (tmp_path / "multirun" / "report" / "report.md").read_text()
    assert (
        "](curves.png)" in report_md and "](history.png)" in report_md
    )  # SFT's eval/nll over steps, from metrics.jsonl
