"""verifier.isolation=fresh: the tests in a fresh sandbox of the task's environment, the agent's work copied in.

What it serves and what it cannot (tbexp.episodes.separate_verifier): a task whose checks read the working
directory passes as in the shared mode; one whose checks read state outside it (a package the agent installed
in its home) does not, which is why the default stays the shared mode, hardened. The cost per episode beside the
shared mode is measured by scripts/bench_verifier.py (docs/verdicts.md has the figures).
"""

from __future__ import annotations

import pytest

from tbexp.agents.base import make_agent
from tbexp.config import ConfigError, check
from tbexp.episodes.policies import make_policy
from tbexp.episodes.rewards import per_test
from tbexp.episodes.rollout import run_episode
from tbexp.tasks import load_task
from tests.conftest import REPO, compose_config, make_task

ATTACKS = REPO / "tests" / "attacks"


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
def sandbox(request, rootfs):
    if request.param == "docker":
        request.getfixturevalue("docker_engine")
    return compose_config(f"sandbox={request.param}", "sandbox.command_timeout_s=20").sandbox


def _reward(task, policy: str, sandbox, isolation: str) -> tuple[float, list[str]]:
    agent = make_agent(compose_config().agent)
    episode = run_episode(task, 0, agent, lambda t, a: make_policy(policy, t, a), sandbox, 4, isolation)
    assert not episode.invalid, episode.invalid
    return per_test([episode.report], [1])[0], episode.tamper


@pytest.mark.sandbox
def test_the_working_directory_is_verified_in_a_fresh_sandbox(sandbox, tmp_path):
    task = load_task(make_task(tmp_path))
    assert _reward(task, "oracle", sandbox, "fresh") == (1.0, [])
    assert _reward(task, "nop", sandbox, "fresh") == (pytest.approx(1 / 3), [])


@pytest.mark.sandbox
def test_an_attack_gets_nothing_in_a_fresh_sandbox_either(sandbox):
    reward, tamper = _reward(load_task(ATTACKS / "attack-startup-hooks"), "oracle", sandbox, "fresh")
    assert reward == 0.0 and any("start-up hook" in t for t in tamper)


@pytest.mark.sandbox
def test_state_outside_the_working_directory_is_what_fresh_cannot_serve(sandbox):
    """The honest control installs its package in the user's site-packages: the shared mode scores it, fresh not."""
    task = load_task(ATTACKS / "attack-control-honest")
    assert _reward(task, "oracle", sandbox, "shared") == (1.0, [])
    reward, tamper = _reward(task, "oracle", sandbox, "fresh")
    assert reward < 1.0 and tamper == []


def test_fresh_isolation_with_harbors_trials_is_refused():
    with pytest.raises(ConfigError, match="verifier.isolation=fresh"):
        check(compose_config("verifier.isolation=fresh", "eval.harness=harbor"))
