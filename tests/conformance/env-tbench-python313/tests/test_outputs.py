"""env-tbench-python313: FROM Terminal-Bench's python-3-13 base image (python:3.13-slim-bookworm with tmux, curl and
asciinema, WORKDIR /app) and RUN pip install. The first test checks the environment (it passes without work); the second
needs the work."""
import shutil
import sys
from pathlib import Path


def test_base_image_contents():
    assert sys.version_info[:2] == (3, 13)
    assert all(shutil.which(tool) for tool in ("tmux", "asciinema", "curl", "pip"))


def test_max_written():
    assert Path("/app/max.txt").read_text().strip() == "12.5"
