#!/usr/bin/env python
"""scripts/bench_verifier.py: what verification costs an episode, with verifier.isolation=shared and =fresh.

    .venv/bin/python scripts/bench_verifier.py                             # bwrap and docker, 10 episodes a mode
    .venv/bin/python scripts/bench_verifier.py --sandboxes bwrap --episodes 20
    PYTHONPATH=/path/to/other/checkout .venv/bin/python scripts/bench_verifier.py --modes shared   # other code

Runs oracle episodes of two conformance tasks one after the other (so episodes do not compete with each other),
each in a fresh sandbox, and prints per sandbox and mode the median and mean of the episode's verify time (tests
copied in, run, read back; with fresh: the hand-over and the second sandbox too) and of the whole episode. Code
whose run_episode takes no isolation (before #41) runs the shared mode only. The machine's load average is printed
beside the figures: other jobs on a shared machine slow every mode alike, so compare modes within one run.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TASKS = ("basic-pytest-junit", "basic-partial-credit")


def _episodes(sandbox: str, mode: str, n: int) -> list:
    sys.path.insert(0, str(REPO))
    from tbexp.agents.base import make_agent
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode
    from tbexp.tasks import load_task
    from tests.conftest import compose_config

    cfg = compose_config(f"sandbox={sandbox}", "sandbox.command_timeout_s=30")
    agent = make_agent(cfg.agent)
    tasks = [load_task(REPO / "tests" / "conformance" / name) for name in TASKS]
    takes_isolation = "isolation" in inspect.signature(run_episode).parameters
    if mode != "shared" and not takes_isolation:
        raise SystemExit("this code's run_episode has no isolation: run --modes shared")
    extra = (mode,) if takes_isolation else ()
    run_episode(tasks[0], 0, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 8, *extra)  # warm caches
    done = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        clock = time.perf_counter()
        episode = run_episode(task, i, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, 8, *extra)
        if episode.invalid or not episode.report.strict:
            raise SystemExit(f"{task.name} ({sandbox}, {mode}): not solved: {episode.invalid or episode.report}")
        done.append((episode.time_s.get("verify", 0.0), time.perf_counter() - clock))
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", default="bwrap,docker")
    parser.add_argument("--modes", default="shared,fresh")
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    print(
        f"{'sandbox':8} {'mode':7} {'episodes':>8} {'verify median':>14} {'verify mean':>12} {'episode median':>15}  load"
    )
    for sandbox in args.sandboxes.split(","):
        for mode in args.modes.split(","):
            done = _episodes(sandbox, mode, args.episodes)
            verify, whole = [d[0] for d in done], [d[1] for d in done]
            load = os.getloadavg()[0]
            print(
                f"{sandbox:8} {mode:7} {len(done):8d} {statistics.median(verify):13.3f}s {statistics.fmean(verify):11.3f}s "
                f"{statistics.median(whole):14.3f}s  {load:.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
