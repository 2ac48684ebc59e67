"""load-task-users: the first test checks the verifier's user (it passes without work); the second needs the work."""
import os
import pwd
from pathlib import Path


def test_verifier_runs_as_its_user():
    assert pwd.getpwuid(os.getuid()).pw_name == "daemon"


def test_agent_ran_as_its_user():
    assert Path("/tmp/agent-user.txt").read_text().strip() == "nobody"
