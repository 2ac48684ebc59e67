"""env-tbench-ubuntu2404: FROM Terminal-Bench's ubuntu-24-04 base image (ubuntu:24.04 with tmux and asciinema, WORKDIR
/app; no pip until the task installs python3-pip, and pip needs --break-system-packages there). The first test checks the
environment (it passes without work); the second needs the work."""
import shutil
from pathlib import Path


def test_base_image_contents():
    assert all(shutil.which(tool) for tool in ("tmux", "asciinema", "python3", "pip3"))


def test_sorted_written():
    assert Path("/app/sorted.txt").read_text() == "alpha\nbravo\ncharlie\ndelta\n"
