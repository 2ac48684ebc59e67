"""Terminal-Bench 1 task directories, converted by Harbor's own mapper (the code behind `harbor tasks migrate`).

A TB1 directory (`task.yaml`, `run-tests.sh`, `solution.sh`, `docker-compose.yaml`, `tests/`) is never
edited: `TerminalBenchMapper._map_task` (the call `harbor tasks migrate -i TASK` makes) writes a Harbor task
into `<migrated_dir>/<content hash>/<dir name>`, and loading the same content again reuses it. The hash
covers every file's path, mode and bytes, so an edited task is converted afresh; the mapper's own version
is in the hash too, so a new Harbor converts again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tempfile
from importlib.metadata import version
from pathlib import Path

from tbexp.cache import cache_root
from tbexp.errors import TbexpError

log = logging.getLogger(__name__)


class MigrationError(TbexpError, ValueError):
    """Harbor's mapper refused a Terminal-Bench 1 directory; the message names its task.yaml. `load_task` raises it
    as the `TaskError` every loader catches (this module sits below harbor_task.py and does not import it)."""


def default_migrated_dir() -> Path:
    """`<cache>/migrated` (`tbexp.cache.cache_root()`: the job's cache_dir), beside the built-in suite's `tasks/`."""
    return cache_root() / "migrated"


def migrate_tb1(source: Path, migrated_dir: Path | None = None) -> Path:
    """The Harbor task directory converted from the TB1 directory `source` (converted now if not yet)."""
    target = (migrated_dir or default_migrated_dir()) / content_hash(source) / source.name
    if (target / "task.toml").is_file():
        return target
    from harbor.mappers.terminal_bench import TerminalBenchMapper

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".converting-", dir=target.parent) as tmp:
        staged = Path(tmp) / source.name
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):  # the mapper prints what it moved; keep it for the log
                TerminalBenchMapper()._map_task(source, staged)
        except Exception as err:  # the mapper raises whatever pydantic, yaml or the file system raise
            raise MigrationError(
                f"{source / 'task.yaml'}: Harbor's Terminal-Bench mapper refused it: {type(err).__name__}: {err}"
            ) from err
        for line in printed.getvalue().splitlines():
            log.debug("%s: %s", source, line)
        try:
            staged.rename(target)  # atomic: a loader running at the same time sees all of it or nothing
        except OSError:
            if not (target / "task.toml").is_file():  # another loader won the race only if its copy is whole
                raise
    log.info("converted Terminal-Bench 1 task %s into %s", source, target)
    return target


def content_hash(directory: Path) -> str:
    """16 hex digits of a sha256 over every file's relative path, mode and bytes (symlinks by target)."""
    digest = hashlib.sha256(f"harbor {version('harbor')}\n".encode())
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            digest.update(f"L {rel} {os.readlink(path)}\n".encode())
        elif path.is_file():
            digest.update(f"F {rel} {path.stat().st_mode & 0o777:o} {path.stat().st_size}\n".encode())
            with path.open("rb") as f:  # file_digest reads in chunks: a large data file is never read whole
                digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]
