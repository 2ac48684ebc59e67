"""What a built-in task family is: name pools, a builder, and the tests' source.

A family describes a kind of chore once. Every variable part of an instance
(file, directory, field and service names, words, thresholds) is one entry of
a small fixed pool, so an instance is a *combination* of pool entries plus
random data. `build(combo, rng)` turns one combination into a `TaskSpec`:
the instruction, the files that start under /app, the oracle's commands, and
the expected values that get embedded into the instance's pytest file.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Combo = dict[str, str | int]  # pool dimension -> the entry chosen for it

EXPECTED_MARKER = "__EXPECTED__"  # replaced, in `checks`, by the instance's expected values


@dataclass(frozen=True)
class TaskSpec:
    instruction: str  # one to three sentences; every pool entry appears verbatim
    app_files: dict[str, str | bytes]  # path relative to /app -> contents
    solution: list[str]  # the oracle: one complete shell command per entry, run from /app
    expected: dict  # embedded into tests/test_outputs.py as EXPECTED


@dataclass(frozen=True)
class Family:
    name: str  # also the task-directory prefix, e.g. "log-errors" -> log-errors-0003
    description: str  # one line for task.toml
    category: str
    difficulty: str  # "easy" | "medium"
    discovery: bool  # the oracle must look around before it can act
    pools: dict[str, tuple]  # dimension -> its entries; an instance picks one entry per dimension
    build: Callable[[Combo, random.Random], TaskSpec]
    checks: str  # pytest source with EXPECTED_MARKER where the expected values go
    heldout_only: bool = False  # never in the train split: a family the model has not seen
    allows: Callable[[Combo], bool] = field(default=lambda combo: True)  # rules out combos that make no sense


# The checks of every family whose answer is one integer in one file (EXPECTED: out, total).
SINGLE_INTEGER_CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_output_is_a_single_integer():
    text = OUT.read_text().strip()
    assert text.lstrip("-").isdigit(), f"{OUT} should hold one integer, got {text!r}"


def test_total_is_correct():
    assert int(OUT.read_text().strip()) == EXPECTED["total"]
"""


# The checks of every family whose answer is one non-negative count in one file (EXPECTED: out, count).
COUNT_CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_output_is_a_single_number():
    assert OUT.read_text().strip().isdigit(), f"{OUT} should hold one number, got {OUT.read_text()!r}"


def test_count_is_correct():
    assert int(OUT.read_text().strip()) == EXPECTED["count"]
"""
