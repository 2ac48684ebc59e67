"""What a verifier run leaves in `/logs/verifier`, read back: the task's rewards and its per-test results.

The reward file is the verdict (Harbor's contract): `reward.json` (a flat object of finite numbers, every name
kept) else `reward.txt` (one number, named `reward`). Per-test results come from the first source that reports
any test, in this order, and `TestReport.source` says which one decided:

1. `ctrf`: the task's CTRF report (`ctrf.json`, pytest-json-ctrf);
2. `junit`: the task's JUnit XML (`*.xml`);
3. `tbexp-pytest`: what tbexp's own pytest plugin gathered from every pytest run test.sh made
   (`.tbexp/run-*.json`; verifier_runtime/tbexp_pytest_results.py), collection errors counted as failed tests;
4. `pytest-output`: pytest's report lines in test.sh's output (`-rA` summary lines or `-v` lines, else the
   counts of its last line: `2 failed, 1 passed in 0.1s`);
5. `reward-file`: none of them: the reward file alone decides, as a pass (>= 1) or not.

`pytest_ran` tells a pytest that ran (tests, a collection error, or an empty collection it finished) from one
that never got that far (not installed, a usage error, an interpreter it could not have offline), which
tbexp.episodes.verifier turns into a VerifierError; `offline_cause` names what test.sh could not have offline.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from tbexp.errors import TbexpError

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
SOURCES = ("ctrf", "junit", "tbexp-pytest", "pytest-output", "reward-file")
TBEXP_DIR = ".tbexp"  # under /logs/verifier: tbexp's plugin and start-up guard write here
FINISHED_NORMALLY = {0, 1, 2, 5}  # pytest's exit codes of a run that collected (2: interrupted, e.g. collection errors)


class VerifierError(TbexpError, RuntimeError):
    """The tests could not be run or produced no result."""


@dataclass(frozen=True)
class TestReport:
    __test__ = False  # not a pytest test class, despite its name

    tests: dict[str, str] = field(default_factory=dict)  # test name -> passed | failed | skipped
    rewards: dict[str, float] = field(default_factory=dict)  # reward.json / reward.txt, as written by the task
    log_tail: str = ""
    source: str = ""  # which of SOURCES decided the per-test results; "" for a report tbexp made itself

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
        """Every test passed and the task's reward says so too (see `solved`)."""
        return self.solved("reward")

    def fraction(self, task_reward: str = "reward") -> float:
        """Per-test pass fraction, or, with no per-test results, the task's reward named `task_reward` in [0, 1]."""
        if self.n_total:
            return self.n_passed / self.n_total
        return min(max(self.rewards.get(task_reward, 0.0), 0.0), 1.0)

    def solved(self, task_reward: str = "reward") -> bool:
        """Every test passed, and the task's reward named `task_reward`, where it wrote one, is at least 1.

        >>> TestReport({"a": PASSED}, {"reward": 0.0}).solved(), TestReport({"a": PASSED}).solved()
        (False, True)
        """
        verdict = self.rewards.get(task_reward)
        if self.n_total:
            return self.n_passed == self.n_total and (verdict is None or verdict >= 1.0)
        return (verdict or 0.0) >= 1.0


@dataclass(frozen=True)
class PytestRuns:
    """What tbexp's plugin wrote: one entry per pytest run test.sh made."""

    runs: list[dict] = field(default_factory=list)

    @property
    def tests(self) -> dict[str, str]:
        tests: dict[str, str] = {}
        for i, run in enumerate(self.runs):
            found = {**run.get("tests", {}), **{f"{e}::collection": FAILED for e in run.get("collection_errors", [])}}
            for name, status in found.items():
                tests[name if name not in tests else f"run{i}::{name}"] = _status(str(status))
        return tests

    @property
    def ran(self) -> bool:
        """A run finished having collected (tests, collection errors, or nothing to collect)."""
        return any(r.get("finished") and r.get("exitstatus") in FINISHED_NORMALLY for r in self.runs)


def read_results(logs: Path, task_name: str = "", timed_out: bool = False) -> TestReport:
    """Parse a downloaded `/logs/verifier` directory: the rewards (required), per-test results by SOURCES."""
    rewards = read_rewards(logs)
    stdout = logs / "test-stdout.txt"
    output = stdout.read_text(errors="replace") if stdout.is_file() else ""
    tail = output[-2000:]
    if not rewards:
        why = "timed out" if timed_out else "wrote no reward file (reward.txt or reward.json)"
        raise VerifierError(f"{task_name}: test.sh {why}; last output:\n{tail[-500:]}")
    for source, tests in _sources(logs, output):
        if any(s != SKIPPED for s in tests.values()):
            return TestReport(tests=tests, rewards=rewards, log_tail=tail, source=source)
    return TestReport(rewards=rewards, log_tail=tail, source="reward-file")


def _sources(logs: Path, output: str):
    """(source, tests) in order of precedence, each read only when the ones before it reported nothing."""
    yield "ctrf", read_ctrf(logs / "ctrf.json") if (logs / "ctrf.json").is_file() else {}
    junit: dict[str, str] = {}
    for xml in sorted(logs.glob("*.xml")):
        junit.update(read_junit(xml))
    yield "junit", junit
    yield "tbexp-pytest", read_pytest_runs(logs).tests
    yield "pytest-output", parse_pytest_output(output)


def read_pytest_runs(logs: Path) -> PytestRuns:
    runs = []
    for path in sorted((logs / TBEXP_DIR).glob("run-*.json")):
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a run that died while writing: its start record is gone with it
    return PytestRuns(runs)


def read_guard(logs: Path) -> list[dict]:
    """The imports tbexp's start-up guard refused during the tests (verifier_runtime/sitecustomize.py)."""
    path = logs / TBEXP_DIR / "guard.jsonl"
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


# -- pytest's own report lines ------------------------------------------------------------------------------------

_SHORT = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)")  # -rA's short test summary
_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")  # -v
_SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s\b.*$")  # "2 failed, 1 passed in 0.12s"
_NO_TESTS = re.compile(r"^=*\s*no tests ran in [\d.]+s\b")
_OUTCOME = {"PASSED": PASSED, "XPASS": PASSED, "FAILED": FAILED, "ERROR": FAILED, "SKIPPED": SKIPPED, "XFAIL": SKIPPED}


def parse_pytest_output(output: str) -> dict[str, str]:
    """Per-test results from pytest's report lines; only counts where it printed no test names.

    >>> parse_pytest_output("PASSED t.py::a\\nFAILED t.py::b - assert 0\\n=== 1 failed, 1 passed in 0.1s ===")
    {'t.py::a': 'passed', 't.py::b': 'failed'}
    >>> parse_pytest_output("..F\\n1 failed, 2 passed in 0.05s")
    {'pytest-output#0/1': 'failed', 'pytest-output#0/2': 'passed', 'pytest-output#0/3': 'passed'}
    """
    named: dict[str, str] = {}
    for line in output.splitlines():
        line = line.rstrip()
        if m := _SHORT.match(line):
            named[m.group(2)] = _OUTCOME[m.group(1)]
        elif m := _VERBOSE.match(line):
            named.setdefault(m.group(1), _OUTCOME[m.group(2)])
    if named:
        return named
    counted: dict[str, str] = {}
    for run, counts in enumerate(_summaries(output)):
        n = 0
        for outcome, status in (("failed", FAILED), ("error", FAILED), ("passed", PASSED), ("skipped", SKIPPED)):
            for _ in range(counts.get(outcome, 0)):
                n += 1
                counted[f"pytest-output#{run}/{n}"] = status
    return counted


def _summaries(output: str) -> list[dict[str, int]]:
    found = []
    for line in output.splitlines():
        if m := _SUMMARY.match(line.strip()):
            counts: dict[str, int] = {}
            for part in m.group(1).split(", "):
                number, _, word = part.partition(" ")
                key = {"errors": "error", "xfailed": "skipped", "xpassed": "passed", "deselected": ""}.get(word, word)
                if key and number.isdigit():
                    counts[key] = counts.get(key, 0) + int(number)
            found.append(counts)
    return found


def output_shows_pytest_ran(output: str) -> bool:
    """pytest printed the line it ends a collected session with (results, or that nothing ran)."""
    return any(_SUMMARY.match(line.strip()) or _NO_TESTS.match(line.strip()) for line in output.splitlines())


_OFFLINE = (
    (re.compile(r"Because (\S+?)(?:==\S+)? was not found in the provided package locations"), "package {}"),
    (re.compile(r"No matching distribution found for (\S+)"), "package {}"),
    (re.compile(r"Could not find a version that satisfies the requirement (\S+)"), "package {}"),
    (re.compile(r"No interpreter found for (Python [\d.]+)"), "{}"),
    (re.compile(r"(?:^|\s)(\S+): command not found"), "command {}"),
    (re.compile(r"error: unrecognized arguments: (.+)"), "pytest options {} (a plugin the environment lacks)"),
    (re.compile(r"Unable to locate package (\S+)"), "Debian package {}"),
)


def offline_cause(output: str) -> str:
    """What test.sh's output says it could not have here, e.g. 'package numpy'; '' when it says nothing of it."""
    causes = []
    for pattern, said in _OFFLINE:
        for m in pattern.finditer(output):
            cause = said.format(m.group(1).strip())
            if cause not in causes and not cause.startswith(("command apt", "command curl")):
                causes.append(cause)
    return ", ".join(causes[:4])


# -- the report formats and the reward file -----------------------------------------------------------------------


def read_ctrf(path: Path) -> dict[str, str]:
    try:
        results = json.loads(path.read_text())["results"]["tests"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise VerifierError(f"{path.name}: not a CTRF report: {err}") from err
    return {t["name"]: _status(t.get("status", FAILED)) for t in results}


def read_junit(path: Path) -> dict[str, str]:
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


def read_rewards(logs: Path) -> dict[str, float]:
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
