"""agent=terminus_2: its protocol (Harbor's parser and messages), its settings, and episodes in a tmux pane.

The message-for-message comparison with Harbor's own Terminus2 is tests/test_terminus_2_parity.py.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tbexp.agents.base import Turn, make_agent
from tbexp.config import ConfigError
from tbexp.episodes.policies import ModelPolicy, make_policy
from tbexp.episodes.rollout import run_episode
from tbexp.tasks import load_task
from tests.conftest import compose_config, make_task


def _reply(keys: list[str], duration_s: float) -> str:
    commands = [{"keystrokes": k, "duration": duration_s} for k in keys]
    return json.dumps({"analysis": "", "plan": "", "commands": commands})


def _agent(*overrides: str):
    return make_agent(compose_config("agent=terminus_2", *overrides).agent)


@pytest.mark.parametrize("parser", ["json", "xml"])
def test_format_parses_back_without_warnings(parser):
    agent = _agent(f"agent.parser={parser}")
    action = agent.parse(agent.format(["ls -la", "cat a.txt"], done=False), [])
    assert action.commands == ["ls -la\n", "cat a.txt\n"] and action.timeouts_s == [0.1, 0.1]
    assert not action.error and not action.warning and not action.done
    wait = agent.parse(agent.settle_reply(2.5), [])
    assert wait.commands == [""] and wait.timeouts_s == [2.5] and not wait.warning


def test_task_complete_needs_two_replies_in_a_row():
    agent = _agent()
    done = agent.format([], done=True)
    first = Turn(done, agent.parse(done, []))
    assert not first.action.done and "Are you sure" in agent.observe(first)
    garbage = Turn("nothing useful", agent.parse("nothing useful", [first]))
    assert garbage.action.error  # an unparseable reply leaves the question pending, as in Harbor
    assert agent.parse(done, [first, garbage]).done
    busy = Turn("", agent.parse(agent.format(["ls"], done=False), [first]))
    assert not agent.parse(done, [first, busy]).done  # a turn without it withdraws the first


def test_harbors_warnings_errors_and_duration_cap():
    agent = _agent()
    body = {"analysis": "a", "plan": "p", "commands": [{"keystrokes": "sleep 99\n", "duration": 500}]}
    noisy = agent.parse("Sure:\n" + json.dumps(body), [])
    assert noisy.timeouts_s == [60] and noisy.warning.startswith("WARNINGS: ")
    turn = Turn("", noisy, screen="New Terminal Output:\nroot@vm:/app# sleep 99\n")
    assert agent.observe(turn).startswith("Previous response had warnings:\nWARNINGS: ")
    broken = Turn("", agent.parse('{"analysis": "a"}', []))
    assert broken.action.error.startswith("ERROR: ") and broken.n_valid == 0
    assert agent.observe(broken).endswith("Please fix these issues and provide a proper JSON response.")
    xml = _agent("agent.parser=xml")
    assert xml.observe(Turn("", xml.parse("no xml here", []))).endswith("provide a proper response.")


def test_output_is_limited_as_harbor_limits_it():
    agent = _agent()
    turn = Turn("", agent.parse(agent.format(["yes"], done=False), []), screen="y\n" * 20_000)
    shown = agent.observe(turn)
    assert "output limited to 10000 bytes" in shown and len(shown.encode()) < 10_200


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="agent.summarize"):
        _agent("agent.summarize=true")
    with pytest.raises(ConfigError, match="agent.parser"):
        _agent("agent.parser=yaml")


def test_the_prompt_is_harbors_template():
    from pathlib import Path

    from harbor.agents.terminus_2 import terminus_2 as harbor_terminus

    template = (Path(harbor_terminus.__file__).parent / "templates" / "terminus-json-plain.txt").read_text()
    task = SimpleNamespace(instruction="Do the thing.\n")
    assert _agent().prompt(task, "SCREEN") == template.format(instruction="Do the thing.\n", terminal_state="SCREEN")


@pytest.mark.sandbox
@pytest.mark.parametrize("policy", ["oracle", "nop"])
def test_oracle_solves_and_nop_fails_in_a_pane(policy, rootfs, tmp_path):
    cfg = compose_config("agent=terminus_2")
    task = load_task(make_task(tmp_path, solution="cd /app\necho done > out.txt\n"))
    episode = run_episode(task, 0, make_agent(cfg.agent), lambda t, a: make_policy(policy, t, a), cfg.sandbox, 20)
    assert not episode.invalid and not episode.damage, episode.invalid or episode.damage
    assert episode.report.rewards["reward"] == (1.0 if policy == "oracle" else 0.0)
    assert episode.messages[0]["content"].startswith("You are an AI assistant tasked with solving command-line")
    if policy == "oracle":  # the keystrokes reached a real shell, which kept the `cd`
        assert "tbexp-oracle-42" in episode.messages[-2]["content"] + episode.messages[-4]["content"]
    assert len(episode.turns) == (5 if policy == "oracle" else 2)


@pytest.mark.sandbox
def test_harbors_keystroke_log_stays_off_the_console(rootfs, tmp_path, caplog):
    # Harbor's logger is at DEBUG from its import on; its TmuxSession logs every send-keys there.
    caplog.set_level(logging.DEBUG)  # the root and the capture take everything; only Harbor's own level filters
    cfg = compose_config("agent=terminus_2")
    task = load_task(make_task(tmp_path, solution="cd /app\necho done > out.txt\n"))
    episode = run_episode(task, 0, make_agent(cfg.agent), lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 20)
    assert episode.report.rewards["reward"] == 1.0
    harbor_debug = [r.getMessage() for r in caplog.records if r.name.startswith("harbor") and r.levelno < logging.INFO]
    assert not harbor_debug, harbor_debug[:3]


@pytest.mark.sandbox
def test_a_background_job_and_a_control_key_live_in_the_pane(rootfs, tmp_path):
    """What only a terminal can do: a process that outlives its turn, interrupted by C-c a turn later."""
    cfg = compose_config("agent=terminus_2")
    agent = make_agent(cfg.agent)
    body = lambda keys: _reply(keys, 0.3)  # noqa: E731
    replies = [
        body(["sleep 1000 && echo never\n"]),
        body(["C-c"]),
        body(["echo done > /app/out.txt\n"]),
        agent.format([], done=True),
        agent.format([], done=True),
    ]
    policy = SimpleNamespace(uploads={}, act=lambda messages: replies.pop(0))
    episode = run_episode(load_task(make_task(tmp_path)), 0, agent, lambda t, a: policy, cfg.sandbox, 20)
    assert not episode.invalid, episode.invalid
    assert "^C" in episode.messages[4]["content"] and episode.report.rewards["reward"] == 1.0


@pytest.mark.sandbox
def test_a_model_out_of_context_ends_the_episode_without_a_made_up_reply(rootfs, tmp_path):
    cfg = compose_config("agent=terminus_2")
    agent = make_agent(cfg.agent)
    task = load_task(make_task(tmp_path))
    runtime = SimpleNamespace(
        seed=None,
        renderer=SimpleNamespace(initial_tokens=lambda text: [1] * 100),
        params=SimpleNamespace(max_tokens=64),
        max_context_tokens=128,
    )
    episode = run_episode(task, 0, agent, lambda t, a: ModelPolicy(t, a, runtime), cfg.sandbox, 20)
    assert not episode.invalid and episode.turns == [] and len(episode.messages) == 1
    assert episode.report.rewards["reward"] == 0.0


@pytest.mark.sandbox
def test_an_environment_without_tmux_is_an_invalid_episode_that_says_so(rootfs, tmp_path):
    cfg = compose_config("agent=terminus_2")
    task = load_task(make_task(tmp_path))
    agent = make_agent(cfg.agent)

    class NoTmux(type(agent)):
        def open(self, sandbox):
            exec_ = sandbox.exec
            sandbox.exec = lambda command, timeout_s=None: exec_(command.replace("tmux -V", "false"), timeout_s)
            return super().open(sandbox)

    episode = run_episode(task, 0, NoTmux(cfg.agent), lambda t, a: make_policy("nop", t, a), cfg.sandbox, 20)
    assert "no tmux in its environment" in episode.invalid


@pytest.mark.docker
@pytest.mark.slow
def test_the_pane_in_docker_keeps_a_job_and_solves_with_the_oracle(docker_engine, tmp_path):
    cfg = compose_config("agent=terminus_2", "sandbox=docker", "sandbox.max_lifetime_s=600")
    agent = make_agent(cfg.agent)
    task = load_task(make_task(tmp_path, solution="cd /app\necho done > out.txt\n"))
    episode = run_episode(task, 0, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 20)
    assert not episode.invalid and episode.report.rewards["reward"] == 1.0, episode.invalid
    body = lambda keys: _reply(keys, 0.5)  # noqa: E731
    # a job that outlives its turn and the execs in between (the per-exec clean-up is off), then C-d ends the shell
    replies = [
        body(["(sleep 1; echo la''ter) > /app/late.txt &\n"]),
        body([""]).replace("0.5", "2.0"),
        body(["cat /app/late.txt\n"]),
        body(["C-d"]),
    ]
    policy = SimpleNamespace(uploads={}, act=lambda messages: replies.pop(0) if replies else agent.format([], True))
    late = run_episode(load_task(make_task(tmp_path / "late")), 0, agent, lambda t, a: policy, cfg.sandbox, 8)
    assert not late.invalid, late.invalid
    assert "\nlater\n" in late.messages[6]["content"]
    assert len(late.turns) == 4  # the session is gone after C-d: the episode ends before a 5th reply


def test_every_environment_tbexp_builds_has_tmux(rootfs):
    from tbexp.sandboxes import debian_roots, docker_images, environments
    from tests.conftest import REPO

    packages = next(
        line for line in (REPO / "scripts/build_rootfs.sh").read_text().splitlines() if line.startswith("PACKAGES=")
    )
    assert "tmux" in packages.removeprefix("PACKAGES=").split(",")
    assert "tmux" in debian_roots.SUITE_PACKAGES
    assert "usr/bin/tmux" in environments.TOOLS and " tmux " in environments.ENSURE_TOOLS
    assert "command -v tmux" in docker_images.TOOLS_CHECK and " tmux " in docker_images.TOOLS_CHECK
    assert (rootfs / "usr/bin/tmux").is_file()  # the built-in root itself


@pytest.mark.sandbox
def test_the_oracle_waits_for_a_slow_solution_before_it_says_done(rootfs, tmp_path):
    cfg = compose_config("agent=terminus_2")
    task = load_task(make_task(tmp_path, solution="sleep 2\necho done > /app/out.txt\n"))
    episode = run_episode(task, 0, make_agent(cfg.agent), lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 20)
    assert not episode.invalid and episode.report.rewards["reward"] == 1.0, episode.invalid
    waits = [t for t in episode.turns if t.action.commands == [""]]
    assert waits and len(episode.turns) == 3 + len(waits) + 2  # 2 lines, the marker, the waits, done twice
