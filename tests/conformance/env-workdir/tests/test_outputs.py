"""env-workdir: WORKDIR (absolute, then relative). The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_workdir_made_and_used_at_build():
    assert Path("/app/src/main.py").is_file()
    assert Path("/app/src/built.txt").read_text() == "ok\n"


def test_result_beside_main():
    assert Path("/app/src/result.txt").read_text() == "result 42\n"
