"""Rewards and the verifier's parsing, against hand-computed numbers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tbexp.episodes.rewards import RewardError, binary, make_reward, per_test, per_test_efficiency
from tbexp.episodes.verifier import FAILED, PASSED, SKIPPED, TestReport, VerifierError, read_results
from tests.conftest import compose_config

FULL = TestReport({"a": PASSED, "b": PASSED, "c": PASSED})
TWO_OF_THREE = TestReport({"a": PASSED, "b": PASSED, "c": FAILED})
NONE = TestReport({"a": FAILED, "b": FAILED, "c": FAILED})


def _reward(option: str, *overrides: str):
    """The reward `reward=<option>` chooses, as the job builds it (by the node's `_target_`)."""
    return make_reward(compose_config(f"reward={option}", *overrides).reward)


def test_binary_and_per_test():
    assert binary([FULL, TWO_OF_THREE, NONE], [1, 1, 1]) == [1.0, 0.0, 0.0]
    assert per_test([FULL, TWO_OF_THREE, NONE], [1, 1, 1]) == [1.0, pytest.approx(2 / 3), 0.0]


def test_skipped_tests_do_not_count():
    report = TestReport({"a": PASSED, "b": SKIPPED})
    assert report.n_total == 1 and report.strict and per_test([report], [1]) == [1.0]


def test_efficiency_bonus_goes_to_faster_successes_only():
    # successes took 2, 3 and 6 turns: bonus 1, 0.75, 0; the failure gets none.
    scores = per_test_efficiency([FULL, FULL, FULL, TWO_OF_THREE], [2, 3, 6, 1])
    assert scores == [
        pytest.approx(1.0),
        pytest.approx(0.8 + 0.2 * 0.75),
        pytest.approx(0.8),
        pytest.approx(0.8 * 2 / 3),
    ]


def test_efficiency_weights_are_configurable_and_equal_turns_share_the_bonus():
    scores = per_test_efficiency([FULL, FULL], [4, 4], tests_weight=0.5, efficiency_weight=0.5)
    assert scores == [1.0, 1.0]
    reward = _reward("per_test_efficiency", "reward.tests_weight=0.6", "reward.efficiency_weight=0.4")
    assert reward([FULL, FULL, NONE], [3, 5, 3]) == [pytest.approx(1.0), pytest.approx(0.6), 0.0]


def test_the_reward_is_chosen_by_its_target_and_an_unknown_one_is_refused():
    settings = SimpleNamespace(_target_="tbexp.episodes.rewards.binary", name="per_test", task_reward="reward")
    assert make_reward(settings)([TWO_OF_THREE], [1]) == [0.0]  # binary's score: the label does not choose
    with pytest.raises(RewardError, match="reward._target_='tbexp.episodes.rewards.vibes'"):
        make_reward(SimpleNamespace(_target_="tbexp.episodes.rewards.vibes", name="vibes"))


def test_a_key_of_another_reward_is_refused_by_its_schema():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose_config("reward=binary", "reward.tests_weight=0.5")
    assert "Key 'tests_weight' not in 'BinaryRewardConfig'" in str(err.value.__cause__ or err.value)


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="test_outputs" name="test_a" /><testcase classname="test_outputs" name="test_b"><failure message="x"/></testcase>
<testcase classname="test_outputs" name="test_c"><skipped/></testcase><testcase classname="test_outputs" name="test_d"><error message="e"/></testcase>
</testsuite></testsuites>"""


def test_reads_junit(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "reward.txt").write_text("0\n")
    report = read_results(tmp_path)
    assert report.tests == {
        "test_outputs::test_a": PASSED,
        "test_outputs::test_b": FAILED,
        "test_outputs::test_c": SKIPPED,
        "test_outputs::test_d": FAILED,
    }
    assert (report.n_passed, report.n_total, report.strict) == (1, 3, False)
    assert report.rewards == {"reward": 0.0}


def test_ctrf_wins_over_junit(tmp_path):
    ctrf = {
        "results": {
            "summary": {"tests": 2},
            "tests": [{"name": "t1", "status": "passed"}, {"name": "t2", "status": "passed"}],
        }
    }
    (tmp_path / "ctrf.json").write_text(json.dumps(ctrf))
    (tmp_path / "junit.xml").write_text(JUNIT)
    (tmp_path / "reward.txt").write_text("1\n")
    report = read_results(tmp_path)
    assert report.tests == {"t1": PASSED, "t2": PASSED} and report.strict and report.source == "ctrf"


def test_reward_json_without_tests_is_the_fraction(tmp_path):
    (tmp_path / "reward.json").write_text('{"reward": 0.25, "speed": 3}')
    report = read_results(tmp_path)
    assert report.fraction_passed == 0.25 and not report.strict and report.rewards["speed"] == 3.0


@pytest.mark.parametrize(
    "name,content",
    [("reward.txt", "lots"), ("reward.txt", "nan"), ("reward.json", '{"reward": "high"}'), ("reward.json", "[1]")],
)
def test_bad_reward_files_are_verifier_errors(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(VerifierError, match=name):
        read_results(tmp_path)


def test_no_results_at_all_is_a_verifier_error(tmp_path):
    (tmp_path / "test-stdout.txt").write_text("bash: /tests/test.sh: line 3: pytest: command not found\n")
    with pytest.raises(VerifierError, match="no reward file"):
        read_results(tmp_path, "demo")


def test_every_named_reward_is_kept_and_the_reward_chooses_which_it_reads(tmp_path):
    (tmp_path / "reward.json").write_text('{"reward": 0.0, "quality": 0.75, "speed": 2}')
    report = read_results(tmp_path)
    assert report.rewards == {"reward": 0.0, "quality": 0.75, "speed": 2.0}
    assert per_test([report], [1]) == [0.0]  # the default reads `reward`, as before
    assert _reward("per_test", "reward.task_reward=quality")([report], [1]) == [0.75]
    assert _reward("binary", "reward.task_reward=quality")([report], [1]) == [0.0]
    assert _reward("task_reward", "reward.task_reward=speed")([report, TestReport()], [1, 1]) == [
        2.0,
        0.0,
    ]
    with_tests = TestReport({"a": PASSED, "b": FAILED}, {"reward": 0.0, "quality": 0.9})
    assert _reward("per_test", "reward.task_reward=quality")([with_tests], [1]) == [0.5]  # tests win
    assert _reward("task_reward", "reward.task_reward=quality")([with_tests], [1]) == [0.9]


def test_a_task_reward_the_task_does_not_write_is_refused_naming_it():
    with pytest.raises(ValueError, match="reward.task_reward='quality'.*'reward'"):
        _reward("task_reward", "reward.task_reward=quality")([TestReport({}, {"reward": 1.0})], [1])


def test_pytest_tasks_are_told_from_reward_file_tasks(tmp_path):
    from tbexp.episodes.verifier import runs_pytest
    from tbexp.tasks import load_task
    from tests.conftest import make_task

    assert runs_pytest(load_task(make_task(tmp_path, "pytest-files")))
    plain = make_task(tmp_path, "reward-file")
    (plain / "tests" / "test_outputs.py").unlink()
    (plain / "tests" / "test.sh").write_text(
        "#!/bin/bash\ngrep -q done /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    assert not runs_pytest(load_task(plain))
    (plain / "tests" / "test.sh").write_text(
        "#!/bin/bash\ncd /tests && uvx pytest --ctrf /logs/verifier/ctrf.json check.py\n"
    )
    assert runs_pytest(load_task(plain))  # test.sh calls pytest on a file not named test_*.py


@pytest.mark.parametrize(
    "script,calls",
    [
        ("# No pytest: shell checks\necho 1 > /logs/verifier/reward.txt\n", False),
        ("echo ok  # pytest comes later\n", False),
        ("uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json\n", True),
        ("python3 -m pytest -q /tests/test_outputs.py\n", True),
        ("uv run pytest --ctrf /logs/verifier/ctrf.json\n", True),
    ],
)
def test_a_test_sh_runs_pytest_when_a_command_names_it(script, calls):
    from tbexp.episodes.verifier import _calls_pytest

    assert _calls_pytest(script) is calls


# ---------------------------------------------------------------- Harbor's contract: the reward file decides


def _plugin_run(logs, name, tests, collection_errors=(), finished=True, exitstatus=1):
    folder = logs / ".tbexp"
    folder.mkdir(exist_ok=True)
    record = {
        "finished": finished,
        "exitstatus": exitstatus,
        "tests": tests,
        "collection_errors": list(collection_errors),
    }
    (folder / f"run-{name}.json").write_text(json.dumps(record))


def test_per_test_sources_in_order_and_the_source_is_said(tmp_path):
    from tbexp.episodes.test_results import read_results

    (tmp_path / "reward.txt").write_text("0\n")
    (tmp_path / "test-stdout.txt").write_text("PASSED t.py::x\nFAILED t.py::y\n1 failed, 1 passed in 0.1s\n")
    assert read_results(tmp_path).source == "pytest-output"
    _plugin_run(tmp_path, "1", {"t.py::x": "passed", "t.py::y": "passed", "t.py::z": "failed"})
    report = read_results(tmp_path)
    assert (report.source, report.n_passed, report.n_total) == ("tbexp-pytest", 2, 3)
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert read_results(tmp_path).source == "junit"
    (tmp_path / "ctrf.json").write_text(json.dumps({"results": {"tests": [{"name": "a", "status": "passed"}]}}))
    assert read_results(tmp_path).source == "ctrf"


def test_the_reward_file_alone_decides_where_nothing_reports_a_test(tmp_path):
    (tmp_path / "reward.txt").write_text("1\n")
    report = read_results(tmp_path)
    assert (report.source, report.tests, report.strict, report.fraction_passed) == ("reward-file", {}, True, 1.0)


def test_every_pytest_run_counts_and_a_collection_error_is_a_failed_test(tmp_path):
    (tmp_path / "reward.txt").write_text("0\n")
    _plugin_run(tmp_path, "1", {"a.py::t": "passed"})
    _plugin_run(tmp_path, "2", {"a.py::t": "passed"}, collection_errors=["b.py"], exitstatus=2)
    report = read_results(tmp_path)
    assert report.tests == {"a.py::t": PASSED, "run1::a.py::t": PASSED, "b.py::collection": FAILED}


def test_a_failed_test_or_a_reward_below_1_is_no_strict_success():
    assert not TestReport({"a": PASSED, "b": FAILED}, {"reward": 1.0}).strict
    assert not TestReport({"a": PASSED}, {"reward": 0.0}).strict
    assert TestReport({"a": PASSED}, {"reward": 1.0}).strict and TestReport({"a": PASSED}).strict


def test_pytest_output_read_from_names_or_counts():
    from tbexp.episodes.test_results import output_shows_pytest_ran, parse_pytest_output

    verbose = "t.py::a PASSED [ 50%]\nt.py::b FAILED [100%]\n"
    assert parse_pytest_output(verbose) == {"t.py::a": PASSED, "t.py::b": FAILED}
    counted = parse_pytest_output("=== 1 failed, 2 passed, 1 skipped, 3 warnings in 0.21s ===\nE   2 errors in 0.1s\n")
    assert sorted(counted.values()) == [FAILED, PASSED, PASSED, SKIPPED]
    assert output_shows_pytest_ran("============ no tests ran in 0.01s ============")
    assert not output_shows_pytest_ran("bash: pytest: command not found")


def test_what_test_sh_could_not_have_offline_is_named():
    from tbexp.episodes.test_results import offline_cause

    uv = "  × No solution found when resolving tool dependencies:\n  ╰─▶ Because numpy==2.1.0 was not found in the provided package locations and you require numpy==2.1.0"
    assert offline_cause(uv) == "package numpy"
    assert offline_cause("ERROR: No matching distribution found for requests==2.32\n") == "package requests==2.32"
    assert offline_cause("test.sh: line 3: pytest: command not found\n") == "command pytest"
    assert offline_cause("pytest: error: unrecognized arguments: --ctrf x.json\n").startswith("pytest options --ctrf")
