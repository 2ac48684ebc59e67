"""The parity table: checkpoints scored through tbexp's own agent loop and through Harbor's trials.

    python scripts/harness_parity.py --run-dir outputs/<date>/<time> --runs 3   # base, SFT, SFT+RL of a default job
    python scripts/harness_parity.py --checkpoint DIR --runs 3                  # one checkpoint ("" = the base model)
    python scripts/harness_parity.py --agent terminus_2 --checkpoint DIR -- model.max_length_tokens=6144

Each harness runs `policy=model` with `agent=<--agent>` on the same held-out tasks with the same sampling seeds
(the eval draws, `tbexp.seeds.stream(seed, "eval")`): `native` is the eval stage, `harbor` the eval stage with
`eval.harness=harbor`: Harbor's `Trial` (environment, agent time-out, verifier) over tbexp's sandbox, the agent
the one Harbor runs for that protocol (tbexp's raw_command as a Harbor agent, or Harbor's terminus-2), sampling
from the same sampler. Per checkpoint and harness: scored episodes, strict success +- its binomial standard error,
per-test reward, valid commands, average turns, invalid episodes, wall time and episodes per second. Per
checkpoint: Harbor - native strict success with its paired, task-clustered standard error (the promotion gate's,
tbexp.episodes.promotion), how many episodes had the same outcome (strict, reward and turns) and how many sent
the model the same messages. Runs go under --out (default multirun/harness_parity/<time>), one folder per
checkpoint and harness. Overrides after `--` go to both harnesses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ALL_TRANSCRIPTS = 100_000  # eval.save_episodes: keep every episode's messages, to compare them


def main() -> None:
    args = _parse()
    from hydra import compose, initialize_config_dir

    from tbexp.config import register
    from tbexp.job import Job
    from tbexp.stages import eval as eval_stage

    register()
    out = Path(args.out or REPO / "multirun" / "harness_parity" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    checkpoints = _checkpoints(args)
    common = ["stage=eval", "policy=model", f"eval.n_runs={args.runs}", f"agent={args.agent}", *args.overrides]
    common += [f"eval.save_episodes={ALL_TRANSCRIPTS}"] + ([f"tasks.limit={args.tasks}"] if args.tasks else [])
    harnesses = {"native": [], "harbor": ["eval.harness=harbor"]}
    job, lines = None, []
    for label, checkpoint in checkpoints.items():
        rows = {}
        for harness, extra in harnesses.items():
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                cfg = compose("config", overrides=[*common, *extra])
            if job is None:
                job = Job(cfg, run_dir=out)
            else:  # the weights stay loaded: later evals reuse the job's model host
                job.cfg = cfg
            folder = out / label / harness
            started = time.perf_counter()
            metrics = eval_stage.evaluate_checkpoint(job, folder, checkpoint, label=f"{label} {harness}", quiet=True)
            rows[harness] = (metrics, time.perf_counter() - started, folder)
        lines += _rows(label, rows)
        print("\n".join(lines[-3:]), flush=True)
    print(f"\n{args.runs} run(s) a task, agent={args.agent}; files under {out}\n")
    print("\n".join([HEAD, SEP, *lines]))
    (out / "parity.md").write_text("\n".join([HEAD, SEP, *lines]) + "\n")


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="", help="a default job's run directory: its base, SFT and SFT+RL")
    parser.add_argument(
        "--checkpoint", action="append", default=[], help='a checkpoint directory or tinker:// URI ("" = base model)'
    )
    parser.add_argument("--runs", type=int, default=1, help="runs per task (eval.n_runs)")
    parser.add_argument("--tasks", type=int, default=0, help="the first N held-out tasks (tasks.limit); 0 = all")
    parser.add_argument("--agent", default="raw_command", help="agent= for both harnesses")
    parser.add_argument("--out", default="", help="where the runs go")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both harnesses, after --")
    return parser.parse_args()


def _checkpoints(args: argparse.Namespace) -> dict[str, str]:
    """Label -> checkpoint: the run directory's base / sft / rl rows, then each --checkpoint."""
    chosen = {}
    if args.run_dir:
        summary = json.loads((Path(args.run_dir) / "summary.json").read_text())
        chosen = {
            "base": "",
            "sft": summary["sft_training"]["sft/checkpoint"],
            "rl": summary["grpo"]["grpo/checkpoint"],
        }
    for i, checkpoint in enumerate(args.checkpoint or ([] if chosen else [""])):
        chosen[Path(checkpoint).name or "base" if checkpoint else f"base{i or ''}"] = checkpoint
    return chosen


HEAD = (
    "| checkpoint | harness | scored | strict ± s.e. | per-test reward | valid commands | avg turns | invalid | wall s"
    " | episodes/s | harbor − native strict (paired s.e.) | same outcome | same messages |"
)
SEP = "|" + "---|" * (HEAD.count("|") - 1)


def _rows(label: str, rows: dict) -> list[str]:
    from tbexp.episodes.promotion import paired_difference, read_records

    native_dir, harbor_dir = rows["native"][2], rows["harbor"][2]
    records = {name: read_records(folder) for name, (_, _, folder) in rows.items()}
    diff = paired_difference(records["harbor"], records["native"], "eval/strict_success")
    mine = {(r["task"], r["run"]): (r["strict"], r["reward"], r["turns"]) for r in records["native"]}
    same = sum(
        1 for r in records["harbor"] if mine.get((r["task"], r["run"])) == (r["strict"], r["reward"], r["turns"])
    )
    talks = [_messages(native_dir), _messages(harbor_dir)]
    same_talk = sum(1 for key, messages in talks[0].items() if talks[1].get(key) == messages)
    out = []
    for harness, (m, wall_s, _) in rows.items():
        episodes = m["eval/episodes"]
        scored = episodes - m["eval/invalid_episodes"]
        p = m["eval/strict_success"]
        se = math.sqrt(p * (1 - p) / scored) if scored and not math.isnan(p) else math.nan
        cells = [label, harness, f"{scored:.0f}", f"{p:.3f} ± {se:.3f}", f"{m['eval/reward']:.3f}"]
        cells += [
            f"{m['eval/valid_command_rate']:.3f}",
            f"{m['eval/avg_turns']:.2f}",
            f"{m['eval/invalid_episodes']:.0f}",
        ]
        cells += [f"{wall_s:.1f}", f"{episodes / wall_s:.2f}"]
        if harness == "harbor":
            cells += [
                f"{diff['difference']:+.3f} ({diff['stderr']:.3f})",
                f"{same} of {len(mine)}",
                f"{same_talk} of {len(talks[0])}",
            ]
        else:
            cells += ["", "", ""]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _messages(folder: Path) -> dict[tuple[str, int], list]:
    """(task, run) -> the messages the eval's episode sent and got, from its transcripts."""
    return {
        (record["task"], record["run"]): record["messages"]
        for record in (json.loads(path.read_text()) for path in (folder / "episodes").glob("*.json"))
    }


if __name__ == "__main__":
    main()
