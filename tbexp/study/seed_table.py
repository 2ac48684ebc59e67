"""The RL gain over seeds: one row per default-job run directory, then the mean gain, its standard error and a
95% interval (Student's t over the seeds).

    python scripts/seed_table.py outputs/2026-12-02/18-01-07 runs/seed1 runs/seed2 ...
    python scripts/seed_table.py --metric eval/reward RUN_DIR ...
    python scripts/seed_table.py RUN_DIR ... --against OTHER_RUN_DIR ...

(`scripts/seed_table.py` runs `main` here.)

With --against, the other run directories (the same seeds with another setting) get their own table, then the
difference of the two gains seed by seed (other − first) with its mean and interval: paired by seed, so the
seed-to-seed spread that both settings share drops out.

Each RUN_DIR is a `python -m tbexp seed=N` run directory: its `summary.json` holds the base, sft and rl rows
and the promotion gate's paired difference (rl − sft on the same held-out tasks and draws, with its
task-clustered s.e.), its `.hydra/config.yaml` the seed. The gain is rl − sft in points (× 100). The interval
treats the seeds as the sample: mean ± t(0.975, n − 1) · sd / √n.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import yaml


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom, by bisection on its CDF.

    >>> round(t_quantile(0.975, 4), 3), round(t_quantile(0.975, 1), 3)
    (2.776, 12.706)
    """
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, steps: int = 4000) -> float:  # 0.5 + ∫0^x density, Simpson's rule
        h = x / steps
        ys = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(steps + 1)]
        return 0.5 + h / 3 * (ys[0] + ys[-1] + 4 * sum(ys[1:-1:2]) + 2 * sum(ys[2:-1:2]))

    low, high = 0.0, 1000.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def run_row(run_dir: Path, metric: str) -> dict:
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        sys.exit(f"{run_dir}: no summary.json (has the job finished?)")
    summary = json.loads(summary_path.read_text())
    missing = [row for row in ("base", "sft", "rl") if row not in summary]
    if missing:
        sys.exit(f"{summary_path}: no {', '.join(missing)} row: not a default-job (pipeline) run")
    config = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    gate = summary.get("promotion", {})
    paired = gate.get("metric") == metric and gate.get("incumbent") == "sft"
    return {
        "seed": config.get("seed"),
        "base": summary["base"][metric],
        "sft": summary["sft"][metric],
        "rl": summary["rl"][metric],
        "gain": 100 * (summary["rl"][metric] - summary["sft"][metric]),
        "stderr": 100 * gate["stderr"] if paired else math.nan,
        "kept": summary.get("filter", {}).get("filter/kept", math.nan),
        "candidates": summary.get("filter", {}).get("filter/candidates", math.nan),
        "step": summary.get("grpo", {}).get("grpo/best_step", math.nan),
    }


def table(rows: list[dict], metric: str) -> str:
    lines = [
        f"held-out {metric}; gain = SFT+RL − SFT\n",
        "| seed | base | SFT | SFT+RL | gain (pts) | paired s.e. (pts) | RL step chosen | RL tasks kept |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['base']:.3f} | {r['sft']:.3f} | {r['rl']:.3f} | {r['gain']:+.1f} | {r['stderr']:.1f} "
            f"| {r['step']:.0f} | {r['kept']:.0f} of {r['candidates']:.0f} |"
        )
    gains = [r["gain"] for r in rows]
    mean = statistics.fmean(gains)
    mean_of = {k: statistics.fmean(r[k] for r in rows) for k in ("base", "sft", "rl")}
    lines.append(
        f"| mean | {mean_of['base']:.3f} | {mean_of['sft']:.3f} | {mean_of['rl']:.3f} | **{mean:+.1f}** | | | |"
    )
    if len(gains) > 1:
        lines.append(f"\n{len(gains)} seeds: mean gain {interval(gains)}")
    return "\n".join(lines)


def interval(values: list[float]) -> str:
    """'mean pts, sd, s.e., 95% interval' of per-seed values, the seeds taken as the sample."""
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    stderr = sd / math.sqrt(len(values))
    half = t_quantile(0.975, len(values) - 1) * stderr
    return (
        f"{mean:+.1f} pts, sd {sd:.1f}, s.e. {stderr:.1f}, "
        f"95% interval [{mean - half:+.1f}, {mean + half:+.1f}] (t, {len(values) - 1} df)"
    )


def paired(rows: list[dict], other: list[dict]) -> str:
    """Per seed, the other setting's gain minus the first's; only seeds that both have."""
    first = {r["seed"]: r["gain"] for r in rows}
    both = [(r["seed"], r["gain"] - first[r["seed"]]) for r in other if r["seed"] in first]
    if not both:
        sys.exit("--against: no seed in common with the first run directories")
    lines = ["\ngain of --against minus gain of the first, per seed: " + ", ".join(f"{s}: {d:+.1f}" for s, d in both)]
    if len(both) > 1:
        lines.append(f"{len(both)} seeds: mean difference {interval([d for _, d in both])}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--metric", default="eval/strict_success")
    parser.add_argument("--against", nargs="+", type=Path, default=[], help="the same seeds with another setting")
    args = parser.parse_args()
    rows = sorted((run_row(d, args.metric) for d in args.run_dirs), key=lambda r: r["seed"])
    print(table(rows, args.metric))
    if args.against:
        other = sorted((run_row(d, args.metric) for d in args.against), key=lambda r: r["seed"])
        print("\n" + table(other, args.metric))
        print(paired(rows, other))


if __name__ == "__main__":
    main()
