"""Loaded tasks, cached on disk by the content of their directories, so a set is read through Harbor's model once.

Reading a task with Harbor's own `Task` walks its trees twice (the file filter and the symlink checks) and
validates its `task.toml`: ~70 ms a task on a loaded machine, seconds for a set, in every new process. What
`tbexp.tasks.harbor_task.load_task` makes of a directory depends only on the directory's contents, its path and
the versions of tbexp's loader and of Harbor, so the finished `Task` (Harbor's parsed `TaskConfig` inside it) is
pickled under `<cache>/task-models/<digest>.pkl` and a later process with the same directory unpickles it.

The digest covers the directory's path and every entry under it: relative path, kind and mode, a symlink's
target, and a file's contents (sha256) where it is at most `HASHED_BYTES`, else its size and modification time
(a task's large data files are read once per change, not once per load). A task that cannot be loaded is never
cached: its error is found afresh. Delete `<cache>/task-models/` to drop the cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tbexp.cache import cache_root

LOADER_VERSION = "2"  # bump when what load_task makes of a directory changes
HASHED_BYTES = 1 << 20


def cached_task(path: Path, load: Callable[[], Any]) -> Any:
    """The task loaded from `path`: unpickled where this content was loaded before, else `load()`, then stored."""
    entry = cache_root() / "task-models" / f"{directory_digest(path)}.pkl"
    try:
        return pickle.loads(entry.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        pass  # not there, or written by another version of a class: load it afresh
    task = load()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=entry.parent, prefix=".partial-", delete=False) as tmp:
            tmp.write(pickle.dumps(task))
        os.replace(tmp.name, entry)  # whole or not at all: processes loading at once never read half a file
    except OSError:
        pass  # a read-only cache only costs speed
    return task


def directory_digest(path: Path) -> str:
    """sha256 over the directory's path and entries (see the module docstring), with the loader's versions."""
    digest = hashlib.sha256(f"{LOADER_VERSION}\0{_harbor_version()}\0{Path(path).absolute()}\0".encode())
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, name)
            digest.update(f"{os.path.relpath(full, path)}\0{_entry(full)}\0".encode())
        for name in dirs:
            digest.update(f"{os.path.relpath(os.path.join(root, name), path)}/\0".encode())
    return digest.hexdigest()[:32]


@functools.cache
def _harbor_version() -> str:
    from importlib.metadata import version

    return version("harbor")


def _entry(full: str) -> str:
    info = os.lstat(full)
    if stat.S_ISLNK(info.st_mode):
        return f"link {os.readlink(full)}"
    if not stat.S_ISREG(info.st_mode):
        return f"special {info.st_mode:o}"
    if info.st_size > HASHED_BYTES:
        return f"file {info.st_mode:o} {info.st_size} {info.st_mtime_ns}"
    with open(full, "rb") as f:
        return f"file {info.st_mode:o} {hashlib.sha256(f.read()).hexdigest()}"
