"""Writing one built-in instance out as a Harbor task directory.

Layout: task.toml, instruction.md, environment/Dockerfile plus
environment/app/ (copied to /app), tests/test.sh plus tests/test_outputs.py
(the family's checks with this instance's expected values embedded) and
tests/run_tests.py (which runs them as pytest would, at a quarter of its CPU:
`tbexp/tasks/builtin/run_tests.py`), and
solution/solve.sh (the oracle, one complete command per line so each line
can be replayed as one agent turn). Files are written in a fixed order with
fixed modes, so the same instance always gives the same bytes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tbexp.tasks.builtin.family import EXPECTED_MARKER, Combo, Family

RUN_TESTS = (Path(__file__).parent / "run_tests.py").read_bytes()
DOCKERFILE = "FROM tbexp-base:bookworm\nWORKDIR /app\nCOPY app/ /app/\n"

TEST_SH = """#!/bin/bash
# Runs the task's tests; per-test results go to JUnit XML, the binary reward to reward.txt (Harbor's convention).
mkdir -p /logs/verifier
cd /app
python3 /tests/run_tests.py --junitxml=/logs/verifier/junit.xml /tests/test_outputs.py
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def write_task(task_dir: Path, family: Family, combo: Combo, split: str, seed: int) -> None:
    """Build the instance `combo` of `family` (data drawn from a seed-and-name rng) into `task_dir`."""
    spec = family.build(combo, random.Random(f"{seed}:{task_dir.name}"))
    _write(task_dir / "task.toml", _task_toml(task_dir.name, family, combo, split))
    _write(task_dir / "instruction.md", spec.instruction.strip() + "\n")
    _write(task_dir / "environment" / "Dockerfile", DOCKERFILE)
    for rel_path in sorted(spec.app_files):
        _write(task_dir / "environment" / "app" / rel_path, spec.app_files[rel_path])
    _write(task_dir / "tests" / "test.sh", TEST_SH, mode=0o755)
    _write(task_dir / "tests" / "test_outputs.py", _test_source(task_dir.name, family, spec.expected))
    _write(task_dir / "tests" / "run_tests.py", RUN_TESTS)
    _write(task_dir / "solution" / "solve.sh", "#!/bin/bash\n" + "\n".join(spec.solution) + "\n", mode=0o755)


def _task_toml(dir_name: str, family: Family, combo: Combo, split: str) -> str:
    keywords = [family.name, family.category] + (["discovery"] if family.discovery else [])
    return f"""schema_version = "1.0"

[task]
name = {_toml(f"tbexp/{dir_name}")}
description = {_toml(family.description)}
keywords = {_toml(keywords)}

[metadata]
family = {_toml(family.name)}
split = {_toml(split)}
difficulty = {_toml(family.difficulty)}
category = {_toml(family.category)}
discovery = {_toml(family.discovery)}
combo = {_toml(combo)}

[verifier]
timeout_sec = 60.0

[agent]
timeout_sec = 300.0

[environment]
workdir = "/app"
network_mode = "no-network"
cpus = 1
memory_mb = 512
storage_mb = 256
build_timeout_sec = 300.0
"""


def _toml(value) -> str:
    """A TOML literal for the few value types task.toml needs (JSON strings are valid TOML strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{key} = {_toml(v)}" for key, v in value.items()) + " }"
    raise TypeError(f"no TOML form for {value!r}")


def _test_source(dir_name: str, family: Family, expected: dict) -> str:
    header = f'"""Checks for tbexp/{dir_name}; expected values were fixed when the task was generated."""\n'
    return header + family.checks.lstrip("\n").replace(EXPECTED_MARKER, repr(expected))


def _write(path: Path, contents: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(contents.encode() if isinstance(contents, str) else contents)
    path.chmod(mode)
