"""tbexp.study.seed_table (scripts/seed_table.py): the RL gain over seeds, from the runs' summary.json, against
hand-computed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tbexp.study import seed_table


def _run(folder: Path, seed: int, sft: float, rl: float) -> Path:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
    row = lambda strict: {"eval/strict_success": strict, "eval/reward": strict + 0.1}  # noqa: E731
    summary = {
        "base": row(0.0),
        "sft": row(sft),
        "rl": row(rl),
        "filter": {"filter/kept": 12.0, "filter/candidates": 80.0},
        "grpo": {"grpo/best_step": 8.0},
        "promotion": {"metric": "eval/strict_success", "incumbent": "sft", "stderr": 0.03},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


@pytest.mark.parametrize(("df", "quantile"), [(1, 12.706), (2, 4.303), (4, 2.776), (30, 2.042)])
def test_t_quantile_matches_the_tables(df, quantile):
    assert seed_table.t_quantile(0.975, df) == pytest.approx(quantile, abs=5e-4)


def test_mean_gain_and_interval(tmp_path):
    # gains +4 and +8 points: mean 6, sd 2√2, s.e. 2, 95% half-width 12.706 · 2 = 25.4
    rows = [
        seed_table.run_row(_run(tmp_path / f"s{s}", s, sft, rl), "eval/strict_success")
        for s, sft, rl in [(1, 0.20, 0.28), (0, 0.25, 0.29)]
    ]
    text = seed_table.table(sorted(rows, key=lambda r: r["seed"]), "eval/strict_success")
    assert (
        "| 0 | 0.000 | 0.250 | 0.290 | +4.0 | 3.0 | 8 | 12 of 80 |\n| 1 | 0.000 | 0.200 | 0.280 | +8.0 | 3.0 |" in text
    )
    assert "mean gain +6.0 pts, sd 2.8, s.e. 2.0, 95% interval [-19.4, +31.4]" in text


def test_a_run_without_the_rl_row_is_refused(tmp_path):
    folder = _run(tmp_path / "s0", 0, 0.2, 0.3)
    summary = json.loads((folder / "summary.json").read_text())
    del summary["rl"]
    (folder / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit, match="no rl row"):
        seed_table.run_row(folder, "eval/strict_success")


def test_against_pairs_the_gains_by_seed(tmp_path):
    # first setting: gains +4 (seed 0), +8 (seed 1); the other: +6, +8, and seed 2 that the first lacks.
    # Differences +2 and 0: mean 1, sd √2, s.e. 1, 95% half-width 12.706
    first = [(0, 0.25, 0.29), (1, 0.20, 0.28)]
    other = [(0, 0.25, 0.31), (1, 0.20, 0.28), (2, 0.10, 0.50)]
    row = lambda name, s, sft, rl: seed_table.run_row(_run(tmp_path / f"{name}{s}", s, sft, rl), "eval/strict_success")  # noqa: E731
    text = seed_table.paired([row("a", *r) for r in first], [row("b", *r) for r in other])
    assert "per seed: 0: +2.0, 1: +0.0\n" in text
    assert "2 seeds: mean difference +1.0 pts, sd 1.4, s.e. 1.0, 95% interval [-11.7, +13.7]" in text
    with pytest.raises(SystemExit, match="no seed in common"):
        seed_table.paired([row("c", 5, 0.1, 0.2)], [row("d", 6, 0.1, 0.2)])
