#!/usr/bin/env python
"""scripts/attack_table.py: the attack suite (tests/attacks) through the eval stage, as a table of rewards.

    .venv/bin/python scripts/attack_table.py --out /tmp/attacks-after                    # bwrap, docker x native, harbor
    .venv/bin/python scripts/attack_table.py --out /tmp/attacks-before --tbexp /tmp/base  # another checkout of tbexp
    .venv/bin/python scripts/attack_table.py --show /tmp/attacks-after --before /tmp/attacks-before

Each runner is one `python -m tbexp stage=eval tasks=dir tasks.path=tests/attacks policy=oracle eval.n_runs=1
sandbox=S eval.harness=H` (the oracle plays each task's solve.sh, which is the attack), with `--tbexp`'s package
first on PYTHONPATH, so the same suite can be run on the code before a change. The table has a row per task and a
column per runner: the per-test reward as the verifier found it (`eval.tamper=keep`, where the code has it, so a
tamper finding's default 0 does not stand in for the defence) and, where the code records it, the number of tamper
findings; with `--before`, `before -> after`. A reward of `invalid` is an episode the eval dropped.
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
# harness-sandbox[-agent]: tbexp's own loop with raw_command (each command's processes end with it) and with
# terminus_2 (a tmux session keeps them, as the published recipe's agent does), and Harbor's trials
RUNNERS = [
    "native-bwrap",
    "native-docker",
    "native-bwrap-terminus_2",
    "native-docker-terminus_2",
    "harbor-bwrap",
    "harbor-docker",
]


def run(out: Path, tbexp: Path, runners: list[str]) -> None:
    # the verifier's own reward, not the tamper policy's 0, where the code has the policy
    keep = ["eval.tamper=keep"] if "tamper: TamperPolicy" in (tbexp / "tbexp" / "config.py").read_text() else []
    for runner in runners:
        harness, sandbox, *agent = runner.split("-")
        argv = [sys.executable, "-m", "tbexp", "stage=eval", "tasks=dir", f"tasks.path={SUITE}", "policy=oracle"]
        argv += ["eval.n_runs=1", "eval.concurrency=2", f"sandbox={sandbox}", f"eval.harness={harness}", *keep]
        argv += [f"agent={a}" for a in agent] + [f"hydra.run.dir={out / runner}"]
        env = {**os.environ, "PYTHONPATH": str(tbexp)}
        with (out / f"{runner}.log").open("w") as log:
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
    names = [n for n in RUNNERS if (after / n).is_dir()]
    got = {n: cells(after / n) for n in names}
    was = {n: cells(before / n) for n in names} if before else {}
    head = "| attack | " + " | ".join(_title(n) for n in names)
    lines = [head + " |", "|---" * (len(names) + 1) + "|"]
    for task in sorted({t for column in got.values() for t in column}):
        row = [
            f"{was[n].get(task, '-')} -> {got[n].get(task, '-')}" if before else got[n].get(task, "-") for n in names
        ]
        lines.append(f"| {task} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _title(runner: str) -> str:
    harness, sandbox, *agent = runner.split("-")
    return (
        f"{sandbox} ({'tbexp, ' + (agent[0] if agent else 'raw_command') if harness == 'native' else 'Harbor trials'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="run the suite, writing each runner's eval folder here")
    parser.add_argument("--tbexp", type=Path, default=REPO, help="the checkout whose tbexp runs (default: this one)")
    parser.add_argument("--runners", default=",".join(RUNNERS), help="harness-sandbox[-agent],...")
    parser.add_argument("--show", type=Path, help="print the table of a folder --out wrote")
    parser.add_argument("--before", type=Path, help="with --show: a folder of the same runs on other code")
    args = parser.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, args.tbexp, args.runners.split(","))
    if args.out or args.show:
        print(table(args.show or args.out, args.before))
        return 0
    parser.error("give --out (run) or --show (a table)")
    return 2


if __name__ == "__main__":
    sys.exit(main())
