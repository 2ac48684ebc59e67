"""One content key for every result cache (trajectories, SFT, evals, filter): a hash of what decides the result.

`content_key(settings, contents)` hashes three things:
* `settings`: the config parts that decide the result (resolved config nodes, the seed, a checkpoint's name), as
  canonical JSON;
* `contents`: bytes the result is computed from (a data file, a checkpoint's files, task directories);
* `code_fingerprint()`: a hash of the source of the code that computes results, so a cache filled by older
  code does not answer for newer code.

Granularity of the code fingerprint: every file of the `tbexp` package, less the modules that only report,
track or launch (RESULT_FREE below), whose edits cannot change a number. Finer grains were weighed: per
stage, following imports, misses the many imports made inside functions (the stages import the backends
lazily), and a missed dependency is a stale result; a coarse grain only costs a recomputation after an
edit. `conf/` is not part of it: config values enter through `settings`.

Simplified: the key is what the caller passes. What each cached result passes, and the one table of the
settings that decide none, are in `tbexp.caches`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent
# Paths under the package (folders end in /) that decide no cached result: reports, dashboards, trackers,
# plots, launchers, the preemption handler and the entry point.
RESULT_FREE = (
    "study/",
    "report.py",
    "dashboard.py",
    "__main__.py",
    "jobs/tracking.py",
    "jobs/plots.py",
    "jobs/launchers.py",
    "jobs/preemption.py",
)


def content_key(settings: Mapping[str, Any], contents: Iterable[bytes] = (), length: int = 20) -> str:
    """`length` hex digits naming a result by everything that decides it, the code included.

    >>> content_key({"k": 1}) == content_key({"k": 1}) != content_key({"k": 2})
    True
    """
    h = hashlib.sha256()
    h.update(json.dumps({"code": code_fingerprint(), "settings": settings}, sort_keys=True).encode())
    for part in contents:
        h.update(len(part).to_bytes(8, "big"))  # a length prefix: ("ab", "c") and ("a", "bc") differ
        h.update(part)
    return h.hexdigest()[:length]


@functools.cache
def code_fingerprint(root: Path = PACKAGE) -> str:
    """sha256 over the relative path and bytes of every result-deciding file under `root` (once per process)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if not path.is_file() or "__pycache__" in path.parts or relative.endswith(".pyc"):
            continue
        if any(relative == skip or (skip.endswith("/") and relative.startswith(skip)) for skip in RESULT_FREE):
            continue
        h.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def resolved(node: Any) -> Any:
    """A config node as plain data, interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def task_contents(tasks: list) -> list[bytes]:
    """Each task's name and directory hash (paths, modes, bytes), for keys of results computed on `tasks`."""
    from tbexp.sandboxes.dockerfile import context_hash

    return [f"{task.name}\0{context_hash(task.path)}".encode() for task in tasks]
