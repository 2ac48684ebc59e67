"""Tests for the built-in task suite (tbexp.tasks.builtin).

.venv/bin/python -m pytest tests/test_builtin_tasks.py
TBEXP_SANDBOX_ALL=1 .venv/bin/python -m pytest tests/test_builtin_tasks.py -m sandbox   # every instance

The static tests write the default suite (seed 0, 40 train + 4 held-out per
family) once and check its shape: determinism, the split rules, Harbor's
layout, tests per instance, the oracle's one-command-per-line form. The
`sandbox` tests replay the oracle (one bwrap per solve.sh line, as an agent's
turns would run), a do-nothing agent and all but the oracle's last line in
bubblewrap over the sandbox root file system, then run tests/test.sh and read
the JUnit XML and reward, and run the same checks through pytest itself: its
per-test outcomes must be tests/run_tests.py's.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tbexp.episodes.test_results import read_junit
from tbexp.episodes.verifier import read_results
from tbexp.tasks.builtin import FAMILIES, HELDOUT_FAMILIES, family, write_suite
from tbexp.tasks.builtin.writer import DOCKERFILE, RUN_TESTS, TEST_SH
from tbexp.tasks.harbor_task import load_tasks

TRAIN_PER_FAMILY, HELDOUT_PER_FAMILY = 40, 4
DISCOVERY_COMMANDS = ("find ", "ls ", "head ", "grep -r", "tar -t", "cat ", "file ")
# Pool dimensions the agent must find out for itself, so they are absent from the instruction on purpose.
UNSTATED_DIMENSIONS = {("csv-groupby", "layout"), ("unknown-delimiter", "separator")}


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    return write_suite(tmp_path_factory.mktemp("builtin") / "suite")


def _task_dirs(suite: Path) -> list[Path]:
    return sorted(p for split in ("train", "heldout") for p in (suite / split).iterdir())


def _metadata(task_dir: Path) -> dict:
    return tomllib.loads((task_dir / "task.toml").read_text())["metadata"]


def _solve_lines(task_dir: Path) -> list[str]:
    return (task_dir / "solution" / "solve.sh").read_text().splitlines()[1:]


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode) for p in files}


def test_family_roster():
    assert len(FAMILIES) >= 8 and len(set(FAMILIES)) == len(FAMILIES)
    assert HELDOUT_FAMILIES and set(HELDOUT_FAMILIES) < set(FAMILIES)
    train_discovery = [f for f in FAMILIES if family(f).discovery and f not in HELDOUT_FAMILIES]
    assert len(train_discovery) >= 3, train_discovery


def test_same_arguments_give_byte_identical_suites(suite, tmp_path):
    again = write_suite(tmp_path / "again")
    assert _snapshot(again) == _snapshot(suite)


def test_second_call_returns_without_rewriting(suite):
    marker = suite / ".complete"
    before = marker.stat().st_mtime_ns
    assert write_suite(suite) == suite
    assert marker.stat().st_mtime_ns == before


def test_other_arguments_replace_the_suite(tmp_path):
    out = tmp_path / "suite"
    write_suite(out, seed=1, train_per_family=10, heldout_per_family=2)
    write_suite(out, seed=1, train_per_family=12, heldout_per_family=2)
    train_families = len(FAMILIES) - len(HELDOUT_FAMILIES)
    assert len(list((out / "train").iterdir())) == 12 * train_families
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directories left behind"


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("not a suite")
    with pytest.raises(FileExistsError):
        write_suite(tmp_path)


def test_split_sizes(suite):
    for split, per_family in (("train", TRAIN_PER_FAMILY), ("heldout", HELDOUT_PER_FAMILY)):
        families = [_metadata(d)["family"] for d in (suite / split).iterdir()]
        for name in FAMILIES:
            expected = 0 if split == "train" and name in HELDOUT_FAMILIES else per_family
            assert families.count(name) == expected, (split, name)


def test_heldout_combos_are_new_combinations_of_seen_entries(suite):
    train = [_metadata(d) for d in (suite / "train").iterdir()]
    for meta in (_metadata(d) for d in (suite / "heldout").iterdir()):
        if meta["family"] in HELDOUT_FAMILIES:
            continue
        same_family = [m["combo"] for m in train if m["family"] == meta["family"]]
        assert meta["combo"] not in same_family, meta
        for dimension, entry in meta["combo"].items():
            assert any(c[dimension] == entry for c in same_family), (meta["family"], dimension, entry)


def test_train_combos_are_distinct(suite):
    combos = [(m["family"], tuple(m["combo"].items())) for m in map(_metadata, (suite / "train").iterdir())]
    assert len(set(combos)) == len(combos)


def test_every_instance_loads(suite):
    for split in ("train", "heldout"):
        for task in load_tasks(suite / split):
            assert task.name == f"tbexp/{task.path.name}"
            assert task.path.name.startswith(task.family + "-") and task.metadata["split"] == split
            assert task.workdir == "/app" and task.solution_script is not None


def test_harbor_accepts_every_instance(suite):
    harbor_task = pytest.importorskip("harbor.models.task.task", reason="harbor is not installed in this venv")
    for task_dir in _task_dirs(suite):
        assert harbor_task.Task.is_valid_dir(task_dir), task_dir
        assert harbor_task.Task(task_dir).config.metadata["family"] == _metadata(task_dir)["family"]


def test_fixed_files_are_exact(suite):
    for task_dir in _task_dirs(suite):
        assert (task_dir / "environment" / "Dockerfile").read_text() == DOCKERFILE
        assert (task_dir / "tests" / "test.sh").read_text() == TEST_SH
        assert (task_dir / "tests" / "run_tests.py").read_bytes() == RUN_TESTS
        assert os.access(task_dir / "tests" / "test.sh", os.X_OK)
        assert os.access(task_dir / "solution" / "solve.sh", os.X_OK)


def test_each_instance_has_at_least_three_tests(suite):
    for task_dir in _task_dirs(suite):
        tree = ast.parse((task_dir / "tests" / "test_outputs.py").read_text())
        tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        assert len(tests) >= 3, task_dir


def test_solve_sh_holds_one_complete_command_per_line(suite):
    for task_dir in _task_dirs(suite):
        script = (task_dir / "solution" / "solve.sh").read_text()
        assert script.startswith("#!/bin/bash\n"), task_dir
        for line in _solve_lines(task_dir):
            assert line.strip() and not line.lstrip().startswith("#"), (task_dir, line)
            assert not line.rstrip().endswith("\\") and "<<" not in line, (task_dir, line)
            # bash -n parses without running: an unclosed quote, loop or brace fails here.
            check = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
            assert check.returncode == 0, (task_dir, line, check.stderr)


def test_discovery_oracles_look_before_acting(suite):
    for task_dir in _task_dirs(suite):
        lines = _solve_lines(task_dir)
        if _metadata(task_dir)["discovery"]:
            assert len(lines) >= 2 and lines[0].startswith(DISCOVERY_COMMANDS), (task_dir, lines)
        else:
            assert len(lines) == 1, (task_dir, lines)


def test_instruction_names_every_stated_pool_entry(suite):
    for task_dir in _task_dirs(suite):
        meta = _metadata(task_dir)
        instruction = (task_dir / "instruction.md").read_text()
        assert instruction.count("\n") == 1 and len(instruction) < 400, task_dir
        for dimension, entry in meta["combo"].items():
            if (meta["family"], dimension) not in UNSTATED_DIMENSIONS:
                assert str(entry) in instruction, (task_dir, dimension, entry)


def test_answers_are_not_shipped_and_inputs_are_small(suite):
    for task_dir in _task_dirs(suite):
        app = task_dir / "environment" / "app"
        for line in _solve_lines(task_dir):
            for target in re.findall(r"> (/app/\S+)", line):
                assert not (app / target.removeprefix("/app/")).exists(), (task_dir, target)
        for path in app.rglob("*"):
            assert path.is_dir() or path.stat().st_size <= 4096, path


# ---- sandbox: replay the oracle and a do-nothing agent, then verify -------------------------------------


def _instances() -> list[str]:
    """Every held-out instance, the first two train instances of each family (all with TBEXP_SANDBOX_ALL=1)."""
    train_count = TRAIN_PER_FAMILY if os.environ.get("TBEXP_SANDBOX_ALL") else 2
    names = []
    for name in FAMILIES:
        if name in HELDOUT_FAMILIES:
            names += [f"heldout/{name}-{i:04d}" for i in range(HELDOUT_PER_FAMILY)]
        else:
            names += [f"train/{name}-{i:04d}" for i in range(train_count)]
            names += [f"heldout/{name}-{i:04d}" for i in range(TRAIN_PER_FAMILY, TRAIN_PER_FAMILY + HELDOUT_PER_FAMILY)]
    return names


def _sandbox_run(rootfs: Path, task_dir: Path, work: Path, commands: list[str]) -> tuple[str, dict, dict]:
    """Run `commands` (one bwrap each) in `rootfs`, then tests/test.sh and, on the same files, pytest itself.

    Returns (test.sh's reward, its per-test outcomes, pytest's per-test outcomes on the same /app).
    """
    mounts = ("app", "tmp", "logs", "tests", "solution")
    for name in mounts:
        (work / name).mkdir(parents=True)
    shutil.copytree(task_dir / "environment" / "app", work / "app", dirs_exist_ok=True)
    shutil.copytree(task_dir / "solution", work / "solution", dirs_exist_ok=True)
    bwrap = ["bwrap", "--ro-bind", str(rootfs), "/"]
    for name in mounts:
        bwrap += ["--bind", str(work / name), f"/{name}"]
    bwrap += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--unshare-all",
        "--die-with-parent",
        "--chdir",
        "/app",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "PATH",
        "/usr/local/bin:/usr/bin:/bin",
    ]
    for command in commands:
        subprocess.run([*bwrap, "bash", "-c", command], capture_output=True, timeout=60)
    shutil.copytree(task_dir / "tests", work / "tests", dirs_exist_ok=True)
    subprocess.run([*bwrap, "bash", "/tests/test.sh"], capture_output=True, timeout=120)
    report = read_results(work / "logs" / "verifier")
    # the checks run by pytest itself (test.sh runs them through tests/run_tests.py), on the files test.sh saw
    pytest_run = "mkdir -p /logs/pytest && python3 -m pytest -q -p no:cacheprovider --junitxml=/logs/pytest/junit.xml"
    subprocess.run([*bwrap, "bash", "-c", f"{pytest_run} /tests/test_outputs.py"], capture_output=True, timeout=120)
    by_pytest = read_junit(work / "logs" / "pytest" / "junit.xml")  # pytest alone writes no reward file
    return (work / "logs" / "verifier" / "reward.txt").read_text().strip(), report.tests, by_pytest


@pytest.mark.sandbox
@pytest.mark.parametrize("instance", _instances())
def test_oracle_passes_and_doing_nothing_fails(rootfs, suite, tmp_path, instance):
    # `rootfs` (tests/conftest.py): the cache root's sandbox root, built if missing; bwrap missing fails the test
    task_dir = suite / instance
    reward, tests, by_pytest = _sandbox_run(rootfs, task_dir, tmp_path / "oracle", _solve_lines(task_dir))
    failed = [name for name, outcome in tests.items() if outcome != "passed"]
    assert (reward, failed) == ("1", []) and len(tests) >= 3, f"oracle: reward {reward}, {failed} of {tests} failed"
    assert tests == by_pytest, "tests/run_tests.py and pytest disagree after the oracle"
    reward, tests, by_pytest = _sandbox_run(rootfs, task_dir, tmp_path / "nop", [])
    failed = [name for name, outcome in tests.items() if outcome != "passed"]
    assert reward == "0" and 1 <= len(failed) <= len(tests), f"do-nothing: reward {reward}, {failed} of {tests} failed"
    assert tests == by_pytest, "tests/run_tests.py and pytest disagree after doing nothing"
    # half an oracle: a mix of passed and failed tests where the family's checks allow it
    partial = _solve_lines(task_dir)[:-1]
    if partial:
        _, tests, by_pytest = _sandbox_run(rootfs, task_dir, tmp_path / "partial", partial)
        assert tests == by_pytest, "tests/run_tests.py and pytest disagree after all but the oracle's last command"


def test_rl_share_keeps_part_of_each_family_away_from_sft():
    from tbexp.tasks import load_task_set
    from tests.conftest import compose_config

    settings = compose_config("tasks.rl_share=0.25").tasks
    sft, rl = load_task_set(settings, "train", "sft"), load_task_set(settings, "train", "rl")
    assert not {t.name for t in sft} & {t.name for t in rl}
    assert len(rl) == round(0.25 * settings.train_per_family) * len(
        {t.family for t in rl}
    )  # the same share of every family
    assert load_task_set(settings, "heldout", "rl") == load_task_set(
        settings, "heldout"
    )  # only the train split is divided
    assert len(load_task_set(compose_config("tasks.rl_share=0").tasks, "train", "rl")) == len(sft) + len(rl)
