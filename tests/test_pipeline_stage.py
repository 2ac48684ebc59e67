"""The pipeline stage end to end on a miniature of the defaults, and the eval stage's comparison and promotion gate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tbexp.stages.eval import promotion
from tests.conftest import REPO

MINIATURE = [
    "+experiment=pipeline",
    "tasks.families=[file-move,needle-file]",
    "tasks.limit=4",
    "sft.steps=20",
    "sft.batch_size=4",
    "sft.eval_every=10",
    "sft.val_fraction=0.25",
    "task_filter.lower=0.0",
    "task_filter.upper=1.0",
    "task_filter.k=2",
    "task_filter.max_tasks=4",
    "grpo.steps=2",
    "grpo.groups_per_step=2",
    "grpo.group_size=3",
    "grpo.eval_every=2",
    "grpo.eval_n_runs=1",
    "eval.n_runs=1",
    "sampling.max_tokens=48",
    "agent.max_turns=3",
]


def _tbexp(*args, timeout=1500):
    return subprocess.run(
        [sys.executable, "-m", "tbexp", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def _assert_loads_in_plain_peft(grpo: dict, overrides: list[str], tmp_path) -> None:
    from tbexp.backends.base import Export
    from tbexp.models import TINY_DIR
    from tests.conftest import compose_job
    from tests.test_adapters import _assert_reproduces

    exported = Export(grpo["grpo/adapter"], "adapter", str(TINY_DIR))
    sampler = compose_job(*overrides).models.sampler(grpo["grpo/checkpoint"])
    assert _assert_reproduces(exported, sampler, tmp_path) > 1e-3


@pytest.mark.slow
@pytest.mark.sandbox
def test_pipeline_writes_the_base_sft_rl_table_and_resumes(rootfs, tmp_path):
    run = tmp_path / "run"
    miniature = [*MINIATURE, f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}"]  # SFT and eval caches of this test only
    out = _tbexp(*miniature, f"hydra.run.dir={run}")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    for row in ("base", "sft", "rl"):
        for key in (
            "eval/strict_success",
            "eval/reward",
            "eval/pass@1",
            "eval/pass@1_stderr",
            "eval/valid_command_rate",
            "eval/avg_turns",
        ):
            assert key in summary[row], (row, key)
    assert summary["grpo"]["grpo/checkpoint"].startswith(str(run / "grpo" / "checkpoints"))
    # The pipeline's output as a user loads it: plain transformers + peft, the final checkpoint's logprobs.
    assert summary["grpo"]["grpo/adapter"] == str(run / "grpo" / "adapter")
    assert (run / "sft" / "adapter" / "adapter_config.json").is_file()
    _assert_loads_in_plain_peft(summary["grpo"], miniature, tmp_path)
    assert summary["filter"]["filter/kept"] == 4.0  # bounds [0, 1] keep every candidate
    assert "| sft+rl |" not in (run / "table.md").read_text() and "| rl |" in (run / "table.md").read_text()
    assert (run / "rl_curve.png").stat().st_size > 0
    assert "strict_success" in out.stdout  # the table is printed

    # The same command in the same directory redoes nothing.
    again = _tbexp(*miniature, f"hydra.run.dir={run}")
    assert again.returncode == 0, again.stderr[-3000:]
    said = again.stdout + again.stderr
    assert (
        said.count("already done") == 7 and "rollouts" not in said
    )  # collect, sft, base, sft eval, filter, grpo, final eval
    assert json.loads((run / "summary.json").read_text())["rl"] == summary["rl"]

    # Another job with the same SFT settings (a sweep trial varying only GRPO) reuses the SFT instead of training
    # again, and its base and SFT rows instead of scoring them again.
    other = _tbexp(*miniature, "grpo.learning_rate=0.01", "eval.concurrency=3", f"hydra.run.dir={tmp_path / 'other'}")
    assert other.returncode == 0, other.stderr[-3000:]
    assert (tmp_path / "other" / "sft").resolve() == (run / "sft").resolve()
    rows = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "train/nll" in r) == list(range(1, 21))  # each step trained once
    said = other.stdout + other.stderr
    assert said.count("row from the cache") == 2 and "eval base:" not in said and "eval sft:" not in said
    other_summary = json.loads((tmp_path / "other" / "summary.json").read_text())
    assert (other_summary["base"], other_summary["sft"]) == (summary["base"], summary["sft"])
    for name in ("eval_base", "eval_sft"):
        assert (tmp_path / "other" / name).resolve() == (run / name).resolve()
        assert (run / name / "tasks.csv").is_file()

    # A setting that changes what an eval samples scores the rows anew.
    hotter = _tbexp(
        *miniature, "sampling.temperature=1.0", "pipeline.stages=[collect,sft]", f"hydra.run.dir={tmp_path / 'hotter'}"
    )
    assert hotter.returncode == 0, hotter.stderr[-3000:]
    said = hotter.stdout + hotter.stderr
    assert "row from the cache" not in said and "eval base:" in said and "eval sft:" in said

    # A filter that keeps no RL task stops the job with the error, its base and SFT rows reported all the same.
    # (With k=2 a solve rate is 0, 0.5 or 1: none lies in [0.6, 0.9].)
    strict = tmp_path / "strict"
    none_kept = _tbexp(*miniature, "task_filter.lower=0.6", "task_filter.upper=0.9", f"hydra.run.dir={strict}")
    assert none_kept.returncode != 0 and "no RL tasks kept" in none_kept.stderr, none_kept.stderr[-3000:]
    table = (strict / "table.md").read_text()
    assert "| base |" in table and "| sft |" in table and "| rl |" not in table
    assert json.loads((strict / "summary.json").read_text())["sft"] == summary["sft"]


@pytest.mark.sandbox
def test_eval_compares_candidates_and_gives_a_promotion_verdict(rootfs, tmp_path):
    out = _tbexp(
        "stage=eval",
        "tasks.limit=2",
        "eval.n_runs=1",
        "eval.candidates=[nop,oracle]",
        f"hydra.run.dir={tmp_path}",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["oracle"]["eval/strict_success"] == 1.0 and summary["nop"]["eval/strict_success"] == 0.0
    assert summary["promotion"]["chosen"] == "oracle" and summary["promotion"]["promoted"]
    assert "PROMOTE oracle" in out.stdout


def test_promotion_keeps_the_incumbent_unless_beaten_by_the_margin():
    rows = {
        "base": {"eval/strict_success": 0.40},
        "a": {"eval/strict_success": 0.42},
        "b": {"eval/strict_success": 0.38},
    }
    assert promotion(rows, "eval/strict_success", 0.0)["chosen"] == "a"
    verdict = promotion(rows, "eval/strict_success", 0.05)
    assert verdict["chosen"] == "base" and not verdict["promoted"] and "KEEP base" in verdict["message"]
