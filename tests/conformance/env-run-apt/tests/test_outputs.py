"""env-run-apt: RUN apt-get install. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_bc_installed():
    import shutil
    assert shutil.which("bc")


def test_power_written():
    assert Path("/app/big.txt").read_text().strip() == str(2**70)
