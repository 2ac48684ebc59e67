"""The eval stage end to end: the oracle solves every built-in task, nop none, in real sandboxes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tbexp.stages import eval as eval_stage
from tests.conftest import REPO, compose_job, make_task

METRICS = ("eval/reward", "eval/strict_success", "eval/pass@1", "eval/pass@1_stderr", "eval/valid_command_rate", "eval/avg_turns")
SANDBOXES = ["bwrap", pytest.param("docker", marks=[pytest.mark.docker, pytest.mark.slow])]


def _eval(tmp_path, monkeypatch, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    metrics = eval_stage.run(compose_job("eval.concurrency=4", *overrides))
    rows = list(csv.DictReader((tmp_path / "tasks.csv").open()))
    return metrics, rows


@pytest.fixture(params=SANDBOXES)
def sandbox(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return request.param


@pytest.mark.parametrize("split", ["heldout", "train"])
def test_oracle_solves_every_builtin_task(split, sandbox, tmp_path, monkeypatch):
    metrics, rows = _eval(tmp_path, monkeypatch, f"sandbox={sandbox}", "policy=oracle", f"tasks.split={split}", "eval.n_runs=1")
    unsolved = [r["task"] for r in rows if int(r["strict"]) != int(r["runs"])]
    assert not unsolved, f"the oracle failed {unsolved}"
    assert metrics["eval/strict_success"] == 1.0 and metrics["eval/reward"] == 1.0 and metrics["eval/invalid_episodes"] == 0
    assert metrics["eval/valid_command_rate"] == 1.0


@pytest.mark.parametrize("split", ["heldout", "train"])
def test_nop_solves_nothing(split, sandbox, tmp_path, monkeypatch):
    metrics, rows = _eval(tmp_path, monkeypatch, f"sandbox={sandbox}", "policy=nop", f"tasks.split={split}", "eval.n_runs=1")
    assert all(int(r["strict"]) == 0 for r in rows)
    assert all(float(r["reward"]) < 1.0 for r in rows)
    assert metrics["eval/strict_success"] == 0.0 and metrics["eval/invalid_episodes"] == 0


def test_eval_command_writes_the_run_directory(rootfs, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "tbexp", "stage=eval", f"hydra.run.dir={run_dir}", "tasks.limit=6", "eval.n_runs=2"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(isinstance(summary[k], float) for k in METRICS)
    assert summary["eval/pass@1"] == 1.0 and summary["eval/episodes"] == 12.0
    assert (run_dir / "eval.png").stat().st_size > 1000 and (run_dir / "tasks.csv").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval/strict_success"] == 1.0
    assert list((run_dir / "episodes").glob("*.json")) and (run_dir / ".hydra" / "config.yaml").exists()
    assert "eval/strict_success" in out.stdout  # the table is printed


def test_pass_at_1_stderr_is_over_runs(rootfs, tmp_path, monkeypatch):
    # A task whose test passes on about half the runs: the runs disagree, so the standard error is positive.
    tasks = tmp_path / "tasks"
    make_task(tasks, "coin", solution="echo $((RANDOM % 2)) > /app/coin.txt\n", tests="from pathlib import Path\ndef test_a():\n    assert True\ndef test_b():\n    assert True\ndef test_heads():\n    assert Path('/app/coin.txt').read_text().strip() == '1'\n")
    metrics, rows = _eval(tmp_path / "run", monkeypatch, "tasks=dir", f"tasks.path={tasks}", "eval.n_runs=12")
    assert 0.0 < metrics["eval/pass@1"] < 1.0 and metrics["eval/pass@1_stderr"] > 0.0
    assert metrics["eval/reward"] == pytest.approx(2 / 3 + metrics["eval/pass@1"] / 3)


def test_task_dir_without_tests_is_refused_naming_the_file(tmp_path):
    tasks = tmp_path / "tasks"
    broken = make_task(tasks, "no-tests")
    (broken / "tests" / "test.sh").unlink()
    out = subprocess.run([sys.executable, "-m", "tbexp", "stage=eval", "tasks=dir", f"tasks.path={tasks}", f"hydra.run.dir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{broken}/tests/test.sh: missing" in out.stderr


def test_broken_task_toml_is_refused_naming_the_file(tmp_path):
    tasks = tmp_path / "tasks"
    broken = make_task(tasks, "bad-toml")
    (broken / "task.toml").write_text("[task\nname = 'x'\n")
    out = subprocess.run([sys.executable, "-m", "tbexp", "stage=eval", "tasks=dir", f"tasks.path={tasks}", f"hydra.run.dir={tmp_path}/run"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{broken}/task.toml: broken TOML" in out.stderr
