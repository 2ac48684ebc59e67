"""stage=check (tbexp.stages.check): the manifest of a task set, and a later job that keeps only its usable tasks.

The set mixes what a published set holds: a good task, one whose oracle fails, one whose do-nothing run passes
(broken or hackable), one whose environment does not build and one that cannot be loaded. Before this stage
there was no `stage=check` (the config refused the choice) and no `tasks.manifest`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tbexp.config import ConfigError
from tbexp.tasks import TaskError
from tests.conftest import compose_job, make_task


@pytest.fixture
def mixed_set(tmp_path) -> Path:
    root = tmp_path / "set"
    make_task(root, "good")
    make_task(root, "oracle-fails", solution="echo wrong > /app/out.txt\n")
    make_task(root, "nop-passes", tests="def test_nothing():\n    assert True\n")
    broken = make_task(root, "no-build")
    (broken / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nCOPY missing/ /app/\n")
    (root / "unloadable").mkdir()
    (root / "unloadable" / "task.toml").write_text("this is = not [toml\n")
    return root


@pytest.mark.sandbox
def test_the_manifest_says_what_each_task_gives_and_a_later_eval_keeps_the_usable(
    rootfs, mixed_set, tmp_path, monkeypatch, capsys
):
    from tbexp.stages import check
    from tbexp.stages import eval as eval_stage

    monkeypatch.chdir(tmp_path)
    metrics = check.run(compose_job("stage=check", "tasks=dir", f"tasks.path={mixed_set}", "check.concurrency=2"))
    manifest = json.loads((tmp_path / "check.json").read_text())
    rows = {name.rsplit("/", 1)[-1]: row for name, row in manifest["tasks"].items()}
    assert set(rows) == {"good", "oracle-fails", "nop-passes", "no-build", "unloadable"}
    assert (
        rows["good"]["usable"]
        and rows["good"]["oracle"]["strict"] == 1.0
        and rows["good"]["nop"]["reward"] == pytest.approx(1 / 3)
    )
    assert not rows["oracle-fails"]["usable"] and rows["oracle-fails"]["problem"].startswith("the oracle does not pass")
    assert not rows["nop-passes"]["usable"] and "broken or hackable" in rows["nop-passes"]["problem"]
    assert not rows["no-build"]["runnable"] and "missing" in rows["no-build"]["why"]
    assert not rows["unloadable"]["runnable"] and rows["unloadable"]["why"].startswith("not loadable")
    assert metrics["check/tasks"] == 5 and metrics["check/runnable"] == 3 and metrics["check/usable"] == 1
    assert metrics["check/nop_passes"] == 1 and metrics["check/oracle_passes"] == 2
    printed = capsys.readouterr().out
    assert "5 tasks: 3 runnable, oracle passes 2, do-nothing passes 1" in printed and "tasks.manifest=" in printed

    later = tmp_path / "later"
    later.mkdir()
    monkeypatch.chdir(later)
    overrides = ("tasks=dir", f"tasks.path={mixed_set}", f"tasks.manifest={tmp_path / 'check.json'}", "eval.n_runs=1")
    eval_stage.run(compose_job(*overrides))
    ran = [row["task"] for row in csv.DictReader((later / "tasks.csv").open())]
    excluded = json.loads((later / "excluded_tasks.json").read_text())
    assert ran == ["test/good"] and set(excluded) == {"test/oracle-fails", "test/nop-passes", "test/no-build"}
    assert "broken or hackable" in excluded["test/nop-passes"]


def test_a_manifest_that_is_not_one_is_a_clear_error(mixed_set, tmp_path):
    bad = tmp_path / "check.json"
    bad.write_text("[]")
    with pytest.raises(TaskError, match=f"tasks.manifest={bad}: not a check.json"):
        compose_job("tasks=dir", f"tasks.path={mixed_set}", f"tasks.manifest={bad}").tasks("heldout")


def test_check_settings_are_checked():
    from tbexp.config import check as check_config
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match="check.concurrency=0"):
        check_config(compose_config("stage=check", "check.concurrency=0"))
