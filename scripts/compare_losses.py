"""Train GRPO once per RL loss from one SFT checkpoint on one RL task set, and print the held-out table that
docs/losses.md holds, each loss paired with the first one on the same held-out tasks and draws.

    python scripts/compare_losses.py --start CHECKPOINT --tasks KEPT_TASKS_JSON [--seeds 0] [--steps 2]
        [--losses ppo dppo ...] [--with-start] [-- extra overrides]

`CHECKPOINT` and `KEPT_TASKS_JSON` come from a default job (`python -m tbexp`): its `pipeline_state.json` names
`sft/checkpoint` and `filter/kept_tasks`. Each run is `python -m tbexp stage=grpo load_checkpoint=CHECKPOINT
grpo.tasks_file=KEPT_TASKS_JSON grpo.loss_fn=L grpo.steps=N seed=S grpo.eval_at_start=false` in
`outputs/losses/L-sS` (re-running resumes). Every loss starts from the same weights with the same sampling
seeds, so their first step's rollouts are the same episodes and every difference is the loss's; the held-out
eval after the last step uses the same draws for every loss (tbexp.seeds.stream(seed, "grpo_eval")), so the differences
to the first loss are paired by (task, run) with a task-clustered standard error (tbexp.episodes.promotion).
With `--with-start` the first row is the start itself on those draws (`outputs/losses/start-sS`, a one-step
run whose step-0 eval is read), so every difference is that loss's RL gain.
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
    parser.add_argument(
        "--with-start",
        action="store_true",
        help="first score the start itself on the same draws (one step's run that evaluates its step 0), "
        "and pair every loss with it",
    )
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    fixed = [f"load_checkpoint={args.start}", f"grpo.tasks_file={args.tasks}", f"grpo.steps={args.steps}"]
    fixed += ["grpo.eval_at_start=false", *args.overrides]
    lines = ["| loss | seed | held-out strict | held-out reward | vs first: strict ± s.e. | reward ± s.e. | wall s |"]
    lines.append("|---" * 7 + "|")
    for seed in args.seeds:
        first = None
        runs = [(loss, f"{loss}-s{seed}", [loss]) for loss in args.losses]
        if args.with_start:
            runs.insert(0, ("start", f"start-s{seed}", [args.losses[0], "grpo.steps=1", "grpo.eval_at_start=true"]))
        for name, folder, (loss, *more) in runs:
            run_dir = args.out / folder
            wall_s = _run(run_dir, [f"seed={seed}", f"grpo.loss_fn={loss}", *fixed, *more])
            row, records = _eval(run_dir, 0 if name == "start" else -1)
            first = first or records
            paired = [paired_difference(records, first, m) for m in ("eval/strict_success", "eval/reward")]
            cells = [f"{row['eval/strict_success']:.3f}", f"{row['eval/reward']:.3f}"]
            cells += [f"{p['difference']:+.3f} ± {p['stderr']:.3f}" for p in paired] + [f"{wall_s:.0f}"]
            lines.append(f"| {name} | {seed} | " + " | ".join(cells) + " |")
            print("\n".join(lines), flush=True)


def _run(run_dir: Path, overrides: list[str]) -> float:
    if (run_dir / "summary.json").exists():
        return float("nan")  # finished before: its time is not this call's
    command = [sys.executable, "-m", "tbexp", "stage=grpo", f"hydra.run.dir={run_dir}", *overrides]
    print("+", " ".join(command), flush=True)
    clock = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - clock


def _eval(run_dir: Path, index: int) -> tuple[dict[str, float], list[dict]]:
    """A held-out eval of the run (-1: after the last step; 0: the first, the start's with eval_at_start)."""
    state = json.loads((run_dir / "grpo_state.json").read_text())
    chosen = state["evals"][index]
    records = read_records(run_dir / "evals" / f"step-{chosen['step']:05d}")
    if records is None:
        raise SystemExit(f"{run_dir}: the eval at step {chosen['step']} wrote no episodes.jsonl")
    return chosen, records


if __name__ == "__main__":
    main()
