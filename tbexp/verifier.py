"""Run a task's tests in its sandbox after the agent is done, the way Harbor does.

Stale results are deleted, `tests/` is copied to `/tests` (only now, so the
agent never saw it), `/tests/test.sh` runs with its output in
`/logs/verifier/test-stdout.txt`, and the results are read back from
`/logs/verifier/`: per-test outcomes from pytest's CTRF JSON (`ctrf.json`)
or JUnit XML (`*.xml`), and the task's own reward from `reward.json` (a
flat object of numbers) or `reward.txt` (one number). A verifier that
produced neither is broken, which makes the episode invalid (not a 0).
"""

from __future__ import annotations

import json
import math
import shlex
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from tbexp.sandboxes.base import Sandbox
from tbexp.tasks.harbor_task import Task

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
RUN_TESTS = (  # clearing stale results and running the tests in one exec
    "rm -rf /logs/verifier && mkdir -p /logs/verifier && bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1"
)


class VerifierError(RuntimeError):
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
        if self.n_total:
            return self.n_passed / self.n_total
        return min(max(self.rewards.get("reward", 0.0), 0.0), 1.0)

    @property
    def strict(self) -> bool:
        """Every test passed (or, with no per-test results, the task's reward is 1)."""
        if self.n_total:
            return self.n_passed == self.n_total
        return self.rewards.get("reward", 0.0) >= 1.0


def verify(sandbox: Sandbox, task: Task) -> TestReport:
    sandbox.upload(task.tests_dir, "/tests")
    # One exec: clearing stale results and running the tests together saves a sandbox start per episode.
    run = sandbox.exec(_exports(task) + RUN_TESTS, timeout_s=task.verifier_timeout_s)
    with tempfile.TemporaryDirectory(prefix="tbexp-verifier-") as tmp:
        try:
            sandbox.download("/logs/verifier", Path(tmp))
        except FileNotFoundError as err:
            raise VerifierError(f"{task.name}: /logs/verifier missing after test.sh (exit {run.exit_code})") from err
        return read_results(Path(tmp), task.name, timed_out=run.timed_out)


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
