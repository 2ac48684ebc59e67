"""How long a new process takes to load a task set through Harbor's task model, with the task cache cold and warm.

    .venv/bin/python scripts/bench_task_loading.py                          # the built-in suite (default config)
    .venv/bin/python scripts/bench_task_loading.py --tasks tests/conformance --repeats 3

Each measurement is a fresh Python process (so Harbor's imports and the in-process memo count, as they do for a
stage) that loads the set with `tbexp.tasks.load_task_set` and prints its own wall time. "cold" empties the
task-model cache (`<cache>/task-models/`, tbexp/tasks/model_cache.py) first, so every task is read by Harbor's
`Task`; "warm" finds each task there by content. The built-in suite is written once before timing (that is
generation, not loading). The median of `--repeats` runs is printed, with the machine's load average, since on a
shared machine the figures move with it. The cache used is a temporary one, so the user's is left alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = r"""
import json, sys, time
start = time.perf_counter()
from hydra import compose, initialize_config_dir
from tbexp.config import register
register()
with initialize_config_dir(config_dir=sys.argv[1], version_base=None):
    cfg = compose("config", overrides=sys.argv[2:])
from tbexp.tasks import load_task_set
configured = time.perf_counter()
tasks = load_task_set(cfg.tasks)
print(json.dumps({"tasks": len(tasks), "load_s": time.perf_counter() - configured}))
"""


def _run(cache: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "TBEXP_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(REPO / "conf"), *overrides], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        sys.exit(f"loading failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=Path, help="a directory of tasks (default: the built-in suite)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    overrides = ["tasks=dir", f"tasks.path={args.tasks.resolve()}"] if args.tasks else []
    with tempfile.TemporaryDirectory(prefix="tbexp-bench-load-") as tmp:
        cache = Path(tmp)
        _run(cache, overrides)  # writes the built-in suite (generation, not loading) and fills the cache once
        figures: dict[str, list[float]] = {"cold": [], "warm": []}
        n_tasks = 0
        for _ in range(args.repeats):
            shutil.rmtree(cache / "task-models", ignore_errors=True)
            cold = _run(cache, overrides)
            warm = _run(cache, overrides)
            figures["cold"].append(cold["load_s"])
            figures["warm"].append(warm["load_s"])
            n_tasks = cold["tasks"]
    what = str(args.tasks) if args.tasks else "the built-in suite"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{what}: {n_tasks} tasks, a new process each, median of {args.repeats} (load average {load})")
    for name, values in figures.items():
        per_task_ms = 1000 * statistics.median(values) / max(n_tasks, 1)
        print(f"  {name:5} cache: {statistics.median(values):6.2f} s  ({per_task_ms:.1f} ms a task)")


if __name__ == "__main__":
    main()
