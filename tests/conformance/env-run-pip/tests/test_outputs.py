"""env-run-pip: RUN pip install. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_tomli_w_installed():
    import tomli_w  # noqa: F401


def test_toml_written():
    import tomllib
    assert tomllib.loads(Path("/app/data.toml").read_text()) == {"name": "tbexp", "version": 3}
