"""env-from-python311: FROM python:3.11-slim. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_python_311():
    assert sys.version_info[:2] == (3, 11)


def test_sum_written():
    assert Path("/app/sum.txt").read_text().strip() == "29"
