"""Every error tbexp raises for bad input shares one base class, which the entry point catches."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tbexp.errors import TbexpError

PACKAGE = Path(__file__).resolve().parent.parent / "tbexp"


def _error_classes() -> list[tuple[str, str]]:
    """(module, class) for every class in tbexp whose name ends in Error, found by reading the source."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        found += [
            (module, node.name) for node in tree.body if isinstance(node, ast.ClassDef) and node.name.endswith("Error")
        ]
    return found


def test_the_scan_finds_the_errors_it_is_meant_to_check():
    names = {name for _, name in _error_classes()}
    assert {"ConfigError", "TaskError", "SandboxError", "DataError", "PolicyError"} <= names


@pytest.mark.parametrize("module,name", _error_classes())
def test_every_error_class_is_a_tbexp_error(module, name):
    assert issubclass(getattr(importlib.import_module(module), name), TbexpError)


def test_a_tbexp_error_ends_the_job_with_one_line_and_exit_2(tmp_path):
    empty = tmp_path / "no-tasks"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tbexp", "stage=eval", "tasks=dir", f"tasks.path={empty}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"tbexp: {empty}" in done.stderr
