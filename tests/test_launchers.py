"""Launcher configs, GPUs for local jobs, and stopping a loop on SLURM's signals (no cluster needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tbexp.jobs import launchers
from tbexp.jobs.preemption import interruptible
from tests.conftest import REPO, compose_config

# Inside pytest, Hydra's schema-matching warning (silenced by tbexp.jobs.launchers in real runs) is let through again.
pytestmark = pytest.mark.filterwarnings("ignore:(?s).*is validated against ConfigStore schema:UserWarning")


@pytest.mark.parametrize("launcher", ["submitit_slurm", "submitit_local"])
def test_launcher_configs_compose_with_tbexp_defaults(launcher):
    cfg = _hydra_launcher(launcher, "hydra.launcher.timeout_min=30")
    assert cfg._target_.endswith("SlurmLauncher" if launcher == "submitit_slurm" else "LocalLauncher")
    assert cfg.timeout_min == 30
    if launcher == "submitit_slurm":
        assert cfg.max_num_timeout == 3 and cfg.additional_parameters == {"requeue": True}
        assert (
            _hydra_launcher(launcher, "hydra.launcher.partition=gpu", "hydra.launcher.account=lab").partition == "gpu"
        )


def test_a_misspelt_launcher_key_is_refused_without_hydras_deprecation_warning():
    ok = subprocess.run(
        [sys.executable, "-m", "tbexp", "hydra/launcher=submitit_slurm", "--cfg", "hydra"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        ok.returncode == 0 and "deprecated" not in ok.stderr
    )  # tbexp.jobs.launchers silences the schema-matching warning
    typo = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbexp",
            "hydra/launcher=submitit_slurm",
            "hydra.launcher.partiton=gpu",
            "--cfg",
            "hydra",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert typo.returncode != 0 and "partiton" in typo.stderr


def _hydra_launcher(launcher: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", overrides=[f"hydra/launcher={launcher}", *overrides], return_hydra_config=True)
    return cfg.hydra.launcher


def test_local_jobs_get_their_own_gpus():
    gpus = ["0", "1", "2", "3"]
    assert [launchers.devices_for_job(n, gpus, 1) for n in range(5)] == [["0"], ["1"], ["2"], ["3"], ["0"]]
    assert [launchers.devices_for_job(n, gpus, 2) for n in range(3)] == [["0", "1"], ["2", "3"], ["0", "1"]]
    assert launchers.devices_for_job(0, gpus, 0) == [] and launchers.devices_for_job(1, [], 1) == []


def test_a_submitit_local_job_moves_off_gpu_0(monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what submitit gives every job with gpus_per_node=1
    monkeypatch.setenv("TBEXP_GPUS", "4,5,6")
    assert launchers.assign_local_job_gpus(job_num=4) == ["5"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"


@pytest.mark.parametrize("executor, visible", [("slurm", "0"), ("local", ""), ("", "0")])
def test_slurm_cpu_and_plain_jobs_are_left_alone(monkeypatch, executor, visible):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", executor)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setenv("TBEXP_GPUS", "0,1")
    assert launchers.assign_local_job_gpus(job_num=1) is None
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible


def test_a_signal_mid_step_checkpoints_after_the_step_and_goes_to_the_previous_handler():
    handed = []

    def submitits(signum, frame):  # stands in for submitit's handler, which requeues the job and exits
        handed.append(signum)

    previous = signal.signal(signal.SIGUSR2, submitits)
    done, saved = [], []
    try:
        with pytest.raises(SystemExit) as stop:
            for step in interruptible(range(10), checkpoint=saved.append):
                if step == 3:
                    os.kill(os.getpid(), signal.SIGUSR2)  # arrives in the middle of step 3
                done.append(step)
        assert done == [0, 1, 2, 3] and saved == [3]  # step 3 finished, was saved, and nothing after it ran
        assert handed == [signal.SIGUSR2] and stop.value.code == 128 + signal.SIGUSR2
        assert signal.getsignal(signal.SIGUSR2) is submitits  # restored
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_without_a_signal_the_loop_runs_through_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    assert list(interruptible(range(5), checkpoint=lambda step: pytest.fail("no signal, no checkpoint"))) == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_without_a_python_handler_exits_after_the_checkpoint():
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    saved = []
    try:
        with pytest.raises(SystemExit) as stop:
            for step in interruptible(range(10), checkpoint=saved.append):
                if step == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
        assert saved == [1] and stop.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.slow
def test_submitit_local_jobs_run_on_different_gpus(rootfs, tmp_path):
    # No GPU is needed: the jobs only record what they were given (a CPU-only torch ignores the variable).
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbexp",
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.gpus_per_node=1",
            f"hydra.sweep.dir={tmp_path}",
            "stage=eval",
            "policy=nop",
            "tasks.limit=1",
            "eval.n_runs=1",
            "seed=0,1,2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TBEXP_GPUS": "4,5"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    given = [(tmp_path / str(job) / "__main__.log").read_text() for job in range(3)]
    assert [f"CUDA_VISIBLE_DEVICES={gpu}" in log for log, gpu in zip(given, ["4", "5", "4"])] == [True, True, True]


@pytest.fixture
def sft_data(tmp_path) -> Path:
    """Raw-command rows, so SFT needs no sandbox: 24 prompts over a few names."""
    rows = [
        {
            "prompt": f"Count the {level} lines of service {service} in /app/{log} and write the number to /app/count.txt",
            "completion": f"grep -c ' {level} {service}:' /app/{log} > /app/count.txt",
        }
        for level in ("ERROR", "WARN", "INFO")
        for service in ("auth", "db", "api", "web")
        for log in ("app.log", "server.log")
    ]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_sft_checkpoints_on_sigterm_and_a_hard_kill_redoes_steps_only_once(sft_data, tmp_path, monkeypatch):
    from tbexp.job import Job
    from tbexp.stages import sft as sft_stage

    real_batch = sft_stage.epoch_batch
    cfg = compose_config(
        "stage=sft",
        f"sft.data={sft_data}",
        "sft.steps=12",
        "sft.eval_every=5",
        "sft.batch_size=4",
        "sft.patience=0",
        "sft.warmup_steps=1",
    )
    monkeypatch.chdir(tmp_path)

    def interrupt_at(index: int, interruption):
        def batch(train, step, batch_size, seed):
            if step == index:
                interruption()
            return real_batch(train, step, batch_size, seed)

        monkeypatch.setattr(sft_stage, "epoch_batch", batch)

    interrupt_at(2, lambda: os.kill(os.getpid(), signal.SIGTERM))  # SLURM's requeue, during step 3
    with pytest.raises(SystemExit):
        sft_stage.train(Job(cfg), sft_data, tmp_path)
    state = json.loads((tmp_path / "sft_state.json").read_text())
    assert state["step"] == 3 and state["resume_checkpoint"].endswith("step-00003")  # step 3 finished and was saved

    def killed():
        raise KeyboardInterrupt  # no warning: steps 6-8 are lost after the step-5 checkpoint

    interrupt_at(8, killed)
    with pytest.raises(KeyboardInterrupt):
        sft_stage.train(Job(cfg), sft_data, tmp_path)
    monkeypatch.setattr(sft_stage, "epoch_batch", real_batch)
    sft_stage.train(Job(cfg), sft_data, tmp_path)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in rows if "train/nll" in r) == Counter(range(1, 13))  # every step once
    assert [e["step"] for e in json.loads((tmp_path / "sft_state.json").read_text())["evals"]] == [5, 10, 12]
