"""env-from-debian-trixie: FROM debian:trixie-slim. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_debian_13():
    assert Path("/etc/debian_version").read_text().startswith("13")


def test_sum_written():
    assert Path("/app/sum.txt").read_text().strip() == "29"
