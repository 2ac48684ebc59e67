"""env-from-debian-bookworm: FROM debian:bookworm-slim. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_debian_12():
    assert Path("/etc/debian_version").read_text().startswith("12")


def test_sum_written():
    assert Path("/app/sum.txt").read_text().strip() == "29"
