"""Train GRPO once per RL loss from one SFT checkpoint on one RL task set, and print the held-out table that
docs/losses.md holds, each loss paired with the first one on the same held-out tasks and draws.

    python scripts/compare_losses.py --start CHECKPOINT --tasks KEPT_TASKS_JSON [--seeds 0] [--steps 2]
        [--losses ppo dppo ...] [-- extra overrides]

`CHECKPOINT` and `KEPT_TASKS_JSON` come from a default job (`python -m tbexp`): its `pipeline_state.json` names
`sft/checkpoint` and `filter/kept_tasks`. Each run is `python -m tbexp stage=grpo load_checkpoint=CHECKPOINT
grpo.tasks_file=KEPT_TASKS_JSON grpo.loss_fn=L grpo.steps=N seed=S grpo.eval_at_start=false` in
`outputs/losses/L-sS` (re-running resumes). Every loss starts from the same weights with the same sampling
seeds, so their first step's rollouts are the same episodes and every difference is the loss's; the held-out
eval after the last step uses the same draws for every loss (tbexp.seeds.stream(seed, "eval")), so the differences to the
first loss are paired by (task, run) with a task-clustered standard error (tbexp.episodes.promotion).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tbexp.episodes.promotion import paired_difference, read_records

LOSSES = ("ppo", "dppo", "cispo", "gspo", "importance_sampling")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", required=True, help="the SFT checkpoint GRPO starts from")
    parser.add_argument("--tasks", required=True, help="the filter's kept_tasks.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--losses", nargs="+", default=list(LOSSES))
    parser.add_argument("--out", type=Path, default=Path("outputs/losses"))
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    fixed = [f"load_checkpoint={args.start}", f"grpo.tasks_file={args.tasks}", f"grpo.steps={args.steps}"]
    fixed += ["grpo.eval_at_start=false", *args.overrides]
    lines = ["| loss | seed | held-out strict | held-out reward | vs first: strict ± s.e. | reward ± s.e. | wall s |"]
    lines.append("|---" * 7 + "|")
    for seed in args.seeds:
        first = None
        for loss in args.losses:
            run_dir = args.out / f"{loss}-s{seed}"
            wall_s = _run(run_dir, [f"seed={seed}", f"grpo.loss_fn={loss}", *fixed])
            row, records = _last_eval(run_dir)
            first = first or records
            paired = [paired_difference(records, first, m) for m in ("eval/strict_success", "eval/reward")]
            cells = [f"{row['eval/strict_success']:.3f}", f"{row['eval/reward']:.3f}"]
            cells += [f"{p['difference']:+.3f} ± {p['stderr']:.3f}" for p in paired] + [f"{wall_s:.0f}"]
            lines.append(f"| {loss} | {seed} | " + " | ".join(cells) + " |")
            print("\n".join(lines), flush=True)


def _run(run_dir: Path, overrides: list[str]) -> float:
    if (run_dir / "summary.json").exists():
        return float("nan")  # finished before: its time is not this call's
    command = [sys.executable, "-m", "tbexp", "stage=grpo", f"hydra.run.dir={run_dir}", *overrides]
    print("+", " ".join(command), flush=True)
    clock = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - clock


def _last_eval(run_dir: Path) -> tuple[dict[str, float], list[dict]]:
    """The held-out eval after the last step: its metrics and per-episode records."""
    state = json.loads((run_dir / "grpo_state.json").read_text())
    last = state["evals"][-1]
    records = read_records(run_dir / "evals" / f"step-{last['step']:05d}")
    if records is None:
        raise SystemExit(f"{run_dir}: the last eval wrote no episodes.jsonl")
    return last, records


if __name__ == "__main__":
    main()
