"""Two small SFT jobs at once against one alone: the seconds an SFT step takes, and their ratio.

    python scripts/bench_shared_machine.py [--steps 20] [--out outputs/bench_shared]

Runs `python -m tbexp stage=sft` (the default config's SFT, `--steps` steps, no held-out NLL in between) once
alone, then two at once (seeds 1 and 2) with `backend.share_cores=true` (each job takes its share of the cores:
tbexp/jobs/cpu_share.py), then two at once with `backend.share_cores=false` (each takes `backend.train_threads`
as given, as before). A step's time is the median gap between consecutive rows of the job's metrics.jsonl, the
first two steps left out (warm-up). Two jobs on the cores of one cannot beat 2x one job's step; the target is
to come near it instead of thrashing past it. The machine's other load shows in every figure: run it idle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_shared"))
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every job")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    alone = _jobs(args, "alone", [0], share=True)
    shared = _jobs(args, "two-shared", [1, 2], share=True)
    unshared = _jobs(args, "two-unshared", [1, 2], share=False)
    print(f"one job alone:                       {alone[0]:.2f} s/step")
    for name, times in (("two at once, share_cores=true ", shared), ("two at once, share_cores=false", unshared)):
        ratio = max(times) / alone[0]
        print(f"{name}:      {' and '.join(f'{t:.2f}' for t in times)} s/step, {ratio:.2f}x one alone")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


def _jobs(args: argparse.Namespace, name: str, seeds: list[int], share: bool) -> list[float]:
    """Start one job per seed at once, wait for all, and return each one's seconds per step."""
    procs, dirs = [], []
    for seed in seeds:
        run_dir = args.out / f"{name}-s{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a run directory resumes: start each measurement afresh
        command = [sys.executable, "-m", "tbexp", "stage=sft", f"seed={seed}", f"sft.steps={args.steps}"]
        command += [f"sft.eval_every={args.steps}", f"backend.share_cores={str(share).lower()}"]
        command += [f"hydra.run.dir={run_dir}", *args.overrides]
        procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        dirs.append(run_dir)
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{name}: a job failed:\n{err[-3000:]}")
    return [_seconds_per_step(d / "metrics.jsonl") for d in dirs]


def _seconds_per_step(metrics: Path) -> float:
    times = [r["time"] for r in map(json.loads, metrics.read_text().splitlines()) if "train/nll" in r]
    gaps = [b - a for a, b in zip(times, times[1:])][2:]
    return statistics.median(gaps)


if __name__ == "__main__":
    main()
