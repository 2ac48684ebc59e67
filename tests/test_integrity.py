"""The parts of tbexp.episodes.integrity that need no sandbox: the rules, the start-up guard, the tamper policy.

The whole episodes are in tests/test_attacks.py (each attack in bwrap, Docker and Harbor's trials).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tbexp.episodes.integrity import Integrity, rules
from tbexp.episodes.rewards import per_test
from tbexp.episodes.rollout import Episode
from tbexp.episodes.scoring import apply_tamper, score_episodes, summarize
from tbexp.episodes.verifier import FAILED, PASSED, TestReport
from tbexp.sandboxes.base import Change
from tbexp.sandboxes.verifier_files import RUNTIME
from tbexp.tasks.harbor_task import Task


class FakeSandbox:
    """What `rules` asks a sandbox: its verifier PATH, whether a tool shadows the image's, a file's text."""

    def __init__(self, files: dict[str, str] | None = None, image_tools: tuple[str, ...] = ("python3", "pytest")):
        self.files, self.image_tools = files or {}, image_tools

    def verifier_path(self) -> str:
        return "/root/.local/bin:/usr/local/bin:/usr/bin:/bin"

    def shadows_image_tool(self, path: str) -> bool:
        return path.rsplit("/", 1)[-1] in self.image_tools

    def download(self, remote: str, local: Path) -> None:
        if remote not in self.files:
            raise FileNotFoundError(remote)
        Path(local).write_text(self.files[remote])


def _rules(*changes: Change, files=None):
    return rules(list(changes), FakeSandbox(files), None)


def test_what_the_verifier_reads_is_flagged_and_set_aside():
    site = "/root/.local/lib/python3.11/site-packages"
    tamper, aside = _rules(
        Change("/logs/verifier/reward.txt", "added"),
        Change("/tests/conftest.py", "added"),
        Change(f"{site}/usercustomize.py", "added"),
        Change(f"{site}/hook.pth", "added"),
        Change("/pytest.ini", "added"),
        Change("/root/.local/bin/python3", "added"),
        Change("/usr/local/lib/python3.11/dist-packages/_pytest", "added", is_dir=True),
        Change("/usr/local/lib/python3.11/dist-packages/_pytest/runner.py", "added"),
        Change("/usr/lib/python3/dist-packages/pluggy/_hooks.py", "changed"),
        Change("/usr/lib/python3.11/os.py", "changed"),
        files={f"{site}/hook.pth": "import os; os.system('x')\n"},
    )
    kinds = [t.split(":")[0] for t in tamper]
    assert kinds == [
        "verifier output written before the verifier",
        "tests folder written before the verifier",
        "Python start-up hook",
        "Python start-up hook (.pth that runs code)",
        "pytest configuration where pytest looks for it",
        "executable in place of the verifier's python3",
        "the verifier's test runner installed over",
        "the verifier's test runner added",
        "the verifier's test runner changed",
        "the verifier's Python standard library changed",
    ]
    assert aside == [  # what lies inside a folder set aside goes with it
        "/pytest.ini",
        "/root/.local/bin/python3",
        f"{site}/hook.pth",
        f"{site}/usercustomize.py",
        "/usr/local/lib/python3.11/dist-packages/_pytest",
    ]


def test_an_honest_agents_work_is_left_alone():
    site = "/root/.local/lib/python3.11/site-packages"
    tamper, aside = _rules(
        Change("/app/solution.py", "added"),
        Change("/app/pyproject.toml", "added"),
        Change("/app/conftest.py", "added"),  # pytest reads it only when test.sh runs pytest in /app without a path
        Change(f"{site}/wordcount.py", "added"),
        Change(f"{site}/paths.pth", "added"),  # paths only: no code runs
        Change("/root/.local/bin/mytool", "added"),
        Change("/root/.local/bin/python3.13", "added"),  # a new interpreter, not one the image has
        Change("/usr/lib/python3/dist-packages/_pytest/__pycache__/runner.cpython-311.pyc", "added"),
        Change("/usr/local/bin/pytest", "deleted"),
        files={f"{site}/paths.pth": "/app/src\n"},
    )
    assert tamper == []
    assert aside == ["/root/.local/bin/python3.13"]  # a tool name on PATH is never the verifier's: set aside


def _guarded(tmp_path: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python argv` started as test.sh's Python is: tbexp's sitecustomize first, `tmp_path` an agent's folder."""
    environ = {
        **os.environ,
        "PYTHONPATH": str(RUNTIME),
        "PYTHONNOUSERSITE": "1",
        "TBEXP_VERIFIER_UNTRUSTED": str(tmp_path),
        "TBEXP_VERIFIER_RESULTS": str(tmp_path / "results"),
        **env,
    }
    environ.pop("TBEXP_VERIFIER_IN_PYTEST", None)
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=environ, capture_output=True, text=True)


def test_the_start_up_guard_refuses_a_planted_test_runner_and_standard_module(tmp_path):
    (tmp_path / "pytest.py").write_text("print('FAKE PYTEST'); raise SystemExit(0)\n")
    (tmp_path / "difflib.py").write_text("raise SystemExit('FAKE DIFFLIB')\n")
    (tmp_path / "sitecustomize.py").write_text("print('PLANTED SITECUSTOMIZE')\n")
    (tmp_path / "test_x.py").write_text("import difflib\n\ndef test_x():\n    assert difflib.SequenceMatcher\n")
    done = _guarded(
        tmp_path, ["-m", "pytest", "-p", "no:cacheprovider", "-q", "test_x.py"], PYTHONPATH=f"{RUNTIME}:{tmp_path}"
    )
    assert "FAKE" not in done.stdout + done.stderr and "PLANTED" not in done.stdout, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    refused = [json.loads(line) for line in (tmp_path / "results" / "guard.jsonl").read_text().splitlines()]
    assert {r["module"] for r in refused} >= {"pytest", "difflib"}
    runs = list((tmp_path / "results").glob("run-*.json"))  # and tbexp's plugin reported the run
    assert len(runs) == 1 and json.loads(runs[0].read_text())["tests"] == {"test_x.py::test_x": "passed"}


def test_the_guard_leaves_the_agents_own_modules_and_a_plain_python_alone(tmp_path):
    (tmp_path / "solution.py").write_text("ANSWER = 42\n")
    (tmp_path / "json.py").write_text("raise SystemExit('shadowed json')\n")  # not pytest: Python's own rules hold
    done = _guarded(tmp_path, ["-c", "import solution; print(solution.ANSWER)"])
    assert done.stdout.strip() == "42" and not (tmp_path / "results").exists(), done.stderr
    # the user's site-packages stays on the path (an installed package imports) without its start-up hooks
    user_site = (
        tmp_path
        / "home"
        / ".local"
        / "lib"
        / f"python{sys.version_info.major}.{sys.version_info.minor}"
        / "site-packages"
    )
    user_site.mkdir(parents=True)
    (user_site / "installed_pkg.py").write_text("VALUE = 'installed'\n")
    (user_site / "hook.pth").write_text("import sys; print('PTH RAN')\n")
    (user_site / "usercustomize.py").write_text("print('USERCUSTOMIZE RAN')\n")
    done = _guarded(tmp_path, ["-c", "import installed_pkg; print(installed_pkg.VALUE)"], HOME=str(tmp_path / "home"))
    assert done.stdout.strip() == "installed", done.stdout + done.stderr


def _episode(name: str, report: TestReport, tamper: list[str]) -> Episode:
    episode = Episode(Task(f"x/{name}", Path("/t"), "", {}), 0, report=report)
    episode.integrity = Integrity(tamper=tamper)
    return episode


@pytest.mark.parametrize("policy, scored, invalid", [("zero", 0.0, 0), ("drop", None, 1), ("keep", 1.0, 0)])
def test_the_tamper_policy(policy, scored, invalid):
    solved = TestReport({"a": PASSED, "b": PASSED}, {"reward": 1.0})
    cheat, honest = _episode("t", solved, ["Python start-up hook: /x"]), _episode("t", solved, [])
    episodes = apply_tamper([cheat, honest], policy)
    rewards = score_episodes(episodes, per_test)
    assert rewards.get(id(cheat)) == scored and rewards[id(honest)] == 1.0
    metrics = summarize(episodes, rewards)
    assert metrics["eval/tamper_episodes"] == 1.0 and metrics["eval/invalid_episodes"] == invalid
    if policy == "zero":
        assert cheat.verified_report is solved and not cheat.report.strict


def test_a_failed_report_stays_failed_under_any_policy():
    failed = _episode(
        "t", TestReport({"a": FAILED}, {"reward": 0.0}), ["tests folder written before the verifier: /tests/x"]
    )
    assert score_episodes(apply_tamper([failed], "keep"), per_test) == {id(failed): 0.0}


def test_the_tamper_policies_are_config_choices():
    from hydra.errors import ConfigCompositionException

    from tests.conftest import compose_config

    cfg = compose_config("grpo.tamper=drop", "eval.tamper=keep", "verifier.isolation=fresh")
    assert (cfg.grpo.tamper, cfg.eval.tamper, cfg.verifier.isolation) == ("drop", "keep", "fresh")
    assert compose_config().grpo.tamper == "zero" and compose_config().verifier.isolation == "shared"
    with pytest.raises(ConfigCompositionException):
        compose_config("grpo.tamper=forgive")
