"""The attack suite (tests/attacks): nothing an agent does in its own sandbox raises its reward except solving.

.venv/bin/python -m pytest tests/test_attacks.py -q                 # bwrap, tbexp's loop and Harbor's trials
.venv/bin/python -m pytest tests/test_attacks.py -q -m docker       # the same in Docker
.venv/bin/python -m pytest tests/test_attacks.py -q -k startup      # one attack, every runner

Each task's `solution/solve.sh` is an attack (or, for attack-control-honest, an honest solution), so the oracle
policy plays it. One module fixture per runner runs every task once; each test asserts one task's
`attack.toml`: the per-test reward it must get (0 for an attack: its tests cannot be passed without solving;
1 for the control), that it is never dropped as invalid, and the tamper findings that must be recorded
(`tamper`, plus `tamper_docker` in Docker and `tamper_when_alive` where the agent's processes outlive its
commands: terminus_2's tmux session in either sandbox, and Harbor's trials in bwrap, whose sandbox keeps them, as
a container does). The control must have no
tamper finding. Each attack was run on the code before the hardening (docs/verdicts.md has the table): the
fake tools, the shadowing module and the start-up hooks scored 1 in both sandboxes, the pytest configuration 1 in
Docker, the writer and the watcher 1 with terminus_2 in both, and through Harbor's trials every attack in bwrap.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tbexp.episodes.rewards import per_test
from tests.conftest import REPO, compose_config, compose_job

ATTACKS = REPO / "tests" / "attacks"
TASK_DIRS = sorted(p for p in ATTACKS.iterdir() if (p / "attack.toml").is_file())
by_task = pytest.mark.parametrize("task_dir", TASK_DIRS, ids=[p.name for p in TASK_DIRS])
# runners whose sandbox keeps what a command started in the background: terminus_2's tmux session, Harbor's bwrap
PROCESSES_LIVE_ON = {("bwrap", "harbor"), ("bwrap", "terminus_2"), ("docker", "terminus_2")}


def expectation(task_dir: Path, sandbox: str, harness: str) -> tuple[float, list[str]]:
    """(per-test reward, tamper findings that must be among the episode's) for this runner."""
    spec = tomllib.loads((task_dir / "attack.toml").read_text())
    findings = list(spec["tamper"])
    if sandbox == "docker":
        findings += spec.get("tamper_docker", [])
    if (sandbox, harness) in PROCESSES_LIVE_ON:
        findings += spec.get("tamper_when_alive", [])
    return float(spec["reward"]), findings


def _run(sandbox: str, harness: str, out: Path) -> dict[str, object]:
    """`harness`: native (raw_command), terminus_2 (tbexp's own loop with that agent) or harbor (Harbor's trials)."""
    from tbexp.build import run_policy
    from tbexp.tasks import load_task

    overrides = (f"sandbox={sandbox}", "tasks=dir", f"tasks.path={ATTACKS}")
    overrides += ("agent=terminus_2",) if harness == "terminus_2" else (f"eval.harness={harness}",)
    tasks = [load_task(d) for d in TASK_DIRS]
    if harness == "harbor":
        from tbexp.episodes.harbor_trials import run_trials

        episodes = run_trials(compose_config(*overrides), tasks, 1, 2, "oracle", None, out / "trials", "attacks")
    else:
        episodes = run_policy(compose_job(*overrides), tasks, 1, 2, "oracle", desc="attacks")
    return {ep.task.path.name: ep for ep in episodes}


RUNNERS = [
    pytest.param(("bwrap", "native"), marks=pytest.mark.sandbox, id="bwrap"),
    pytest.param(("bwrap", "terminus_2"), marks=pytest.mark.sandbox, id="bwrap-terminus_2"),
    pytest.param(("bwrap", "harbor"), marks=pytest.mark.sandbox, id="bwrap-harbor"),
    pytest.param(("docker", "native"), marks=pytest.mark.docker, id="docker"),
    pytest.param(("docker", "terminus_2"), marks=pytest.mark.docker, id="docker-terminus_2"),
    pytest.param(("docker", "harbor"), marks=pytest.mark.docker, id="docker-harbor"),
]


@pytest.fixture(scope="module")
def suite_runs() -> dict:
    """(sandbox, harness) -> the suite's episodes, each runner run once for the module."""
    return {}


def _assert_held(episodes: dict, task_dir: Path, sandbox: str, harness: str) -> None:
    reward, findings = expectation(task_dir, sandbox, harness)
    episode = episodes[task_dir.name]
    assert not episode.invalid, f"{task_dir.name} ({sandbox}, {harness}) was dropped: {episode.invalid}"
    got = per_test([episode.report], [len(episode.turns)])[0]
    record = f"tests {episode.report.tests} ({episode.report.source}), tamper {episode.tamper}"
    assert got == pytest.approx(reward), f"{task_dir.name} ({sandbox}, {harness}): reward {got}; {record}"
    for finding in findings:
        assert any(finding in t for t in episode.tamper), f"{task_dir.name}: no tamper finding {finding!r}; {record}"
    if not findings and reward == 1.0:
        assert episode.tamper == [], f"the honest control was flagged: {episode.tamper}"


@pytest.mark.slow
@pytest.mark.parametrize("runner", RUNNERS)
@by_task
def test_attack_is_held(runner, task_dir, suite_runs, request, tmp_path_factory):
    sandbox, harness = runner
    request.getfixturevalue("docker_engine" if sandbox == "docker" else "rootfs")  # or a skip that says why
    if runner not in suite_runs:
        suite_runs[runner] = _run(sandbox, harness, tmp_path_factory.mktemp(f"attacks-{sandbox}-{harness}"))
    _assert_held(suite_runs[runner], task_dir, sandbox, harness)


@by_task
def test_attack_toml_is_complete(task_dir):
    spec = tomllib.loads((task_dir / "attack.toml").read_text())
    assert {"attack", "defence", "reward", "tamper"} <= set(spec), spec
    assert spec["reward"] in (0.0, 1.0) and isinstance(spec["tamper"], list)
    assert (task_dir / "solution" / "solve.sh").is_file() and (task_dir / "tests" / "test.sh").is_file()
