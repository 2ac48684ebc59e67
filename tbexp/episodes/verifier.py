"""Run a task's tests in its sandbox after the agent is done, the way Harbor does, where the agent cannot reach.

First `tbexp.episodes.integrity.begin`: every process the agent left is gone, what it planted where the verifier
reads is set aside and recorded, and the sandbox's execs become the verifier's. Then, as Harbor: stale results
are deleted, `tests/` is copied to `/tests` (only now, so the agent never saw it), `/tests/test.sh` runs with its
output in `/logs/verifier/test-stdout.txt` (as root's `bash`, so a script without its executable bit runs too),
and the results are read back from `/logs/verifier/` (tbexp.episodes.test_results).

The verdict follows Harbor's contract, where the reward file decides:
* a reward file (`reward.json`, else `reward.txt`) makes a result; per-test results and strict success come from
  the first source that has them (CTRF, JUnit, tbexp's own pytest plugin, pytest's report lines, else the
  reward file alone: `TestReport.source` says which);
* no reward file raises `VerifierError`: whose failure that is (the agent's, which wrecked what the tests need,
  or the environment's) is decided in `tbexp.episodes.verdicts`, never here;
* a task whose tests are pytest files whose pytest never got as far as collecting (not installed, a usage
  error, a package or interpreter that cannot be had offline: named where test.sh's output says which) raises
  `VerifierError` too, whatever reward file it wrote. A pytest that stopped at collection (the tests import a
  module the agent was to write) did run: that is the agent's failure, scored.

Before the upload, one exec (as root) empties `/tests` and makes `/logs/verifier` a fresh directory (writable by
every user, as Harbor's `empty_dirs(chmod=True)` leaves it). test.sh runs as task.toml's `[verifier] user`
(None: the image's USER). A separate verifier's image may hold the tests itself (`tests_in_image`): then `/tests`
is left as the image has it and nothing is uploaded.
"""

from __future__ import annotations

import re
import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tbexp.episodes import integrity
from tbexp.episodes.test_results import (  # noqa: F401 - the verifier's report types live with their readers
    FAILED,
    PASSED,
    SKIPPED,
    TestReport,
    VerifierError,
    offline_cause,
    output_shows_pytest_ran,
    read_guard,
    read_pytest_runs,
    read_results,
)
from tbexp.sandboxes import provision
from tbexp.sandboxes.base import Sandbox
from tbexp.tasks.harbor_task import Task

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
    record = integrity.begin(sandbox, task, tests_in_image)
    with sandbox.as_user("root"):  # what it cannot clear, the upload and the tests meet
        sandbox.exec(PREPARE_LOGS if tests_in_image else PREPARE, timeout_s=PREPARE_TIMEOUT_S)
    for tests in () if tests_in_image else (*shared_tests, task.tests_dir):
        sandbox.upload(tests, "/tests")
    test_sh = provision.verifier_command(getattr(sandbox, "provision", None), "bash /tests/test.sh")  # uv offline
    command = f"mkdir -p /logs/verifier && {test_sh} > /logs/verifier/test-stdout.txt 2>&1"
    with sandbox.as_user(task.verifier_user):
        run = sandbox.exec(integrity.exports(sandbox) + _exports(task) + command, timeout_s=task.verifier_timeout_s)
    with tempfile.TemporaryDirectory(prefix="tbexp-verifier-") as tmp:
        logs = Path(tmp)
        try:
            sandbox.download("/logs/verifier", logs)
        except FileNotFoundError as err:
            raise VerifierError(f"{task.name}: /logs/verifier missing after test.sh (exit {run.exit_code})") from err
        record.add(*(f"module planted in place of {g.get('module')}: {g.get('path')}" for g in read_guard(logs)))
        try:
            report = read_results(logs, task.name, timed_out=run.timed_out)
        except VerifierError:
            _raise_if_no_python(sandbox, task.name)
            raise
        if report.source == "reward-file" and runs_pytest(task):
            _raise_unless_pytest_ran(sandbox, task, logs, report)
    return report


def _raise_unless_pytest_ran(sandbox: Sandbox, task: Task, logs: Path, report: TestReport) -> None:
    """A pytest task whose pytest never collected: the reward file it wrote measures nothing (module docstring)."""
    stdout = logs / "test-stdout.txt"
    output = stdout.read_text(errors="replace") if stdout.is_file() else ""
    if read_pytest_runs(logs).ran or output_shows_pytest_ran(output):
        return  # it ran and reported no test: the reward file alone decides
    _raise_if_no_python(sandbox, task.name)  # the environment's fault, said as such
    rewards = ", ".join(f"{k}={v:g}" for k, v in report.rewards.items())
    cause = offline_cause(output)
    said = f"; it could not have {cause} here (offline, or not in the environment)" if cause else ""
    raise VerifierError(
        f"{task.name}: the tests are pytest files but pytest ran none (rewards written: {rewards}){said}; "
        f"last output:\n{report.log_tail[-500:]}"
    )


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
