"""The verdict rule of docs/verdicts.md, row by row, on whole episodes in the sandbox (Harbor's contract).

.venv/bin/python -m pytest tests/test_verdicts_contract.py -q              # bwrap
.venv/bin/python -m pytest tests/test_verdicts_contract.py -q -m docker    # Docker

Each test names the row it holds. The tasks are make_task's (three tests, one of which, the untouched input, holds
without any work) with the test.sh each convention needs. Before this rule (the code of #39), the plain-pytest
and collection-error rows were invalid episodes ("no CTRF or JUnit results"); the reward-veto row scored a strict
success; the output and plugin rows had no per-test results. Only APIs that existed then are used here, so this
file ran on that code to show it (docs/verdicts.md, "How the rule was tested").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tbexp.agents.base import make_agent
from tbexp.episodes.policies import make_policy
from tbexp.episodes.rewards import per_test
from tbexp.episodes.rollout import run_episode
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task

REWARD_FROM_EXIT = (
    "if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"
)
MODULE_TESTS = """
import sys
sys.path.insert(0, "/app")
from greeting import hello  # the module the agent is to write

def test_hello():
    assert hello() == "hi"

def test_hello_is_short():
    assert len(hello()) == 2
"""


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def sandbox(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return compose_config(f"sandbox={request.param}", "sandbox.command_timeout_s=20").sandbox


def _task(tmp_path: Path, test_sh: str, name: str = "t", **kwargs) -> Path:
    task = make_task(tmp_path, name, **kwargs)
    (task / "tests" / "test.sh").write_text("#!/bin/bash\ncd /app\n" + test_sh)
    return task


def _episodes(task_dir: Path, sandbox) -> dict:
    agent, task = make_agent(compose_config().agent), load_task(task_dir)
    return {
        p: run_episode(task, 0, agent, lambda t, a, p=p: make_policy(p, t, a), sandbox, 4) for p in ("oracle", "nop")
    }


def _reward(episode) -> float:
    assert not episode.invalid, episode.invalid
    return per_test([episode.report], [1])[0]


@pytest.mark.sandbox
def test_plain_pytest_and_reward_txt_is_scored(sandbox, tmp_path):
    """Row: a reward file and no CTRF or JUnit: scored; per-test results gathered by tbexp's own pytest plugin."""
    runs = _episodes(_task(tmp_path, "pytest /tests/test_outputs.py -rA\n" + REWARD_FROM_EXIT), sandbox)
    assert _reward(runs["oracle"]) == 1.0 and runs["oracle"].report.strict
    assert _reward(runs["nop"]) == pytest.approx(1 / 3) and not runs["nop"].report.strict
    assert runs["oracle"].report.rewards == {"reward": 1.0} and runs["nop"].report.rewards == {"reward": 0.0}
    assert getattr(runs["nop"].report, "source", "") == "tbexp-pytest"


@pytest.mark.sandbox
def test_a_collection_error_on_the_agents_missing_module_scores_0(sandbox, tmp_path):
    """Row: pytest stopped at collection because the module the agent was to write is missing: scored 0."""
    solve = "printf 'def hello():\\n    return \"hi\"\\n' > /app/greeting.py\n"
    task = _task(
        tmp_path,
        "python3 -m pytest -rA /tests/test_outputs.py\n" + REWARD_FROM_EXIT,
        tests=MODULE_TESTS,
        solution=solve,
    )
    runs = _episodes(task, sandbox)
    assert _reward(runs["oracle"]) == 1.0
    assert _reward(runs["nop"]) == 0.0 and not runs["nop"].damage and not runs["nop"].report.strict


@pytest.mark.sandbox
def test_pytest_output_lines_decide_where_no_report_and_no_plugin(sandbox, tmp_path):
    """Row: neither report nor tbexp's plugin (an isolated Python ignores PYTHONPATH): pytest's -rA lines decide."""
    runs = _episodes(
        _task(tmp_path, "python3 -I -m pytest -p no:cacheprovider -rA /tests/test_outputs.py\n" + REWARD_FROM_EXIT),
        sandbox,
    )
    assert _reward(runs["oracle"]) == 1.0 and _reward(runs["nop"]) == pytest.approx(1 / 3)
    assert getattr(runs["nop"].report, "source", "") == "pytest-output"


@pytest.mark.sandbox
def test_the_reward_file_vetoes_a_strict_success(sandbox, tmp_path):
    """Row: every reported test passed but the reward file says 0 (a check of test.sh's own failed): not strict."""
    test_sh = "python3 -m pytest -p no:cacheprovider --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py\n"
    runs = _episodes(_task(tmp_path, test_sh + "echo 0 > /logs/verifier/reward.txt\n"), sandbox)
    assert runs["oracle"].report.n_passed == runs["oracle"].report.n_total == 3
    assert not runs["oracle"].report.strict


@pytest.mark.sandbox
def test_a_pytest_that_never_ran_is_invalid_naming_what_was_missing(sandbox, tmp_path):
    """Row: test.sh wrote a reward but pytest never collected (its command is not in the environment): invalid,
    naming it, and the control says the environment fails the same way."""
    runs = _episodes(_task(tmp_path, "nosuch-pytest /tests/test_outputs.py\n" + REWARD_FROM_EXIT), sandbox)
    for episode in runs.values():
        assert episode.report is None and "pytest ran none" in episode.invalid
        assert "command nosuch-pytest" in episode.invalid
    assert "fails in a fresh sandbox too" in runs["oracle"].invalid  # the oracle ran a command: the control decided


@pytest.mark.sandbox
def test_a_package_the_offline_provisioning_cannot_hold_is_named(rootfs, tmp_path):
    """Row: test.sh asks pip for a package no index has: every episode invalid, naming it (tbexp.sandboxes.provision
    resolves what test.sh installs before the sandbox starts; this asks the package index once)."""
    sandbox = compose_config("sandbox.command_timeout_s=20").sandbox
    task = _task(tmp_path, "pip install tbexp-no-such-package==1.0\npytest /tests/test_outputs.py\n" + REWARD_FROM_EXIT)
    for episode in _episodes(task, sandbox).values():
        assert episode.report is None and "tbexp-no-such-package" in episode.invalid, episode.invalid
