#!/usr/bin/env python
"""scripts/bench_terminus2.py: what terminus-2's tmux protocol costs per episode, against raw_command.

    .venv/bin/python scripts/bench_terminus2.py                          # bwrap, one held-out task per family
    .venv/bin/python scripts/bench_terminus2.py --sandbox docker --tasks 3 --repeats 2
    .venv/bin/python scripts/bench_terminus2.py --agents raw_command,terminus_2

Runs the oracle on the same built-in held-out tasks once per agent, one episode at a time (so the numbers are
per episode, not throughput), after one warm-up episode per agent that is not counted. Prints one JSON line
per agent: seconds per episode (the whole episode, and its agent phase: the turns), seconds per turn of the
agent phase, turns per episode, and strict success (the oracle should solve every task with every agent).
terminus_2's oracle waits for its marker after the solution (policies.py), so its turns are the solution's
lines plus the marker turn, any waiting turns and the two `task_complete` replies.

Not a test: nothing fails on a number; the numbers are the output (docs/terminus-2.md holds a run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from tbexp.agents.base import make_agent
from tbexp.config import register
from tbexp.episodes.policies import make_policy
from tbexp.episodes.rollout import run_episode
from tbexp.sandboxes.environments import prepare_environments
from tbexp.tasks import load_task
from tbexp.tasks.builtin import write_suite

CONF = Path(__file__).resolve().parent.parent / "conf"


def _config(agent: str, sandbox: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=[f"agent={agent}", f"sandbox={sandbox}"])


def _tasks(n_tasks: int) -> list:
    root = write_suite(
        Path(tempfile.mkdtemp(prefix="bench-terminus2-")) / "suite", train_per_family=4, heldout_per_family=1
    )
    return [load_task(path) for path in sorted((root / "heldout").iterdir())[:n_tasks]]


def bench(agent_name: str, sandbox: str, tasks: list, repeats: int) -> dict:
    cfg = _config(agent_name, sandbox)
    agent = make_agent(cfg.agent)
    unrunnable = prepare_environments(tasks, cfg.sandbox)
    tasks = [t for t in tasks if t.name not in unrunnable]

    def one(task):
        return run_episode(task, 0, agent, lambda t, a: make_policy("oracle", t, a), cfg.sandbox, cfg.agent.max_turns)

    one(tasks[0])  # warm-up: imports, first sandbox
    episodes, wall_s = [], []
    for _ in range(repeats):
        for task in tasks:
            start = time.perf_counter()
            episodes.append(one(task))
            wall_s.append(time.perf_counter() - start)
    agent_s = [e.time_s.get("agent", 0.0) for e in episodes]
    turns = [len(e.turns) for e in episodes]
    solved = [
        bool(e.report and not e.invalid and all(s == "passed" for s in e.report.tests.values())) for e in episodes
    ]
    return {
        "agent": agent_name,
        "sandbox": sandbox,
        "episodes": len(episodes),
        "s_per_episode": round(statistics.mean(wall_s), 3),
        "agent_s_per_episode": round(statistics.mean(agent_s), 3),
        "s_per_turn": round(sum(agent_s) / max(sum(turns), 1), 3),
        "turns_per_episode": round(statistics.mean(turns), 2),
        "strict_success": round(sum(solved) / len(solved), 3),
        "invalid": sum(1 for e in episodes if e.invalid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", default="raw_command,terminus_shell,terminus_2")
    parser.add_argument("--sandbox", default="bwrap", choices=["bwrap", "docker"])
    parser.add_argument("--tasks", type=int, default=6, help="held-out tasks, one per family")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    register()
    tasks = _tasks(args.tasks)
    for name in args.agents.split(","):
        print(json.dumps(bench(name, args.sandbox, tasks, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
