"""Where tbexp's caches live when no config says: `$TBEXP_CACHE`, else ~/.cache/tbexp.

The config's `cache_dir` defaults to the same place (tbexp/config.py); the environment builders, the verifier's
provisioning and the Terminal-Bench 1 conversion read it from here, since they run below any config.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("TBEXP_CACHE") or Path.home() / ".cache" / "tbexp")
