"""Run a task's tests in its sandbox after the agent is done, the way Harbor does.

Stale results are deleted, `tests/` is copied to `/tests` (only now, so the
agent never saw it), `/tests/test.sh` runs with its output in
`/logs/verifier/test-stdout.txt`, and the results are read back from
`/logs/verifier/`: per-test outcomes from pytest's CTRF JSON (`ctrf.json`)
or JUnit XML (`*.xml`), and the task's own rewards from `reward.json` (a
flat object of numbers, every name kept) or `reward.txt` (one number, named
`reward`). A verifier that produced neither, or whose task's tests are pytest
files (`tests/test_*.py`, `*_test.py`, or a test.sh that calls pytest) but that
reported no test that passed or failed, raises `VerifierError`: it ran no test,
so a reward file it wrote measures nothing. Whose failure that is (the agent's,
which wrecked what the tests need, or the verifier's) is decided in
`tbexp.episodes.verdicts`, never here.

Before the upload, one exec empties `/tests` and makes `/logs/verifier` a
fresh directory (writable by every user, as Harbor's `empty_dirs(chmod=True)`
leaves it), so nothing the agent planted there (a `conftest.py`, a
symlink, a file where the directory belongs) is read by the tests. test.sh
runs as task.toml's `[verifier] user` (None: the image's USER). A separate
verifier's image may hold the tests itself (`tests_in_image`): then `/tests`
is left as the image has it and nothing is uploaded.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tbexp.errors import TbexpError
from tbexp.sandboxes import provision
from tbexp.sandboxes.base import Sandbox
from tbexp.tasks.harbor_task import Task

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
# `/tests` may be a mount point (bwrap), so its contents go, not the directory. A symlink or a file where
# /tests or /logs belongs is removed first: emptying a symlinked /tests would empty what it points to.
PREPARE = (
    'for d in /tests /logs; do { [ -L "$d" ] || { [ -e "$d" ] && [ ! -d "$d" ]; }; } && rm -f "$d"; done; '
    "rm -rf /tests/* /tests/.[!.]* /tests/..?* /logs/verifier 2>/dev/null; mkdir -p /tests /logs/verifier; "
    "chmod 777 /logs/verifier"
)
PREPARE_LOGS = (  # the tests are in the image: only /logs/verifier is made afresh
    "{ [ -L /logs ] || { [ -e /logs ] && [ ! -d /logs ]; }; } && rm -f /logs; "
    "rm -rf /logs/verifier 2>/dev/null; mkdir -p /logs/verifier; chmod 777 /logs/verifier"
)
PREPARE_TIMEOUT_S = 30.0


class VerifierError(TbexpError, RuntimeError):
    """The tests could not be run or produced no result."""


@dataclass(frozen=True)
class TestReport:
    __test__ = False  # not a pytest test class, despite its name

    tests: dict[str, str] = field(default_factory=dict)  # test name -> passed | failed | skipped
    rewards: dict[str, float] = field(default_factory=dict)  # reward.json / reward.txt, as written by the task
    log_tail: str = ""

    @property
    def n_total(self) -> int:
        return sum(1 for s in self.tests.values() if s != SKIPPED)

    @property
    def n_passed(self) -> int:
        return sum(1 for s in self.tests.values() if s == PASSED)

    @property
    def fraction_passed(self) -> float:
        """Per-test pass fraction; falls back to the task's own reward when it reports no tests."""
        return self.fraction("reward")

    @property
    def strict(self) -> bool:
        """Every test passed (or, with no per-test results, the task's reward is 1)."""
        return self.solved("reward")

    def fraction(self, task_reward: str = "reward") -> float:
        """Per-test pass fraction, or, with no per-test results, the task's reward named `task_reward` in [0, 1]."""
        if self.n_total:
            return self.n_passed / self.n_total
        return min(max(self.rewards.get(task_reward, 0.0), 0.0), 1.0)

    def solved(self, task_reward: str = "reward") -> bool:
        """Every test passed, or, with no per-test results, the task's reward named `task_reward` is at least 1."""
        if self.n_total:
            return self.n_passed == self.n_total
        return self.rewards.get(task_reward, 0.0) >= 1.0


def runs_pytest(task: Task) -> bool:
    """The task's tests are pytest files, so a verifier that reports no test result ran no test.

    test.sh counts when a command in it names pytest (`pytest …`, `python -m pytest`, `uvx … pytest`); a comment
    that says "no pytest" does not.
    """
    tests = task.tests_dir
    if any(tests.rglob("test_*.py")) or any(tests.rglob("*_test.py")):
        return True
    return _calls_pytest((tests / "test.sh").read_text(errors="replace"))


def _calls_pytest(script: str) -> bool:
    # A comment starts a line or follows a blank (a `#` inside a word, as in `${#x}` or a URL's, is no comment).
    code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in script.splitlines())
    return re.search(r"(?<![\w.-])pytest(?![\w-])", code) is not None


def verify(sandbox: Sandbox, task: Task, shared_tests: Sequence[Path] = (), tests_in_image: bool = False) -> TestReport:
    """Run `task`'s tests; `shared_tests` are copied to /tests first (a multi-step task's tests/ under a step's own).

    `tests_in_image`: the sandbox's image already holds /tests (a separate verifier's tests/Dockerfile).
    """
    sandbox.exec(PREPARE_LOGS if tests_in_image else PREPARE, timeout_s=PREPARE_TIMEOUT_S)  # what it cannot clear,
    for tests in () if tests_in_image else (*shared_tests, task.tests_dir):  # the upload and the tests meet
        sandbox.upload(tests, "/tests")
    test_sh = provision.verifier_command(getattr(sandbox, "provision", None), "bash /tests/test.sh")  # uv offline
    command = f"mkdir -p /logs/verifier && {test_sh} > /logs/verifier/test-stdout.txt 2>&1"
    with sandbox.as_user(task.verifier_user):
        run = sandbox.exec(_exports(task) + command, timeout_s=task.verifier_timeout_s)
    with tempfile.TemporaryDirectory(prefix="tbexp-verifier-") as tmp:
        try:
            sandbox.download("/logs/verifier", Path(tmp))
        except FileNotFoundError as err:
            raise VerifierError(f"{task.name}: /logs/verifier missing after test.sh (exit {run.exit_code})") from err
        try:
            report = read_results(Path(tmp), task.name, timed_out=run.timed_out)
        except VerifierError:
            _raise_if_no_python(sandbox, task.name)
            raise
    if not report.n_total:
        _raise_if_no_python(sandbox, task.name)  # the environment's fault, said as such
        if runs_pytest(task):
            rewards = ", ".join(f"{k}={v:g}" for k, v in report.rewards.items()) or "none"
            raise VerifierError(
                f"{task.name}: the tests are pytest files but test.sh reported no test that passed or failed (no CTRF or JUnit results; rewards written: {rewards}); last output:\n{report.log_tail[-500:]}"
            )
    return report


def _raise_if_no_python(sandbox: Sandbox, task_name: str) -> None:
    """No test ran, and test.sh asks uv for a Python the environment lacks: the environment's fault."""
    why = provision.missing_python(getattr(sandbox, "provision", None))
    if why:
        raise VerifierError(f"{task_name}: {why}")


def _exports(task: Task) -> str:
    """`[verifier] env` for test.sh, its `${VAR}` / `${VAR:-default}` taken from this host as Harbor does."""
    if not task.verifier_env:
        return ""
    from harbor.utils.env import resolve_env_vars

    try:
        env = resolve_env_vars(task.verifier_env)
    except ValueError as err:
        raise VerifierError(f"{task.path / 'task.toml'}: [verifier] env: {err}") from err
    return "".join(f"export {key}={shlex.quote(value)}; " for key, value in env.items())


def read_results(logs: Path, task_name: str = "", timed_out: bool = False) -> TestReport:
    """Parse a downloaded `/logs/verifier` directory."""
    tests = _read_ctrf(logs / "ctrf.json") if (logs / "ctrf.json").is_file() else {}
    if not tests:
        for xml in sorted(logs.glob("*.xml")):
            tests.update(_read_junit(xml))
    rewards = _read_rewards(logs)
    stdout = logs / "test-stdout.txt"
    tail = stdout.read_text(errors="replace")[-2000:] if stdout.is_file() else ""
    if not tests and not rewards:
        why = "timed out" if timed_out else "wrote no reward file and no test report"
        raise VerifierError(f"{task_name}: test.sh {why}; last output:\n{tail[-500:]}")
    return TestReport(tests=tests, rewards=rewards, log_tail=tail)


def _read_ctrf(path: Path) -> dict[str, str]:
    try:
        results = json.loads(path.read_text())["results"]["tests"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise VerifierError(f"{path.name}: not a CTRF report: {err}") from err
    return {t["name"]: _status(t.get("status", FAILED)) for t in results}


def _read_junit(path: Path) -> dict[str, str]:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise VerifierError(f"{path.name}: not JUnit XML: {err}") from err
    tests = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        if case.find("skipped") is not None:
            tests[name] = SKIPPED
        elif case.find("failure") is not None or case.find("error") is not None:
            tests[name] = FAILED
        else:
            tests[name] = PASSED
    return tests


def _read_rewards(logs: Path) -> dict[str, float]:
    if (logs / "reward.json").is_file():
        try:
            data = json.loads((logs / "reward.json").read_text())
        except json.JSONDecodeError as err:
            raise VerifierError(f"reward.json: not JSON: {err}") from err
        if not isinstance(data, dict) or not all(_finite(v) for v in data.values()):
            raise VerifierError("reward.json: must be a flat object of finite numbers")
        return {k: float(v) for k, v in data.items()}
    if (logs / "reward.txt").is_file():
        text = (logs / "reward.txt").read_text().strip()
        try:
            value = float(text)
        except ValueError as err:
            raise VerifierError(f"reward.txt: not a number: {text[:50]!r}") from err
        if not math.isfinite(value):
            raise VerifierError(f"reward.txt: not finite: {text!r}")
        return {"reward": value}
    return {}


def _status(status: str) -> str:
    return {"passed": PASSED, "skipped": SKIPPED, "pending": SKIPPED, "other": FAILED}.get(status, FAILED)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
