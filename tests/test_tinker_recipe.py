"""The whole recipe through `backend=tinker` against a real Tinker-API server (SkyRL's, tests/tinker_server.py).

`python -m tbexp backend=tinker backend.base_url=URL` on a miniature of the defaults (test_pipeline_stage's): collect,
SFT, the base and SFT rows, the filter, GRPO, the final row, each model call through the server. The tiny model's
logit scale is local-only (Tinker trains LoRA adapters only), so it is off here. SkyRL 0.4.0 cannot export
(save_weights_external: 404): the stages report that and keep their tinker:// checkpoints.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.test_pipeline_stage import MINIATURE

pytestmark = [pytest.mark.slow, pytest.mark.sandbox]


def test_the_recipe_runs_end_to_end_through_the_server(rootfs, tmp_path, tinker_server):
    run = tmp_path / "run"
    args = [
        *MINIATURE,
        "backend=tinker",
        f"backend.base_url={tinker_server}",
        "model.logit_scale=false",
        "logger=none",
        f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}",
        f"hydra.run.dir={run}",
    ]
    clock = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tbexp", *args], cwd=REPO, capture_output=True, text=True, timeout=3000)
    took = time.perf_counter() - clock
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    summary = json.loads((run / "summary.json").read_text())
    for row in ("base", "sft", "rl"):
        assert 0.0 <= summary[row]["eval/reward"] <= 1.0, row
    assert summary["sft_training"]["sft/checkpoint"].startswith("tinker://")
    assert summary["grpo"]["grpo/checkpoint"].startswith("tinker://")
    assert "grpo/adapter" not in summary["grpo"]  # no export on this server ...
    assert "export failed" in out.stdout and summary["grpo"]["grpo/checkpoint"] in out.stdout  # ... and it says so
    # GRPO deleted its superseded per-step checkpoint from the service (no eval kept it), not the chosen one.
    import tinker

    chosen = summary["grpo"]["grpo/checkpoint"]
    run_id = chosen.removeprefix("tinker://").split("/")[0]
    stored = {
        c.tinker_path for c in tinker.RestClient(base_url=tinker_server).list_checkpoints(run_id).result().checkpoints
    }
    assert chosen in stored and chosen.replace("step-00002", "step-00001") not in stored, stored
    rewards = {row: round(summary[row]["eval/reward"], 3) for row in ("base", "sft", "rl")}
    print(f"\nthe miniature recipe through SkyRL's Tinker server: {took:.0f} s; held-out reward {rewards}")


def test_harbors_harness_evaluates_through_the_server(rootfs, tmp_path, tinker_server):
    """`eval.harness=harbor` with `backend=tinker`: Harbor's trials run tbexp's raw-command agent over the server's
    sampler (Harbor's BaseLLM is tbexp's TbexpLLM, each reply one sample from the server), Harbor's verifier scores."""
    run = tmp_path / "run"
    args = [
        "stage=eval",
        "policy=model",
        "eval.harness=harbor",
        "backend=tinker",
        f"backend.base_url={tinker_server}",
        "model.logit_scale=false",
        "logger=none",
        "tasks.heldout_per_family=1",
        "tasks.families=[file-move,needle-file]",
        "eval.n_runs=1",
        "eval.concurrency=2",
        "sampling.max_tokens=24",
        "agent.max_turns=2",
        f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}",
        f"hydra.run.dir={run}",
    ]
    out = subprocess.run([sys.executable, "-m", "tbexp", *args], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval/episodes"] == 2.0 and summary["eval/invalid_episodes"] == 0.0, summary
    results = sorted(run.glob("**/trials/*/result.json"))
    assert len(results) == 2, results  # Harbor's own trials, each with its verifier's result
    for result in results:
        detail = json.loads(result.read_text())["agent_result"]["rollout_details"][0]
        assert detail["completion_token_ids"] and all(lp <= 0 for turn in detail["logprobs"] for lp in turn)


def test_a_model_on_the_server_is_a_teacher_whose_collection_resumes(rootfs, tmp_path, tinker_server):
    """`stage=collect policy=model backend=tinker`: the teacher is a sampling client of a model the service serves
    (here the shipped tiny one). Its rows say so, only verified successes are kept, a data card is written, and a
    second run of the same collection samples nothing (the ledger: no episode paid for twice)."""
    data = tmp_path / "teacher.jsonl"
    args = [
        "stage=collect",
        "policy=model",
        "backend=tinker",
        f"backend.base_url={tinker_server}",
        "model.logit_scale=false",
        "logger=none",
        "tasks.families=[file-move]",
        "tasks.limit=2",
        "collect.n_runs=2",
        "collect.concurrency=4",
        "sampling.max_tokens=24",
        "agent.max_turns=2",
        f"collect.data={data}",
        f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}",
    ]
    for attempt in ("first", "again"):
        run = tmp_path / attempt
        out = subprocess.run(
            [sys.executable, "-m", "tbexp", *args, f"hydra.run.dir={run}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
        summary = json.loads((run / "summary.json").read_text())
        assert summary["collect/episodes"] == 4.0, summary
        resumed = summary["collect/resumed_episodes"]
        assert resumed == (0.0 if attempt == "first" else 4.0), summary  # the second run samples nothing
    ledger = [json.loads(line) for line in (tmp_path / "teacher.ledger.jsonl").read_text().splitlines()]
    episodes = [row for row in ledger if "task" in row]
    assert len(episodes) == 4 and {row["teacher"] for row in episodes} == {"tinker:tiny:base"}, ledger[:2]
    kept = [json.loads(line) for line in data.read_text().splitlines()]
    assert all(row["verdict"]["strict"] for row in kept)  # rejection sampling: verified successes only
    assert (tmp_path / "teacher.card.json").is_file()
