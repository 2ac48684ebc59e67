"""env-user: USER (a non-root user). The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_runs_as_agent():
    import pwd
    assert os.getuid() == 1001 and pwd.getpwuid(os.getuid()).pw_name == "agent"
    assert Path.home() == Path("/home/agent")


def test_who_written():
    assert Path("/app/who.txt").read_text() == "agent\nremember\n"
