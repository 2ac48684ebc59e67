"""env-copy-add: COPY and ADD. The first test checks the environment (it passes without work); the second needs the work."""
import os
import sys
from pathlib import Path


def test_files_in_place():
    assert sorted(p.name for p in Path("/app/parts").iterdir()) == ["a.txt", "b.txt"]
    assert Path("/opt/extra/c.txt").read_text() == "gamma\n"
    assert os.access("/usr/local/bin/join-parts", os.X_OK)


def test_joined():
    assert Path("/app/joined.txt").read_text() == "alpha\nbeta\ngamma\n"
