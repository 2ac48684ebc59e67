"""Whole episodes under abuse: each gets the verdict tbexp.episodes.verdicts prescribes, and the host and the other episodes are untouched."""

from __future__ import annotations

import base64
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tbexp.agents.base import make_agent
from tbexp.episodes.policies import make_policy
from tbexp.episodes.rewards import per_test
from tbexp.episodes.rollout import run_episode
from tbexp.tasks import load_task
from tests.conftest import REPO, compose_config, leftover_state, make_task

SANDBOXES = ["bwrap", pytest.param("docker", marks=pytest.mark.docker)]


class ScriptedPolicy:
    """Replies with fixed commands, then says done: an agent we control completely."""

    def __init__(self, agent, commands):
        self.uploads = {}
        self.replies = [agent.format([c], done=False) for c in commands]
        self.done = agent.format([], done=True)

    def act(self, messages):
        return self.replies.pop(0) if self.replies else self.done


def _settings(sandbox: str, command_timeout_s: float = 4):
    return compose_config(
        f"sandbox={sandbox}",
        f"sandbox.command_timeout_s={command_timeout_s}",
        "sandbox.disk_mb=64",
        "sandbox.memory_mb=256",
        "sandbox.pids_limit=64",
    )


@pytest.fixture(params=SANDBOXES)
def sandbox_name(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return request.param


@pytest.fixture
def settings(sandbox_name):
    return _settings(sandbox_name)


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


# A conftest.py that would turn every test into a pass, planted where the verifier will put the tests.
PLANTED_CONFTEST = (
    "import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
)
SOLVED, INPUT_ONLY, TWO_OF_THREE = 1.0, 1 / 3, 2 / 3  # per-test fractions of make_task's three tests
DAMAGED_0 = "damaged, 0"  # scored 0, with Episode.damage saying what broke


def _abuse(port: int, host_target: Path) -> dict[str, tuple[str, bool]]:
    """attack -> (command, whether the scripted agent then solves the task with `echo done > /app/out.txt`)."""
    plant = base64.b64encode(PLANTED_CONFTEST.encode()).decode()
    return {
        "rm_rf_root": ("rm -rf --no-preserve-root / 2>/dev/null", True),
        "fork_bomb": (":(){ :|:& };:", True),
        "fill_disk": ("dd if=/dev/zero of=/app/fill bs=1M count=4000", True),
        "endless_loop": ("while true; do :; done", True),
        "hang_past_timeout": ("sleep 600", True),
        "output_flood": ("yes flood", True),
        "read_host_files": (f"cat {REPO}/pyproject.toml /root/.cache/tbexp/rootfs/.tbexp-complete; ls {REPO}", True),
        "host_loopback": (
            f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\"",
            True,
        ),
        "kill_all": ("kill -9 -1", True),
        "delete_logs_and_tests": ("rm -rf /logs /tests; touch /logs /tests", True),
        "symlink_in_tests": (f"mkdir -p /tests && ln -sfn {host_target} /tests/test.sh", True),
        "conftest_in_tests": (f"mkdir -p /tests && echo {plant} | base64 -d > /tests/conftest.py", False),
        "fake_sandbox_error": ("echo 'bwrap: fake failure'; exit 1", True),
    }


def _expected(abuse: str, sandbox: str) -> float | str:
    """The verdict each attack must get: the per-test fraction it is scored with, or DAMAGED_0. Never invalid."""
    from tbexp.sandboxes import docker_containers

    if abuse == "fill_disk":  # bwrap: one tmpfs of disk_mb, so the verifier's upload fails: the agent's doing
        capped = sandbox == "bwrap" or docker_containers._storage_opt_ok  # docker without quotas: RLIMIT_FSIZE stops dd
        return DAMAGED_0 if capped else SOLVED
    if abuse == "rm_rf_root":  # bwrap's root is read-only, so only the writable paths go; docker loses bash itself
        return TWO_OF_THREE if sandbox == "bwrap" else DAMAGED_0
    if (
        abuse == "conftest_in_tests"
    ):  # the planted hook is cleared before the tests arrive: only the untouched input passes
        return INPUT_ONLY
    if abuse == "fake_sandbox_error" and sandbox == "bwrap":  # read as bwrap failing: the agent's turns end, unsolved
        return INPUT_ONLY
    return SOLVED


@pytest.mark.parametrize("abuse", sorted(_abuse(0, Path("/"))))
def test_abuse_gets_its_verdict_and_hurts_nobody_else(abuse, sandbox_name, listener, tmp_path):
    # rm -rf / may take longer than 4 s to delete a container's whole file system; it must finish to be deterministic
    cfg = _settings(sandbox_name, 60 if abuse == "rm_rf_root" else 4)
    agent = make_agent(cfg.agent)
    victim, bystander = load_task(make_task(tmp_path, "victim")), load_task(make_task(tmp_path, "bystander"))
    host_target = tmp_path / "host-file-the-verifier-must-not-write"
    command, then_solve = _abuse(listener.getsockname()[1], host_target)[abuse]
    before = leftover_state()

    def scripted(task, agent_):
        return ScriptedPolicy(agent_, [command, "echo done > /app/out.txt"] if then_solve else [command])

    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(run_episode, victim, 0, agent, scripted, cfg.sandbox, 4)
        good = pool.submit(run_episode, bystander, 0, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 4)
        bad, good = bad.result(timeout=180), good.result(timeout=180)

    expected = _expected(abuse, sandbox_name)
    assert not bad.invalid, f"the abusive episode was dropped: {bad.invalid}"
    if expected == DAMAGED_0:
        assert bad.damage and bad.report.tests == {} and bad.report.rewards == {}, (
            f"not scored 0 with damage: {bad.damage!r} {bad.report}"
        )
        assert per_test([bad.report], [1]) == [0.0]
    else:
        assert bad.report.tests, f"no test results: {bad.damage}"
        assert per_test([bad.report], [1]) == [pytest.approx(expected)], f"{bad.report.tests} {bad.damage}"
        assert bool(bad.damage) == (abuse == "fake_sandbox_error" and sandbox_name == "bwrap"), bad.damage
    if abuse == "hang_past_timeout":
        assert bad.turns[0].results[0].timed_out
    assert good.report is not None and good.report.strict, f"the bystander episode was hurt: {good.invalid}"
    assert (REPO / "pyproject.toml").exists() and not host_target.exists()
    observation = "".join(r.output for t in bad.turns for r in t.results)
    assert "hydra-core" not in observation and "sweeps" not in observation  # pyproject.toml's text, the repo's listing
    assert "CONNECTED" not in observation
    with pytest.raises(TimeoutError):
        listener.accept()
    if sandbox_name == "bwrap":
        assert leftover_state() == before
    else:
        assert _my_containers_gone(), "a container of this process outlived its episode"


def _my_containers_gone(within_s: float = 10.0) -> bool:
    import os
    import time

    import docker

    api = docker.APIClient(version="auto")
    deadline = time.monotonic() + within_s
    while api.containers(all=True, filters={"label": f"tbexp.owner_pid={os.getpid()}"}):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)  # removal of an auto-removed container may still be in flight
    return True


def test_an_episode_that_keeps_going_is_stopped_at_max_turns(settings, tmp_path):
    agent = make_agent(settings.agent)
    task = load_task(make_task(tmp_path))
    episode = run_episode(task, 0, agent, lambda t, a: ScriptedPolicy(a, ["true"] * 50), settings.sandbox, 3)
    assert len(episode.turns) == 3 and episode.report is not None and not episode.report.strict


def test_a_broken_verifier_makes_the_episode_invalid_not_zero(settings, tmp_path):
    task_dir = make_task(tmp_path)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\nexit 0\n")  # writes no results at all
    episode = run_episode(
        load_task(task_dir),
        0,
        make_agent(settings.agent),
        lambda t, a: make_policy("oracle", t, a),
        settings.sandbox,
        4,
    )
    assert episode.report is None and "VerifierError" in episode.invalid


def test_a_broken_sandbox_makes_the_episode_invalid(settings, tmp_path):
    """A sandbox that cannot be made (its Dockerfile copies a folder the task lacks) is the infrastructure's failure:
    invalid, for that reason, before the agent acts. The same task with its Dockerfile intact is scored, so the
    verdict is the broken sandbox's and not some other fault's (any exception in an episode also ends invalid)."""

    def episode_of(task_dir):
        return run_episode(load_task(task_dir), 0, make_agent(settings.agent), _oracle, settings.sandbox, 4)

    sound = episode_of(make_task(tmp_path / "sound"))
    assert not sound.invalid and sound.report is not None and sound.report.strict, sound.invalid

    broken = make_task(tmp_path / "broken")
    (broken / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nCOPY missing-dir/ /app/\n")
    episode = episode_of(broken)
    assert episode.report is None and not episode.damage and not episode.turns  # the agent never acted
    assert "missing-dir" in episode.invalid and not episode.invalid.startswith("unexpected"), episode.invalid


def _oracle(task, agent):
    return make_policy("oracle", task, agent)


def test_a_pytest_task_whose_verifier_ran_no_test_is_invalid_not_zero(settings, tmp_path):
    # What an offline Terminal-Bench test.sh does: its pytest cannot be had, it writes reward 0 and pytest never ran.
    task_dir = make_task(tmp_path)
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\nuvx pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py\necho 0 > /logs/verifier/reward.txt\n"
    )
    episode = run_episode(load_task(task_dir), 0, make_agent(settings.agent), _oracle, settings.sandbox, 4)
    assert episode.report is None and not episode.damage
    assert (
        "pytest ran none" in episode.invalid
        and "command uvx" in episode.invalid
        and "fails in a fresh sandbox too" in episode.invalid
    )


def test_a_task_that_is_not_pytest_is_scored_from_its_reward_file(settings, tmp_path):
    task_dir = make_task(tmp_path)
    (task_dir / "tests" / "test_outputs.py").unlink()
    (task_dir / "tests" / "test.sh").write_text(
        "#!/bin/bash\ngrep -qx done /app/out.txt && echo 1 > /logs/verifier/reward.txt || echo 0.25 > /logs/verifier/reward.txt\n"
    )
    agent, task = make_agent(settings.agent), load_task(task_dir)
    solved = run_episode(task, 0, agent, _oracle, settings.sandbox, 4)
    unsolved = run_episode(task, 1, agent, lambda t, a: ScriptedPolicy(a, ["true"]), settings.sandbox, 4)
    assert not solved.invalid and solved.report.rewards == {"reward": 1.0} and solved.report.strict
    assert not unsolved.invalid and not unsolved.damage and per_test([unsolved.report], [1]) == [0.25]


def test_a_verifier_failure_after_an_agent_that_ran_nothing_is_invalid(settings, tmp_path):
    # No command ran, so nothing the agent did can have broken the verifier; no control sandbox is needed.
    task_dir = make_task(tmp_path)
    (task_dir / "tests" / "test.sh").write_text("#!/bin/bash\nexit 0\n")
    episode = run_episode(
        load_task(task_dir), 0, make_agent(settings.agent), lambda t, a: make_policy("nop", t, a), settings.sandbox, 4
    )
    assert episode.report is None and "VerifierError" in episode.invalid and "fresh sandbox" not in episode.invalid
