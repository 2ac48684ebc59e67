"""hydra/launcher=submitit_slurm against a real one-node SLURM cluster that the tests start.

The jobs run this checkout's `python -m tbexp` with the venv's interpreter
(submitit submits `sys.executable`; the SLURM job inherits the environment).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm_service import jobs_named, release_requeued, slurm_cluster  # noqa: F401
from tests.test_launchers import sft_data  # noqa: F401

pytestmark = pytest.mark.slow
JOB_TIMEOUT_S = 600


def _tbexp(*args: str, timeout_s: float = JOB_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tbexp", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )


def _slurm(sweep_dir: Path, name: str) -> list[str]:
    # One CPU per job so that two fit on a two-core node at once.
    return [
        "hydra/launcher=submitit_slurm",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.launcher.name={name}",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=20",
    ]


def test_multirun_through_slurm_completes(slurm_cluster, rootfs, tmp_path):
    done = _tbexp(
        "-m",
        "stage=eval",
        "policy=oracle",
        "tasks.limit=2",
        "eval.n_runs=1",
        "seed=0,1",
        *_slurm(tmp_path, f"tbexp-test-{os.getpid()}"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert summary["eval/strict_success"] == 1.0  # the oracle solves both tasks
        assert (tmp_path / job / ".hydra" / "overrides.yaml").read_text().count(f"seed={job}") == 1
    assert len(list((tmp_path / ".submitit").iterdir())) >= 2  # submitted as SLURM jobs, not run in this process


def test_optuna_sweep_through_slurm_completes(slurm_cluster, rootfs, tmp_path):
    if not (REPO / "hydra_plugins" / "tbexp_optuna_sweeper").is_dir() or not (REPO / "sweeps" / "smoke.yaml").exists():
        pytest.skip(
            "the Optuna sweeper plugin (hydra_plugins/tbexp_optuna_sweeper, sweeps/smoke.yaml) is not in this checkout"
        )
    storage = f"sqlite:///{tmp_path}/optuna.db"
    done = _tbexp(
        "-m",
        "+sweep=smoke",
        "hydra.sweeper.n_trials=2",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=slurm-smoke",
        *_slurm(tmp_path, f"tbexp-test-{os.getpid()}"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    import optuna

    study = optuna.load_study(study_name="slurm-smoke", storage=storage)
    states = Counter(t.state.name for t in study.trials)
    assert sum(states.values()) == 2 and states["COMPLETE"] + states["PRUNED"] == 2, states
    assert len(list((tmp_path / ".submitit").iterdir())) >= 2


# scontrol requeue: SIGTERM, SLURM requeues the job. USR2: SLURM's warning before the time limit (sent here with
# scancel --signal); submitit's handler requeues the job itself.
@pytest.mark.parametrize("interruption, signal_name", [("requeue", "SIGTERM"), ("time-limit warning", "SIGUSR2")])
def test_requeued_sft_job_resumes_and_runs_every_step_once(
    slurm_cluster, sft_data, tmp_path, interruption, signal_name
):
    steps, eval_every = 160, 7  # evaluations at 7, 14, ...: the interruption lands between two of them
    name = f"tbexp-requeue-{os.getpid()}"
    sweep = tmp_path / "sweep"
    run = sweep / "0"
    output = tmp_path / "launcher.log"  # a file, not a pipe: nobody reads while it waits for the job
    with output.open("w") as out:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tbexp",
                "-m",
                "stage=sft",
                f"sft.data={sft_data}",
                f"sft.steps={steps}",
                f"sft.eval_every={eval_every}",
                "sft.batch_size=8",
                "sft.patience=0",
                "sft.warmup_steps=2",
                "seed=0",
                *_slurm(sweep, name),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        job = _wait_for_training(run, name, at_least_steps=10, launcher=launcher, output=output)
        if interruption == "requeue":
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        else:
            subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        release_requeued(job)
        launcher.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            subprocess.run(["scancel", "-n", name], timeout=30)
    assert launcher.returncode == 0, output.read_text()[-3000:]

    state = json.loads((run / "sft_state.json").read_text())
    assert state["step"] == steps
    assert [e["step"] for e in state["evals"]] == [*range(eval_every, steps, eval_every), steps]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = Counter(r["step"] for r in rows if "train/nll" in r)
    assert sorted(trained) == list(range(1, steps + 1)) and set(trained.values()) == {1}, (
        "a step was skipped or done twice"
    )
    assert Counter(r["step"] for r in rows if "eval/nll" in r) == Counter({e["step"]: 1 for e in state["evals"]})
    logs = "".join(p.read_text() for p in run.glob("*.log"))  # the job's log, appended to by both runs
    assert logs.count(f"{signal_name}: the step in progress is done; saving a checkpoint") == 1, (
        f"the job did not checkpoint on {signal_name}"
    )
    assert logs.count("sft: resuming after step") == 1
    assert (run / "summary.json").exists()


def _wait_for_training(
    run: Path, name: str, at_least_steps: int, launcher: subprocess.Popen, output: Path, timeout_s: float = 300
) -> str:
    """The SLURM job id once the job has trained `at_least_steps` steps."""
    deadline = time.monotonic() + timeout_s
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher ended before training got going:\n{output.read_text()[-3000:]}")
        done = sum(1 for line in metrics.read_text().splitlines() if '"train/nll"' in line) if metrics.exists() else 0
        jobs = jobs_named(name)
        if done >= at_least_steps and jobs:
            return jobs[0][0]
        time.sleep(0.2)
    raise AssertionError(f"no {at_least_steps} training steps within {timeout_s} s; jobs: {jobs_named(name)}")
