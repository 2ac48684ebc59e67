"""The built-in suite: Terminal-Bench-style task families written out as Harbor task directories.

`write_suite(out_dir, seed, train_per_family, heldout_per_family)` writes
`out_dir/train/<family>-NNNN/` and `out_dir/heldout/<family>-NNNN/`. Each
family draws every name from small fixed pools; held-out instances of a
train family are pool combinations never used in train (but made only of
entries seen in train), and the `HELDOUT_FAMILIES` appear in held-out only
(see split.py and docs/builtin_tasks.md). Held-out numbering continues after
train, so every directory name is unique across both splits.

The suite is written into a temporary sibling directory and renamed into
place, with `.complete` (the arguments plus a hash of this package's source)
written last: a killed run leaves no half suite, and a second call with the
same arguments and the same generator code returns at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from tbexp.tasks.builtin import (
    archive_lines,
    buried_json,
    calendar_slot,
    csv_groupby,
    file_move,
    git_commit,
    json_sum,
    log_errors,
    needle_file,
    reverse_complement,
    sqlite_query,
    unknown_delimiter,
)
from tbexp.tasks.builtin.family import Family
from tbexp.tasks.builtin.split import split_combos
from tbexp.tasks.builtin.writer import write_task

_FAMILIES: tuple[Family, ...] = tuple(
    module.FAMILY
    for module in (
        log_errors,
        json_sum,
        csv_groupby,
        reverse_complement,
        file_move,
        git_commit,
        sqlite_query,
        buried_json,
        unknown_delimiter,
        needle_file,
        calendar_slot,
        archive_lines,
    )
)
FAMILIES: list[str] = [family.name for family in _FAMILIES]
HELDOUT_FAMILIES: list[str] = [family.name for family in _FAMILIES if family.heldout_only]
COMPLETE_MARKER = ".complete"


def family(name: str) -> Family:
    """The family called `name` (pools, builder, checks)."""
    for candidate in _FAMILIES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no built-in family {name!r}; known: {', '.join(FAMILIES)}")


def write_suite(out_dir: Path, seed: int = 0, train_per_family: int = 40, heldout_per_family: int = 4) -> Path:
    """Write the suite to `out_dir` (or find it already there) and return `out_dir`."""
    out_dir = Path(out_dir)
    record = _record(seed, train_per_family, heldout_per_family)
    if _recorded(out_dir) == record:
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and _recorded(out_dir) is None:
        raise FileExistsError(f"{out_dir}: not empty and not a built-in suite; refusing to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    for fam in _FAMILIES:
        train, heldout = split_combos(fam, seed, train_per_family, heldout_per_family)
        for index, combo in enumerate(train):
            write_task(staging / "train" / f"{fam.name}-{index:04d}", fam, combo, "train", seed)
        for index, combo in enumerate(heldout, start=len(train)):
            write_task(staging / "heldout" / f"{fam.name}-{index:04d}", fam, combo, "heldout", seed)
    (staging / COMPLETE_MARKER).write_text(record)
    _move_into_place(staging, out_dir, record)
    return out_dir


def _record(seed: int, train_per_family: int, heldout_per_family: int) -> str:
    # The source hash makes a changed generator rewrite old suites instead of reusing them.
    source = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        source.update(path.name.encode() + b"\0" + path.read_bytes())
    arguments = {"seed": seed, "train_per_family": train_per_family, "heldout_per_family": heldout_per_family}
    return json.dumps({**arguments, "generator_sha256": source.hexdigest()}, sort_keys=True) + "\n"


def _recorded(out_dir: Path) -> str | None:
    marker = out_dir / COMPLETE_MARKER
    return marker.read_text() if marker.is_file() else None


def _move_into_place(staging: Path, out_dir: Path, record: str) -> None:
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        out_dir.rename(old)  # an empty directory or a suite written with other arguments
    try:
        staging.rename(out_dir)
    except OSError:
        # Another process finished the same suite first; keep its copy if it is the one asked for.
        shutil.rmtree(staging, ignore_errors=True)
        if _recorded(out_dir) != record:
            raise
    shutil.rmtree(old, ignore_errors=True)
