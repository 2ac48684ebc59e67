"""Where tbexp's caches live: the job's `cache_dir` setting, which defaults to `$TBEXP_CACHE`, else ~/.cache/tbexp.

The environment builders, the verifier's provisioning and the Terminal-Bench 1 conversion run below any
config, so they ask `cache_root()`. The job (`tbexp.job.Job`, built once per process) makes its cache root
this process's with `use_root`; until one does (a script, a test that builds a sandbox directly), the root
is the setting's default, `$TBEXP_CACHE` else ~/.cache/tbexp.

Simplified: one root per process (the last job built sets it), as there is one job per process.
"""

from __future__ import annotations

import os
from pathlib import Path

_root: Path | None = None  # set by the job


def default_root() -> Path:
    return Path(os.environ.get("TBEXP_CACHE") or Path.home() / ".cache" / "tbexp")


def use_root(path: str | Path | None) -> None:
    """Make `path` the cache root of everything in this process that runs below the config (None: the default)."""
    global _root
    _root = None if path is None else Path(path)


def cache_root() -> Path:
    return _root if _root is not None else default_root()
