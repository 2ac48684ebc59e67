"""env-env-arg: ENV and ARG. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_env_kept_and_arg_not():
    assert os.environ["APP_GREETING"] == "hello world" and os.environ["APP_MODE"] == "test"
    assert "WHO" not in os.environ  # an ARG lives only during the build
    assert Path("/etc/greeting").read_text() == "hello world from world\n"


def test_greeting_written():
    assert Path("/app/greeting.txt").read_text() == "hello world\n"
