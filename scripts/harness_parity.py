"""The parity table: one checkpoint scored through tbexp's own agent loop and through Harbor's trials.

    python scripts/harness_parity.py                                   # the base tiny model, all held-out tasks
    python scripts/harness_parity.py --checkpoint DIR --runs 3         # a checkpoint (local dir or tinker:// URI)
    python scripts/harness_parity.py --native-agent terminus_2 -- sandbox=docker eval.concurrency=8

Each harness runs `policy=model` on the same held-out tasks with the same sampling seeds (the eval draws,
`tbexp.seeds.stream(seed, "eval")`): `native` is the eval stage with `agent=<--native-agent>`, `harbor` is the eval stage
with `eval.harness=harbor` (Harbor's terminus-2 sampling from the same sampler, Harbor's verifier, tbexp's
sandbox). Every row: scored episodes, strict success +- its binomial standard error (over scored episodes),
per-test reward, average turns, invalid episodes, wall time and episodes per second, and at the end how many
tasks got the same number of strict successes in both. Runs go under --out (default
multirun/harness_parity/<time>), each harness's eval files in its own folder. Overrides after `--` go to both.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def main() -> None:
    args = _parse()
    from hydra import compose, initialize_config_dir

    from tbexp.config import register
    from tbexp.job import Job
    from tbexp.stages import eval as eval_stage

    register()
    out = Path(args.out or REPO / "multirun" / "harness_parity" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    common = ["stage=eval", "policy=model", f"eval.n_runs={args.runs}", *args.overrides]
    if args.tasks:
        common.append(f"tasks.limit={args.tasks}")
    harnesses = {
        "native": [f"agent={args.native_agent}"],
        "harbor": ["agent=terminus_json", "eval.harness=harbor"],  # agent= only sets max_turns for terminus-2
    }
    rows, tables = {}, {}
    job = None
    for harness, extra in harnesses.items():
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = compose("config", overrides=[*common, *extra])
        if job is None:
            job = Job(cfg, run_dir=out)
        else:  # the weights stay loaded: the second harness reuses the job's model host
            job.cfg = cfg
            job.__dict__.pop("agent", None)
            job.__dict__.pop("_task_sets", None)
        started = time.perf_counter()
        metrics = eval_stage.evaluate_checkpoint(job, out / harness, args.checkpoint, label=harness, quiet=True)
        rows[harness] = (metrics, time.perf_counter() - started)
        tables[harness] = _strict_by_task(out / harness / "tasks.csv")
    print(_table(rows, tables, args))


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="", help='a checkpoint directory or tinker:// URI; "" = base model')
    parser.add_argument("--runs", type=int, default=1, help="runs per task (eval.n_runs)")
    parser.add_argument("--tasks", type=int, default=0, help="the first N held-out tasks (tasks.limit); 0 = all")
    parser.add_argument(
        "--native-agent", default="terminus_json", help="the native eval's agent= (terminus_2 once it lands)"
    )
    parser.add_argument("--out", default="", help="where the runs go")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both harnesses, after --")
    return parser.parse_args()


def _strict_by_task(path: Path) -> dict[str, str]:
    import csv

    return {row["task"]: row["strict"] for row in csv.DictReader(path.open())}


def _table(rows: dict, tables: dict, args: argparse.Namespace) -> str:
    head = f"{'harness':8} {'agent':14} {'scored':>6} {'strict ± s.e.':>15} {'reward':>7} {'turns':>6} {'invalid':>7} {'wall s':>7} {'ep/s':>6}"
    lines = [head, "-" * len(head)]
    for harness, (m, wall_s) in rows.items():
        episodes = m["eval/episodes"]
        scored = episodes - m["eval/invalid_episodes"]
        p = m["eval/strict_success"]
        se = math.sqrt(p * (1 - p) / scored) if scored and not math.isnan(p) else math.nan
        agent = args.native_agent if harness == "native" else "terminus-2"
        lines.append(
            f"{harness:8} {agent:14} {scored:6.0f} {p:8.3f} ± {se:.3f} {m['eval/reward']:7.3f} {m['eval/avg_turns']:6.2f}"
            f" {m['eval/invalid_episodes']:7.0f} {wall_s:7.1f} {episodes / wall_s:6.3f}"
        )
    native, harbor = tables["native"], tables["harbor"]
    same = sum(1 for task in native if native[task] == harbor.get(task))
    lines.append(f"tasks with the same strict count in both: {same} of {len(native)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
