"""Where metrics go: `metrics.jsonl` in the run directory always, plus the chosen logger.

`logger=none` adds nothing, so stages call `tracker.log(...)` unconditionally
instead of asking which tracker is on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Tracker:
    def __init__(self, run_dir: Path, settings: Any):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if settings.name != "none":
            raise ValueError(f"logger={settings.name!r}: this version ships logger=none (metrics.jsonl only)")

    def log(self, metrics: dict[str, float], step: int = 0) -> None:
        row = {"step": step, "time": time.time(), **metrics}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def finish(self) -> None:
        pass


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # a reader never sees half a summary
    return path


def run_dir() -> Path:
    """The job's output directory: Hydra's when running under Hydra, else the working directory."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path.cwd()
