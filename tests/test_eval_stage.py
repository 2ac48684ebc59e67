"""The eval stage end to end: the oracle solves every built-in task, nop none, in real sandboxes."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from tbexp.stages import eval as eval_stage
from tests.conftest import REPO, compose_job, make_task

METRICS = (
    "eval/reward",
    "eval/strict_success",
    "eval/pass@1",
    "eval/pass@1_stderr",
    "eval/valid_command_rate",
    "eval/avg_turns",
)
SANDBOXES = ["bwrap", pytest.param("docker", marks=[pytest.mark.docker, pytest.mark.slow])]


def _eval(tmp_path, monkeypatch, *overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(tmp_path)
    metrics = eval_stage.run(compose_job("eval.concurrency=4", *overrides))
    rows = list(csv.DictReader((tmp_path / "tasks.csv").open()))
    return metrics, rows


def _tasks(split: str, sandbox: str) -> list[str]:
    """Every built-in task of `split`; in Docker, 8 of each train family: bwrap checks all 400 train tasks, and in
    Docker each task is an image of its own to build (the 400 took about a third of the suite's time there)."""
    return [f"tasks.split={split}", *(["tasks.train_per_family=8"] if sandbox == "docker" else [])]


@pytest.fixture(params=SANDBOXES)
def sandbox(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return request.param


@pytest.mark.parametrize("split", ["heldout", "train"])
def test_oracle_solves_every_builtin_task(split, sandbox, tmp_path, monkeypatch):
    metrics, rows = _eval(
        tmp_path, monkeypatch, f"sandbox={sandbox}", "policy=oracle", *_tasks(split, sandbox), "eval.n_runs=1"
    )
    unsolved = [r["task"] for r in rows if int(r["strict"]) != int(r["runs"])]
    assert not unsolved, f"the oracle failed {unsolved}"
    assert (
        metrics["eval/strict_success"] == 1.0
        and metrics["eval/reward"] == 1.0
        and metrics["eval/invalid_episodes"] == 0
    )
    assert metrics["eval/valid_command_rate"] == 1.0


@pytest.mark.parametrize("split", ["heldout", "train"])
def test_nop_solves_nothing(split, sandbox, tmp_path, monkeypatch):
    metrics, rows = _eval(
        tmp_path, monkeypatch, f"sandbox={sandbox}", "policy=nop", *_tasks(split, sandbox), "eval.n_runs=1"
    )
    assert all(int(r["strict"]) == 0 for r in rows)
    assert all(float(r["reward"]) < 1.0 for r in rows)
    assert metrics["eval/strict_success"] == 0.0 and metrics["eval/invalid_episodes"] == 0


def test_eval_command_writes_the_run_directory(rootfs, tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", "stage=eval", f"hydra.run.dir={run_dir}", "tasks.limit=6", "eval.n_runs=2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    make_task(
        tasks,
        "coin",
        solution="echo $((RANDOM % 2)) > /app/coin.txt\n",
        tests="from pathlib import Path\ndef test_a():\n    assert True\ndef test_b():\n    assert True\ndef test_heads():\n    assert Path('/app/coin.txt').read_text().strip() == '1'\n",
    )
    metrics, rows = _eval(tmp_path / "run", monkeypatch, "tasks=dir", f"tasks.path={tasks}", "eval.n_runs=12")
    assert 0.0 < metrics["eval/pass@1"] < 1.0 and metrics["eval/pass@1_stderr"] > 0.0
    assert metrics["eval/reward"] == pytest.approx(2 / 3 + metrics["eval/pass@1"] / 3)


def _eval_dir(tasks, tmp_path) -> subprocess.CompletedProcess:
    """`python -m tbexp stage=eval` on a directory of tasks, as a user runs it."""
    command = [
        sys.executable,
        "-m",
        "tbexp",
        "stage=eval",
        "tasks=dir",
        f"tasks.path={tasks}",
        f"hydra.run.dir={tmp_path}/run",
    ]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_task_dir_without_tests_is_refused_naming_the_file(tmp_path):
    tasks = tmp_path / "tasks"
    broken = make_task(tasks, "no-tests")
    (broken / "tests" / "test.sh").unlink()
    out = _eval_dir(tasks, tmp_path)
    assert out.returncode == 2 and f"{broken}/tests/test.sh: missing" in out.stderr


def test_broken_task_toml_is_refused_naming_the_file(tmp_path):
    tasks = tmp_path / "tasks"
    broken = make_task(tasks, "bad-toml")
    (broken / "task.toml").write_text("[task\nname = 'x'\n")
    out = _eval_dir(tasks, tmp_path)
    assert out.returncode == 2 and f"{broken}/task.toml: broken TOML" in out.stderr


def _fake(name: str, run: int, strict: bool | None, invalid: str = "", damage: str = ""):
    from types import SimpleNamespace

    from tbexp.episodes.verifier import FAILED, PASSED, TestReport

    report = None if invalid else TestReport({"a": PASSED if strict else FAILED})
    return SimpleNamespace(
        task=SimpleNamespace(name=name, family="f"),
        run=run,
        invalid=invalid,
        damage=damage,
        report=report,
        turns=[None],
        n_commands=1,
        n_valid_commands=1,
        network="",
        tamper=[],  # what the agent touched that the verifier reads (tbexp.episodes.integrity)
    )


def test_metrics_over_no_valid_episode_are_nan_and_say_why():
    import math

    from tbexp.episodes.scoring import no_valid_reason, summarize, task_rows

    broken = [_fake("t", r, None, invalid="SandboxError: cannot start a container") for r in range(3)] + [
        _fake("u", 0, None, invalid="VerifierError: x")
    ]
    metrics = summarize(broken, {})
    for key in ("reward", "strict_success", "pass@1", "pass@1_stderr", "valid_command_rate", "avg_turns"):
        assert math.isnan(metrics[f"eval/{key}"]), key
    assert metrics["eval/strict_success_all"] == 0.0 and metrics["eval/invalid_episodes"] == 4.0
    assert no_valid_reason(broken).startswith("no valid episode: 4 invalid (SandboxError x3, VerifierError x1)")
    rows = task_rows(broken, {})
    assert math.isnan(rows[0]["reward"]) and rows[0]["note"].startswith("no valid episode: 3 invalid (SandboxError x3)")


def test_strict_success_all_counts_invalid_episodes_as_failures_and_damage_is_counted():
    from tbexp.episodes.scoring import no_valid_reason, summarize, task_rows

    episodes = [
        _fake("t", 0, True),
        _fake("t", 1, False, damage="the sandbox no longer ran commands"),
        _fake("t", 2, None, invalid="SandboxError: gone"),
        _fake("u", 0, True),
    ]
    rewards = {id(episodes[0]): 1.0, id(episodes[1]): 0.0, id(episodes[3]): 1.0}
    metrics = summarize(episodes, rewards)
    assert metrics["eval/strict_success"] == 2 / 3 and metrics["eval/strict_success_all"] == 2 / 4
    assert (
        metrics["eval/reward"] == 2 / 3
        and metrics["eval/damaged_episodes"] == 1.0
        and metrics["eval/invalid_episodes"] == 1.0
    )
    assert no_valid_reason(episodes) == "" and task_rows(episodes, rewards)[0]["damaged"] == 1


def test_an_eval_whose_task_cannot_start_reports_nan_beside_the_scored_one(rootfs, tmp_path, monkeypatch, capsys):
    tasks = tmp_path / "tasks"
    make_task(tasks, "good")
    broken = make_task(tasks, "broken")
    (broken / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nCOPY missing-dir/ /app/\n")
    metrics, rows = _eval(
        tmp_path / "run", monkeypatch, "tasks=dir", f"tasks.path={tasks}", "eval.n_runs=2", "eval.save_episodes=4"
    )
    assert (
        metrics["eval/strict_success"] == 1.0
        and metrics["eval/strict_success_all"] == 0.5
        and metrics["eval/invalid_episodes"] == 2
    )
    by_task = {r["task"]: r for r in rows}
    assert by_task["test/broken"]["reward"] == "nan" and by_task["test/broken"]["note"].startswith(
        "no valid episode: 2 invalid"
    )
    assert by_task["test/good"]["reward"] == "1.0" and by_task["test/good"]["note"] == ""
    assert "no valid episode: 2 invalid" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval/strict_success_all"] == 0.5 and summary["eval/invalid_episodes"] == 2.0
    record = json.loads((tmp_path / "run" / "episodes" / "test__good-run0.json").read_text())
    assert record["task_rewards"] == {"reward": 1.0} and record["damage"] == ""


def test_an_eval_with_no_valid_episode_keeps_nan_in_summary_json(rootfs, tmp_path, monkeypatch, capsys):
    import math

    tasks = tmp_path / "tasks"
    broken = make_task(tasks, "broken")
    (broken / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nCOPY missing-dir/ /app/\n")
    metrics, rows = _eval(tmp_path / "run", monkeypatch, "tasks=dir", f"tasks.path={tasks}", "eval.n_runs=2")
    assert math.isnan(metrics["eval/reward"]) and metrics["eval/strict_success_all"] == 0.0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (
        math.isnan(summary["eval/reward"])
        and math.isnan(summary["eval/strict_success"])
        and summary["eval/invalid_episodes"] == 2.0
    )
    out = capsys.readouterr().out
    assert "eval/reward" in out and "nan  (no valid episode: 2 invalid" in out
