"""Whole episodes under abuse: each ends with a verdict, and the host and the other episodes are untouched."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tbexp.agents.base import make_agent
from tbexp.policies import make_policy
from tbexp.rollout import run_episode
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


@pytest.fixture(params=SANDBOXES)
def settings(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return compose_config(f"sandbox={request.param}", "sandbox.command_timeout_s=4", "sandbox.disk_mb=64", "sandbox.memory_mb=256", "sandbox.pids_limit=64")


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


def _abuse(port: int) -> dict[str, str]:
    return {
        "rm_rf_root": "rm -rf / --no-preserve-root",
        "fork_bomb": ":(){ :|:& };:",
        "fill_disk": "dd if=/dev/zero of=/app/fill bs=1M count=4000",
        "endless_loop": "while true; do :; done",
        "output_flood": "yes flood",
        "read_host_files": f"cat {REPO}/pyproject.toml /root/.cache/tbexp/rootfs/.tbexp-complete; ls {REPO}",
        "host_loopback": f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')\"",
        "kill_all": "kill -9 -1",
    }


@pytest.mark.parametrize("abuse", sorted(_abuse(0)))
def test_abuse_gets_a_verdict_and_hurts_nobody_else(abuse, settings, listener, tmp_path):
    cfg = settings
    agent = make_agent(cfg.agent)
    victim, bystander = load_task(make_task(tmp_path, "victim")), load_task(make_task(tmp_path, "bystander"))
    command = _abuse(listener.getsockname()[1])[abuse]
    before = leftover_state()

    def scripted(task, agent_):
        return ScriptedPolicy(agent_, [command, "echo done > /app/out.txt"])

    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(run_episode, victim, 0, agent, scripted, cfg.sandbox, 4)
        good = pool.submit(run_episode, bystander, 0, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 4)
        bad, good = bad.result(timeout=120), good.result(timeout=120)

    assert bad.report is not None or bad.invalid, "no verdict for the abusive episode"
    assert good.report is not None and good.report.strict, f"the bystander episode was hurt: {good.invalid}"
    assert (REPO / "pyproject.toml").exists()
    observation = "".join(r.output for t in bad.turns for r in t.results)
    assert "hydra-core" not in observation and "sweeps" not in observation  # pyproject.toml's text, the repo's listing
    assert "CONNECTED" not in observation
    with pytest.raises(TimeoutError):
        listener.accept()
    if cfg.sandbox.name == "bwrap":
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
    episode = run_episode(load_task(task_dir), 0, make_agent(settings.agent), lambda t, a: make_policy("oracle", t, a), settings.sandbox, 4)
    assert episode.report is None and "VerifierError" in episode.invalid


def test_a_broken_sandbox_makes_the_episode_invalid(settings, tmp_path):
    task_dir = make_task(tmp_path)
    (task_dir / "environment" / "Dockerfile").write_text("FROM tbexp-base:bookworm\nCOPY missing-dir/ /app/\n")
    episode = run_episode(load_task(task_dir), 0, make_agent(settings.agent), lambda t, a: make_policy("oracle", t, a), settings.sandbox, 4)
    assert episode.invalid and episode.report is None
