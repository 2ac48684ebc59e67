"""Held-out evals leave GRPO's rollouts alone: a rollout is a function of the weights and its own random stream.

The suspicion this rules out: an eval drawn from another seed (its sampler, the process's global random
state, a shared sampler RNG) changing the rollouts that follow it. Everything runs one episode at a time, so
that no batch's rounding can be in question (tests/test_lockstep.py covers concurrent episodes' batches).
"""

from __future__ import annotations

import json

import pytest

from tbexp import seeds
from tbexp.stages import eval as eval_stage
from tbexp.stages import grpo as grpo_stage
from tests.conftest import compose_job

SMALL = [
    "stage=grpo",
    "policy=model",
    "task_filter=none",
    "task_filter.max_tasks=0",
    "tasks.families=[file-move]",
    "tasks.train_per_family=4",
    "tasks.heldout_per_family=1",
    "grpo.steps=1",
    "grpo.groups_per_step=2",
    "grpo.group_size=2",
    "grpo.temperature=1.5",
    "grpo.eval_at_start=true",
    "grpo.eval_n_runs=2",
    "grpo.concurrency=1",
    "eval.concurrency=1",
    "sampling.max_tokens=24",
    "agent.max_turns=2",
]


def _run(tmp_path, monkeypatch, eval_offset: int) -> tuple[list, list, list]:
    """(eval transcripts, rollout transcripts, rollout metrics) of one GRPO step after an eval at step 0."""
    monkeypatch.setitem(seeds.STREAMS, "grpo_eval", (7919, eval_offset))
    seen: dict[str, list] = {"eval": [], "rollouts": []}

    def recording(original, kind):
        def run_policy(*args, **kwargs):
            episodes = original(*args, **kwargs)
            seen[kind] += sorted((ep.task.name, ep.run, json.dumps(ep.messages)) for ep in episodes)
            return episodes

        return run_policy

    monkeypatch.setattr(eval_stage, "run_policy", recording(eval_stage.run_policy, "eval"))
    monkeypatch.setattr(grpo_stage, "run_policy", recording(grpo_stage.run_policy, "rollouts"))
    out = tmp_path / f"eval-offset-{eval_offset}"
    job = compose_job(*SMALL, f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}")
    grpo_stage.train(job, "", grpo_stage.rl_tasks(job, "", out), out)
    monkeypatch.undo()  # the next run wraps the originals again
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [
        {k: v for k, v in r.items() if k.startswith(("rollout/", "train/"))} for r in rows if "rollout/reward_mean" in r
    ]
    return seen["eval"], seen["rollouts"], metrics


@pytest.mark.slow
@pytest.mark.sandbox
def test_the_eval_seed_does_not_reach_the_rollouts(rootfs, tmp_path, monkeypatch):
    evals_a, rollouts_a, metrics_a = _run(tmp_path, monkeypatch, eval_offset=18)
    evals_b, rollouts_b, metrics_b = _run(tmp_path, monkeypatch, eval_offset=1018)
    assert evals_a != evals_b, "the eval seed did not change the eval: this test would show nothing"
    assert rollouts_a and rollouts_a == rollouts_b  # the same replies, word for word
    assert metrics_a == metrics_b  # valid_command_rate among them
