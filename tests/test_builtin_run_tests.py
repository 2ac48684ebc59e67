"""tests/run_tests.py of the built-in tasks (tbexp/tasks/builtin/run_tests.py) against pytest itself.

.venv/bin/python -m pytest tests/test_builtin_run_tests.py

Each case writes a test file, runs it through the runner and through `python -m pytest --junitxml` (plugins
not auto-loaded, as in the sandbox's root file system), and compares exit codes and the per-test outcomes
that the verifier reads from the JUnit XML. Every built-in family's checks are compared the same way inside
the sandbox by tests/test_builtin_tasks.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tbexp.episodes.test_results import read_junit

RUNNER = Path(__file__).resolve().parent.parent / "tbexp" / "tasks" / "builtin" / "run_tests.py"

MIXED = """
import dataclasses
import sys
from pathlib import Path

LIMIT = 3


@dataclasses.dataclass
class Row:
    value: int


def test_passes():
    assert Row(2).value < LIMIT


def test_fails_an_assert():
    assert Path("/nonexistent-file").exists(), "the file was not written"


def test_raises():
    int("not a number")


def test_exits():
    sys.exit(3)


def helper_not_a_test():
    raise AssertionError("never run")
"""


def _run(argv: list[str], cwd: Path) -> int:
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=120).returncode


def _outcomes(logs: Path) -> dict[str, str]:
    # the JUnit XML alone: neither run writes a reward file, which read_results requires (the reward file decides)
    junit = logs / "junit.xml"
    return read_junit(junit) if junit.is_file() else {}


def _both(tmp_path: Path, source: str) -> tuple[tuple[int, dict], tuple[int, dict]]:
    """(exit code, outcomes) through the runner, then through pytest, for `source` as test_outputs.py."""
    (tmp_path / "tests").mkdir()
    test_file = tmp_path / "tests" / "test_outputs.py"
    test_file.write_text(source)
    results = []
    for name, argv in (
        ("runner", [sys.executable, str(RUNNER)]),
        ("pytest", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]),
    ):
        logs = tmp_path / name
        logs.mkdir()
        # from the tests' folder, so that pytest 8 here names the cases as the sandbox's pytest 7 does from /app
        code = _run([*argv, f"--junitxml={logs / 'junit.xml'}", str(test_file)], cwd=test_file.parent)
        results.append((code, _outcomes(logs)))
    return results[0], results[1]


def test_passed_failed_raised_and_exited_tests_as_pytest_reports_them(tmp_path):
    runner, by_pytest = _both(tmp_path, MIXED)
    assert runner == by_pytest
    assert runner == (
        1,
        {
            "test_outputs::test_passes": "passed",
            "test_outputs::test_fails_an_assert": "failed",
            "test_outputs::test_raises": "failed",
            "test_outputs::test_exits": "failed",
        },
    )


def test_all_passed_exits_0(tmp_path):
    runner, by_pytest = _both(tmp_path, "def test_one():\n    assert True\n\n\ndef test_two():\n    pass\n")
    assert runner == by_pytest == (0, {"test_outputs::test_one": "passed", "test_outputs::test_two": "passed"})


def test_a_module_that_does_not_import_is_one_failed_case(tmp_path):
    runner, by_pytest = _both(tmp_path, "raise ValueError('boom')\n\n\ndef test_one():\n    pass\n")
    assert runner == by_pytest == (2, {"test_outputs": "failed"})


def test_no_test_exits_5(tmp_path):
    runner, by_pytest = _both(tmp_path, "X = 1\n")
    assert runner == by_pytest == (5, {})
    assert (tmp_path / "runner" / "junit.xml").is_file()


@pytest.mark.parametrize(
    "source",
    [
        "class TestGroup:\n    def test_one(self):\n        pass\n",
        "def test_with_a_fixture(tmp_path):\n    assert tmp_path\n",
    ],
    ids=["test class", "fixture argument"],
)
def test_what_needs_pytest_itself_is_refused_without_a_report(tmp_path, source):
    (tmp_path / "test_outputs.py").write_text(source)
    junit = tmp_path / "junit.xml"
    code = _run([sys.executable, str(RUNNER), f"--junitxml={junit}", str(tmp_path / "test_outputs.py")], tmp_path)
    assert code == 4 and not junit.exists()
