"""Charts written next to the numbers, for people who would rather look than read."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any


def plot_eval(rows: list[dict[str, Any]], metrics: dict[str, float], path: Path, title: str) -> Path:
    """Per-family strict success and mean reward, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        families[row["family"]].append(row)
    names = sorted(families)
    strict = [
        sum(r["strict"] for r in families[f]) / max(sum(r["runs"] - r["invalid"] for r in families[f]), 1)
        for f in names
    ]
    reward = [sum(r["reward"] for r in families[f]) / len(families[f]) for f in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], strict, width=0.4, label="strict success")
    ax.bar([x + 0.2 for x in xs], reward, width=0.4, label="mean reward")
    ax.set_xticks(list(xs), names, rotation=30, ha="right")
    ax.set_ylim(0, 1.3)  # headroom for the legend
    ax.set_title(
        f"{title}\nstrict {metrics['eval/strict_success']:.3f}, reward {metrics['eval/reward']:.3f}, pass@1 {metrics['eval/pass@1']:.3f} ± {metrics['eval/pass@1_stderr']:.3f}"
    )
    ax.legend(loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_curve(
    points: list[tuple[float, float]],
    path: Path,
    title: str,
    mark: float | None = None,
    ylabel: str = "held-out reward",
) -> Path:
    """One line over steps, with the chosen step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([x for x, _ in points], [y for _, y in points], marker="o")
    if mark is not None:
        ax.axvline(mark, color="grey", linestyle="--", label=f"chosen: step {mark:g}")
        ax.legend(loc="lower right")
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
