"""env-build-fails: a RUN that fails at build time. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_never_runs():
    assert False, "the environment cannot be built"


def test_unreachable():
    assert False
