"""env-from-ubuntu2404: FROM ubuntu:24.04. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_python_312_or_newer():
    # ubuntu:24.04 has Python 3.12; its Debian stand-in (trixie) has 3.13
    assert sys.version_info[:2] >= (3, 12)


def test_sum_written():
    assert Path("/app/sum.txt").read_text().strip() == "29"
