"""Agent protocols: parsing, formatting (the oracle's and training data's replies), validity."""

from __future__ import annotations

import json

import pytest

from tbexp.agents.base import Turn, make_agent
from tbexp.episodes.policies import solution_turns
from tbexp.sandboxes.base import ExecResult
from tests.conftest import compose_config


@pytest.fixture(params=["raw_command", "terminus_shell", "terminus_json", "terminus_2"])
def agent(request):
    return make_agent(compose_config(f"agent={request.param}").agent)


def test_format_then_parse_round_trips(agent):
    reply = agent.format(["grep -c ERROR app.log > /app/n.txt"], done=False)
    action = agent.parse(reply, [])
    typed = [c.removesuffix("\n") for c in action.commands]  # terminus_2 keeps the keystrokes' Enter
    assert typed == ["grep -c ERROR app.log > /app/n.txt"] and not action.error and not action.done


def test_done_needs_the_protocols_signal(agent):
    done = agent.format([], done=True)
    first = Turn(done, agent.parse(done, []))
    if agent.settings.name != "raw_command":
        assert not first.action.done  # terminus-2 asks to confirm once
        assert "Are you sure" in agent.observe(first)
        assert agent.parse(done, [first]).done
    else:
        assert first.action.done


def test_garbage_is_a_parse_error_and_an_invalid_command(agent):
    reply = "" if agent.settings.name == "raw_command" else "I would run ls"
    turn = Turn(reply, agent.parse(reply, []))
    assert turn.action.error and turn.n_commands == 1 and turn.n_valid == 0
    assert agent.observe(turn)


def test_validity_excludes_126_and_127_only():
    agent = make_agent(compose_config("agent=terminus_shell").agent)
    reply = json.dumps(
        {
            "analysis": "",
            "plan": "",
            "commands": [
                {"keystrokes": c + "\n", "duration": 0.1} for c in ("false", "nosuchcmd", "./noexec", "sleep 99")
            ],
        }
    )
    turn = Turn(reply, agent.parse(reply, []))
    turn.results = [ExecResult("", 1), ExecResult("", 127), ExecResult("", 126), ExecResult("", 124, timed_out=True)]
    assert (turn.n_commands, turn.n_valid) == (4, 2)


def test_terminus_parsing_details():
    agent = make_agent(compose_config("agent=terminus_json").agent)
    fenced = '```json\n{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "C-c", "duration": 1}, {"keystrokes": "ls\\n", "duration": 500}]}\n```'
    action = agent.parse(fenced, [])
    assert action.commands == ["ls"] and action.timeouts_s == [60.0]
    assert "missing required fields: plan" in agent.parse('{"analysis": "a", "commands": []}', []).error
    assert agent.parse('{"analysis": "a", "plan": "p", "commands": "ls"}', []).error


def test_raw_command_fences_and_observation_clipping():
    agent = make_agent(compose_config("agent=raw_command", "agent.observation_limit_chars=100").agent)
    assert agent.parse("```bash\nls -la\n```", []).commands == ["ls -la"]
    turn = Turn("yes", agent.parse("yes", []), [ExecResult("y\n" * 5000, 125, output_truncated=True)])
    text = agent.observe(turn)
    assert len(text) < 300 and "characters cut" in text and "exit 125" in text


def test_solution_lines_become_turns():
    assert solution_turns("#!/bin/bash\nset -e\nls\n") == ["set -e", "ls"]
    assert solution_turns("cat <<EOF > a\nx\nEOF\n") is None
    assert solution_turns("echo 'unclosed\nquote'\n") is None
    assert solution_turns("if true; then\necho x\nfi\n") is None


def test_a_nul_byte_in_a_command_is_an_invalid_command_not_a_crash():
    from tbexp.agents.base import ShellSession

    class NeverCalled:
        def exec(self, script, timeout_s=None):
            raise AssertionError("a command with a NUL byte must not reach the sandbox")

    result = ShellSession(NeverCalled(), "/app").run("echo a\x00b")
    assert result.exit_code == 126
