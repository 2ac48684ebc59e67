"""The conformance suite (tests/conformance): every task's conformance.toml, and its expectations in each runner.

.venv/bin/python -m pytest tests/test_conformance.py -q                     # schema, bwrap, Harbor's trial runner
.venv/bin/python -m pytest tests/test_conformance.py -q -m docker           # the same tasks in Docker
.venv/bin/python -m pytest tests/test_conformance.py -q -k basic-reward-txt # one task

One test per task and runner, so a failure names the task; the numbers come from
scripts/conformance.py, the runner a user runs (tbexp's eval stage as a subprocess, Harbor's
`Trial` through tbexp.sandboxes.harbor_env). A module fixture runs the tasks the session selected, once
per runner, and each test asserts its own task's row. A sandbox that cannot be had here (no
bwrap or root file system, no Docker engine) skips its tests with the reason. The checks
themselves are shown to fail: a conformance.toml with a wrong expectation makes the script exit
1 naming the task and the numbers, and each schema error names the file and the key.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("conformance", REPO / "scripts" / "conformance.py")
conformance = importlib.util.module_from_spec(_spec)
sys.modules["conformance"] = conformance  # dataclasses look their module up by name
_spec.loader.exec_module(conformance)

pytestmark = pytest.mark.filterwarnings("ignore:Task.checksum:DeprecationWarning")  # Harbor's own, from Trial
TASK_DIRS = sorted(p for p in conformance.SUITE.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
by_task = pytest.mark.parametrize("task_dir", TASK_DIRS, ids=[p.name for p in TASK_DIRS])


@by_task
def test_conformance_toml_is_valid(task_dir):
    expectation = conformance.read_expectation(task_dir)  # raises, naming the file and key, when it is not
    assert expectation.name == task_dir.name


# ---------------------------------------------------------------- the schema check, on hand-made files


def _task(tmp_path: Path, body: str, name: str = "t") -> Path:
    task = tmp_path / name
    task.mkdir()
    (task / "task.toml").write_text('[task]\nname = "x/t"\n')
    (task / "conformance.toml").write_text(body)
    return task


GOOD = 'convention = "c"\nexpect = "scored"\noracle_reward = 1.0\nnop_reward = 0.0\n'


@pytest.mark.parametrize(
    "body, message",
    [
        (GOOD + "oracle_rewrad = 1.0\n", r"unknown key\(s\) \['oracle_rewrad'\]"),
        ('expect = "scored"\noracle_reward = 1.0\nnop_reward = 0.0\n', "convention is missing"),
        ('convention = "c"\nexpect = "scored"\noracle_reward = 1.0\n', "nop_reward is missing"),
        (GOOD.replace('"scored"', '"maybe"'), "expect = 'maybe'; choose one of"),
        (GOOD.replace("nop_reward = 0.0", "nop_reward = 1.5"), r"nop_reward = 1.5; must be a number in \[0, 1\]"),
        (GOOD.replace("nop_reward = 0.0", 'nop_reward = "0"'), "nop_reward = '0'; must be a number"),
        ("convention = [", "broken TOML"),
        (GOOD + 'unrunnable_reason = "x"\n', "unrunnable_reason is only for expect"),
        ('convention = "c"\nexpect = "unrunnable"\nunrunnable_reason = "("\n', "not a regular expression"),
        (GOOD + 'unrunnable_in = ["podman"]\n', r"unrunnable_in = \['podman'\]; a list of sandboxes"),
        (
            'convention = "c"\nexpect = "unrunnable"\nunrunnable_in = ["bwrap"]\n',
            'unrunnable_in is only for expect = "scored"',
        ),
    ],
)
def test_schema_errors_name_the_file_and_key(tmp_path, body, message):
    task = _task(tmp_path, body)
    with pytest.raises(conformance.ConformanceError, match=message) as caught:
        conformance.read_expectation(task)
    assert str(task / "conformance.toml") in str(caught.value)


def test_schema_accepts_an_unrunnable_task_without_rewards_and_a_missing_file_is_an_error(tmp_path):
    task = _task(tmp_path, 'convention = "a build that fails"\nexpect = "unrunnable"\n')
    assert conformance.read_expectation(task).oracle_reward is None
    (task / "conformance.toml").unlink()
    with pytest.raises(conformance.ConformanceError, match="conformance.toml: missing"):
        conformance.read_expectation(task)
    with pytest.raises(conformance.ConformanceError, match=r"--only: no task \['nope'\]"):
        conformance.load_suite(tmp_path, ["nope"])


def test_unrunnable_in_makes_one_sandbox_expect_unrunnable(tmp_path):
    task = _task(tmp_path, GOOD + 'unrunnable_in = ["bwrap"]\nunrunnable_reason = "docker-compose"\n')
    expectation = conformance.read_expectation(task)
    Score = conformance.Score
    refused = {p: Score(unrunnable="x/docker-compose.yaml: a multi-container task") for p in conformance.POLICIES}
    assert conformance.check_row(expectation, "bwrap", refused).failures == []
    assert conformance.check_row(expectation, "docker", refused).failures == [
        "tbexp oracle: expected scored, got unrunnable: x/docker-compose.yaml: a multi-container task",
        "tbexp nop: expected scored, got unrunnable: x/docker-compose.yaml: a multi-container task",
    ]
    other = {p: Score(unrunnable="build failed") for p in conformance.POLICIES}
    assert "not for /docker-compose/" in conformance.check_row(expectation, "bwrap", other).failures[0]


def test_a_row_fails_on_the_numbers_that_do_not_hold():
    expectation = conformance.Expectation("t", Path("t"), "c", "scored", oracle_reward=1.0, nop_reward=1 / 3)
    Score = conformance.Score
    held = conformance.check_row(
        expectation, "bwrap", {"oracle": Score(per_test=1.0, strict=1.0), "nop": Score(per_test=0.333, strict=0.0)}
    )
    assert held.failures == [] and held.checks == 3
    broken = conformance.check_row(
        expectation, "bwrap", {"oracle": Score(per_test=0.5, strict=0.0), "nop": Score(unrunnable="SandboxError: no")}
    )
    assert broken.failures == [
        "tbexp oracle per-test: expected 1.000, got 0.500",
        "tbexp oracle strict: expected 1.000, got 0.000",
        "tbexp nop: expected scored, got unrunnable: SandboxError: no",
    ]
    unrunnable = conformance.Expectation("u", Path("u"), "c", "unrunnable")
    row = conformance.check_row(
        unrunnable,
        "docker",
        {"harbor-oracle": Score(per_test=1.0, strict=1.0), "harbor-nop": Score(unrunnable="build failed")},
    )
    assert row.failures == ["Harbor oracle: expected unrunnable, got scored (per-test 1.000)"]
    build = conformance.Expectation("u", Path("u"), "c", "unrunnable", unrunnable_reason="docker build failed")
    row = conformance.check_row(
        build,
        "bwrap",
        {
            "oracle": Score(unrunnable="DockerfileError: RUN is not supported"),
            "nop": Score(unrunnable="Docker build failed: exit 1"),
        },
    )
    assert row.failures == [
        "tbexp oracle: unrunnable, but not for /docker build failed/: DockerfileError: RUN is not supported"
    ]


# ---------------------------------------------------------------- the tasks, run


def _selected(request, test_name: str) -> list[Path]:
    """The task dirs of `test_name` that this session will run (so `-k one-task` runs one task, not the suite)."""
    return sorted(
        {
            item.callspec.params["task_dir"]
            for item in request.session.items
            if getattr(item, "originalname", "") == test_name and hasattr(item, "callspec")
        }
    )


def _suite(task_dirs: list[Path]) -> tuple[list, dict[str, str]]:
    """Expectations of the tasks whose conformance.toml reads; the others' errors (their schema test fails too)."""
    suite, broken = [], {}
    for task_dir in task_dirs:
        try:
            suite.append(conformance.read_expectation(task_dir))
        except conformance.ConformanceError as err:
            broken[task_dir.name] = str(err)
    return suite, broken


def _run(request, test_name: str, sandbox: str, out: Path, harbor_only: bool = False) -> dict[str, object]:
    node = conformance.sandbox_node(sandbox, [])
    if why := conformance.sandbox_unavailable(sandbox, node):
        pytest.skip(f"{sandbox} sandbox unavailable: {why}")
    suite, broken = _suite(_selected(request, test_name))
    if harbor_only:
        scores = conformance.run_harbor(suite, sandbox, node, out, concurrency=2)
        rows = [
            conformance.check_row(e, sandbox, {f"harbor-{p}": scores[(e.name, p)] for p in conformance.POLICIES})
            for e in suite
        ]
    else:
        rows, skipped = conformance.run_suite(suite, [sandbox], out)
        assert not skipped, skipped
    return {**{r.task: r for r in rows}, **broken}


def _assert_row(results: dict[str, object], task_dir: Path) -> None:
    row = results[task_dir.name]
    assert not isinstance(row, str), row  # its conformance.toml did not read
    scores = {
        k: ("unrunnable: " + s.unrunnable) if s.unrunnable else f"per-test {s.per_test:.3f}, strict {s.strict:.0f}"
        for k, s in row.scores.items()
    }
    assert not row.failures, (
        f"{task_dir.name} ({row.sandbox}, {row.convention}): " + "; ".join(row.failures) + f"\nall scores: {scores}"
    )


@pytest.fixture(scope="module")
def bwrap_results(request, tmp_path_factory):
    return _run(request, "test_oracle_and_nop_in_bwrap", "bwrap", tmp_path_factory.mktemp("conformance-bwrap"))


def _stand_ins_needed(task_dirs: list[Path]) -> list[str]:
    """The published images the tasks' Dockerfiles start FROM or COPY --from that have local stand-ins."""
    from tbexp.sandboxes.debian_roots import stand_in
    from tbexp.sandboxes.dockerfile import read_dockerfile

    images = set()
    for task_dir in task_dirs:
        for dockerfile in [*(task_dir / "environment").rglob("Dockerfile"), task_dir / "tests" / "Dockerfile"]:
            if dockerfile.is_file():
                stages = read_dockerfile(dockerfile).stages
                images |= {stage.base_image for stage in stages}
                images |= {step.flags["from"] for stage in stages for step in stage.steps if "from" in step.flags}
    return sorted(image for image in images if stand_in(image) is not None)


@pytest.fixture(scope="module")
def docker_results(request, tmp_path_factory):
    from tests.services import build_stand_ins

    request.getfixturevalue("docker_engine")  # starts the engine and builds the base image, or skips saying why
    # A fresh engine holds none of the published images the suite starts FROM, and no registry can give them:
    # their local stand-ins are built first (once per engine), as a user of the suite does.
    if images := _stand_ins_needed(_selected(request, "test_oracle_and_nop_in_docker")):
        build_stand_ins(*images, timeout_s=1800)
    return _run(request, "test_oracle_and_nop_in_docker", "docker", tmp_path_factory.mktemp("conformance-docker"))


@pytest.fixture(scope="module")
def harbor_results(request, tmp_path_factory):
    return _run(
        request,
        "test_harbor_trial_runner_in_bwrap",
        "bwrap",
        tmp_path_factory.mktemp("conformance-harbor"),
        harbor_only=True,
    )


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first test waits for the whole selection's eval-stage runs
@by_task
def test_oracle_and_nop_in_bwrap(bwrap_results, task_dir):
    _assert_row(bwrap_results, task_dir)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(3600)  # image builds of the whole selection come first
@by_task
def test_oracle_and_nop_in_docker(docker_results, task_dir):
    _assert_row(docker_results, task_dir)


@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(3600)
@by_task
def test_harbor_trial_runner_in_bwrap(harbor_results, task_dir):
    _assert_row(harbor_results, task_dir)


@pytest.mark.sandbox
@pytest.mark.slow
def test_a_wrong_expectation_fails_the_script(tmp_path):
    """The suite can fail: a copy of a task that claims the do-nothing policy earns full marks."""
    node = conformance.sandbox_node("bwrap", [])
    if why := conformance.sandbox_unavailable("bwrap", node):
        pytest.skip(f"bwrap sandbox unavailable: {why}")
    suite = tmp_path / "suite"
    shutil.copytree(conformance.SUITE / "basic-reward-txt", suite / "basic-reward-txt")
    toml = suite / "basic-reward-txt" / "conformance.toml"
    toml.write_text(toml.read_text().replace("nop_reward = 0.0", "nop_reward = 1.0"))
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "conformance.py"), "--tasks", str(suite), "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL basic-reward-txt (bwrap): tbexp nop per-test: expected 1.000, got 0.000" in done.stdout
    assert "2 passed, 1 failed (0 of 1 task x sandbox rows hold)" in done.stdout
    assert "FAIL (1)" in (out / "conformance.md").read_text()
