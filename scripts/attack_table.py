#!/usr/bin/env python
"""scripts/attack_table.py: the attack suite (tests/attacks) through the eval stage, as a table of rewards.

    .venv/bin/python scripts/attack_table.py --out /tmp/attacks-after                    # bwrap, docker x native, harbor
    .venv/bin/python scripts/attack_table.py --out /tmp/attacks-before --tbexp /tmp/base  # another checkout of tbexp
    .venv/bin/python scripts/attack_table.py --show /tmp/attacks-after --before /tmp/attacks-before

Each runner is one `python -m tbexp stage=eval tasks=dir tasks.path=tests/attacks policy=oracle eval.n_runs=1
sandbox=S eval.harness=H` (the oracle plays each task's solve.sh, which is the attack), with `--tbexp`'s package
first on PYTHONPATH, so the same suite can be run on the code before a change. The table has a row per task and a
column per runner: the per-test reward and, where the code records it, the number of tamper findings; with
`--before`, `before -> after`. A reward of `invalid` is an episode the eval dropped.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "tests" / "attacks"
RUNNERS = [("native", "bwrap"), ("native", "docker"), ("harbor", "bwrap"), ("harbor", "docker")]


def run(out: Path, tbexp: Path, runners: list[tuple[str, str]]) -> None:
    for harness, sandbox in runners:
        folder = out / f"{harness}-{sandbox}"
        argv = [sys.executable, "-m", "tbexp", "stage=eval", "tasks=dir", f"tasks.path={SUITE}", "policy=oracle"]
        argv += ["eval.n_runs=1", "eval.concurrency=2", f"sandbox={sandbox}", f"eval.harness={harness}"]
        argv += [f"hydra.run.dir={folder}"]
        env = {**os.environ, "PYTHONPATH": str(tbexp)}
        with (out / f"{harness}-{sandbox}.log").open("w") as log:
            subprocess.run(argv, cwd=tbexp, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)


def cells(folder: Path) -> dict[str, str]:
    """task directory name -> 'reward (tamper n)' of one runner's eval folder."""
    if not (folder / "tasks.csv").is_file():
        return {}
    tamper = {}
    for path in (folder / "episodes").glob("*.json"):
        record = json.loads(path.read_text())
        if "tamper" in record:
            tamper[record["task"]] = len(record["tamper"])
    found = {}
    with (folder / "tasks.csv").open() as f:
        for row in csv.DictReader(f):
            reward = "invalid" if int(row["invalid"]) else f"{float(row['reward']):.2f}"
            counted = f" ({tamper[row['task']]} tamper)" if row["task"] in tamper else ""
            found[row["task"].split("/")[-1]] = reward + counted
    return found


def table(after: Path, before: Path | None) -> str:
    names = [f"{h}-{s}" for h, s in RUNNERS]
    got = {n: cells(after / n) for n in names}
    was = {n: cells(before / n) for n in names} if before else {}
    head = "| attack | " + " | ".join(f"{s} ({'tbexp' if h == 'native' else 'Harbor trials'})" for h, s in RUNNERS)
    lines = [head + " |", "|---" * (len(names) + 1) + "|"]
    for task in sorted({t for column in got.values() for t in column}):
        row = [
            f"{was[n].get(task, '-')} -> {got[n].get(task, '-')}" if before else got[n].get(task, "-") for n in names
        ]
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="run the suite, writing each runner's eval folder here")
    parser.add_argument("--tbexp", type=Path, default=REPO, help="the checkout whose tbexp runs (default: this one)")
    parser.add_argument("--runners", default=",".join(f"{h}-{s}" for h, s in RUNNERS), help="harness-sandbox,...")
    parser.add_argument("--show", type=Path, help="print the table of a folder --out wrote")
    parser.add_argument("--before", type=Path, help="with --show: a folder of the same runs on other code")
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, args.tbexp, [tuple(r.split("-", 1)) for r in args.runners.split(",")])
    if args.out or args.show:
        print(table(args.show or args.out, args.before))
        return 0
    parser.error("give --out (run) or --show (a table)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
