"""The GRPO stage: real steps in sandboxes, resume, robustness (its arithmetic: tests/test_advantages.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tbexp.stages import grpo as grpo_stage
from tests.conftest import collect_oracle, compose_config, compose_job


@pytest.mark.parametrize(
    "metric, expected", [("eval/reward", {4: 0.4, 8: 0.2, 12: 0.3}), ("grpo/best_reward", {4: 0.4, 8: 0.4, 12: 0.4})]
)
def test_a_sweep_trial_hears_the_latest_or_the_peak_held_out_reward(tmp_path, metric, expected):
    """The reward at each eval, or the peak so far (what the stage would return): the trial's pruning metric picks.

    An eval with no valid episode (NaN, at step 0) is not reported, and is never the peak.
    """
    import optuna

    from tbexp.study.storage import load_study, open_storage

    storage = f"sqlite:///{tmp_path}/optuna.db"
    optuna.create_study(study_name="s", storage=open_storage(storage), direction="maximize").ask()
    cfg = compose_config(
        "trial.number=0", "trial.study=s", f"trial.storage={storage}", f"trial.pruning_metric={metric}"
    )
    evals = []
    for step, reward in (
        (0, float("nan")),
        (4, 0.4),
        (8, 0.2),
        (12, 0.3),
    ):  # RL spoils a good start, recovers part of it
        evals.append({"step": step, "eval/reward": reward})
        grpo_stage._report(cfg, evals, step)
    assert load_study(storage, "s").trials[0].intermediate_values == expected


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory, rootfs) -> str:
    """A checkpoint that solves the three RL tasks some of the time: a few SFT steps on their oracle turns."""
    from tbexp.stages import sft

    folder = tmp_path_factory.mktemp("warm")
    collect_oracle(folder / "gold.jsonl", "tasks.limit=3", "tasks.families=[file-move]", "collect.split=train")
    job = compose_job(
        "stage=sft",
        "tasks.limit=3",
        "tasks.families=[file-move]",
        "sft.steps=30",
        "sft.batch_size=4",
        "sft.eval_every=30",
        "sft.learning_rate=0.01",
        "sft.val_fraction=0.34",
        "sft.patience=0",
    )
    return sft.train(job, folder / "gold.jsonl", folder / "sft").checkpoint


GRPO = [
    "stage=grpo",
    "policy=model",
    "reward=per_test",
    "task_filter=none",
    "tasks.limit=3",
    "tasks.families=[file-move]",
    "task_filter.max_tasks=0",
    "grpo.groups_per_step=3",
    "grpo.group_size=6",
    "grpo.temperature=1.2",
    "grpo.eval_every=2",
    "grpo.eval_n_runs=1",
    "sampling.max_tokens=48",
    "agent.max_turns=3",
]


def _grpo(run_dir, monkeypatch, checkpoint, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(run_dir)
    return grpo_stage.run(compose_job(*GRPO, f"load_checkpoint={checkpoint}", *overrides))


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "rewards, expected",
    [
        ({0: 0.30, 4: 0.50, 8: 0.45, 12: 0.40}, 4),  # RL helps, then spoils: the peak, not the last
        ({0: 0.50, 4: 0.50, 8: 0.25}, 0),  # a tie: the earlier, less-trained one, here the start
        ({0: math.nan, 4: 0.10, 8: 0.20}, 8),  # an eval with no valid episode is never the peak
        ({0: 0.40, 4: math.nan, 8: 0.30}, 0),
    ],
)
def test_the_peak_is_the_highest_held_out_reward_earliest_on_a_tie(rewards, expected):
    evals = [{"step": step, "eval/reward": reward} for step, reward in rewards.items()]
    assert grpo_stage.peak(evals)["step"] == expected


@pytest.mark.slow
@pytest.mark.sandbox
def test_steps_log_where_time_went_and_keep_the_peak(warm_start, tmp_path, monkeypatch):
    """Real steps and held-out evals; the held-out rewards the stage reads are then fixed (0.5 at the start, 0.25
    after step 2), so the peak it keeps is known by hand: the start."""
    from tbexp.stages import eval as eval_stage

    real_evaluate, held_out = eval_stage.evaluate, {"grpo step 0": 0.5, "grpo step 2": 0.25}

    def scripted_evaluate(*args, label="", **kwargs):
        return {**real_evaluate(*args, label=label, **kwargs), "eval/reward": held_out[label]}

    monkeypatch.setattr(eval_stage, "evaluate", scripted_evaluate)
    metrics = _grpo(tmp_path, monkeypatch, warm_start, "grpo.steps=2", "grpo.learning_rate=0.01")
    steps = [r for r in _rows(tmp_path) if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert sum(r["rollout/datums"] for r in steps) > 0, "every group had equal rewards: nothing was trained"
    # model=tiny carries a logit scale (backends/logit_scale.py): SFT left it at 1, GRPO trains it
    (scale,) = [v for n, v in load_file(f"{warm_start}/trainable.safetensors").items() if n.endswith("norm.log_scale")]
    assert float(scale) == 0.0
    trained = [r for r in steps if "optim/logit_scale" in r]
    assert trained and all(r["optim/logit_scale"] != 1.0 for r in trained)
    for key in (
        "time/sample",
        "time/env",
        "time/verify",
        "time/train",
        "rollout/strict_success",
        "rollout/valid_command_rate",
        "rollout/turns",
        "rollout/invalid_episodes",
    ):
        assert key in steps[0], key
    state = json.loads((tmp_path / "grpo_state.json").read_text())
    assert [(e["step"], e["eval/reward"]) for e in state["evals"]] == [(0, 0.5), (2, 0.25)]
    start = state["evals"][0]["checkpoint"]
    assert start.endswith("step-00000") and Path(start).is_dir()  # the start, saved at its eval
    assert metrics["grpo/best_step"] == 0.0 and metrics["grpo/best_reward"] == 0.5
    assert metrics["grpo/checkpoint"] == start == (tmp_path / "chosen_checkpoint.txt").read_text().strip()
    assert (tmp_path / "grpo.png").stat().st_size > 0
    assert not (tmp_path / "checkpoints" / "step-00001").exists()  # superseded and not an eval point


@pytest.mark.sandbox
def test_the_continuous_batcher_serves_the_rollouts_and_its_busy_time_is_the_sampling_share(
    warm_start, tmp_path, monkeypatch
):
    _grpo(
        tmp_path,
        monkeypatch,
        warm_start,
        "grpo.steps=1",
        "grpo.eval_at_start=false",
        "backend.continuous_batching=true",
    )
    (step,) = [r for r in _rows(tmp_path) if "rollout/reward_mean" in r]
    assert step["rollout/groups"] == 3 and 0 < step["time/sample"] <= step["time/rollout"], step


def _killed_in_step_2(run_dir, monkeypatch, checkpoint, settings) -> None:
    """A run killed in the third step's update, after the second step's checkpoint."""
    real_step = grpo_stage._step

    def dies_at_step_2(job, backend, reference, rollouts, step):
        if step == 2:
            raise KeyboardInterrupt
        return real_step(job, backend, reference, rollouts, step)

    monkeypatch.setattr(grpo_stage, "_step", dies_at_step_2)
    with pytest.raises(KeyboardInterrupt):
        _grpo(run_dir, monkeypatch, checkpoint, *settings)
    monkeypatch.setattr(grpo_stage, "_step", real_step)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(warm_start, tmp_path, monkeypatch):
    # One episode at a time, so every batch of samples holds one request and the numbers are exactly repeatable.
    settings = (
        "grpo.steps=3",
        "grpo.concurrency=1",
        "grpo.eval_at_start=false",
        "grpo.eval_every=3",
        "grpo.learning_rate=0.05",
        "reward=per_test",
    )
    _grpo(tmp_path / "straight", monkeypatch, warm_start, *settings)
    _killed_in_step_2(tmp_path / "resumed", monkeypatch, warm_start, settings)
    _grpo(tmp_path / "resumed", monkeypatch, warm_start, *settings)

    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    assert any("train/loss" in r for r in straight), "no step trained: the comparison would prove nothing"
    key = ("rollout/reward_mean", "rollout/sampled_tokens", "train/loss")
    assert [[r.get(k) for k in key] for r in straight if "rollout/reward_mean" in r] == [
        [r.get(k) for k in key] for r in resumed if "rollout/reward_mean" in r
    ]
    w1 = load_file(tmp_path / "straight" / "checkpoints" / "step-00003" / "trainable.safetensors")
    w2 = load_file(tmp_path / "resumed" / "checkpoints" / "step-00003" / "trainable.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_broken_episode_is_dropped_and_the_step_goes_on(warm_start, tmp_path, monkeypatch):
    import tbexp.episodes.rollout as rollout
    from tbexp.sandboxes.base import SandboxError

    real_make_sandbox = rollout.make_sandbox
    calls = iter(range(1000))

    def start_breaks_once(settings, task):  # a sandbox that cannot start: the infrastructure's failure, not the agent's
        sandbox = real_make_sandbox(settings, task)
        if next(calls) == 1:

            def broken_start():
                raise SandboxError("the image went away")

            sandbox.start = broken_start
        return sandbox

    monkeypatch.setattr(rollout, "make_sandbox", start_breaks_once)
    _grpo(tmp_path, monkeypatch, warm_start, "grpo.steps=1", "grpo.eval_at_start=false", "grpo.eval_every=1")
    step = next(r for r in _rows(tmp_path) if "rollout/reward_mean" in r)
    assert step["rollout/invalid_episodes"] == 1.0


def test_no_kept_tasks_is_a_clear_error(tmp_path):
    from tbexp.episodes.trajectories import DataError

    kept = tmp_path / "kept_tasks.json"
    kept.write_text(json.dumps({"kept": [], "rates": {"tbexp/file-move-0001": 0.0, "tbexp/file-move-0002": 1.0}}))
    job = compose_job("stage=grpo", f"grpo.tasks_file={kept}", "tasks.limit=3", "tasks.families=[file-move]")
    with pytest.raises(DataError, match=r"no RL tasks kept \(solve rate in \[0.1, 0.8\] of 2 candidates rated\)"):
        grpo_stage.rl_tasks(job, "", tmp_path)


@pytest.mark.slow
@pytest.mark.sandbox
def test_pipelined_rollouts_with_replacement_resume_where_an_uninterrupted_run_ends(warm_start, tmp_path, monkeypatch):
    """max_off_policy_steps=1: step t trains on rollouts from the weights of step t-1, sampled while step t-1
    trained; flat groups are replaced from the spare task and tasks retire. Killed in the third update with
    the fourth step's rollouts in flight, the resumed run samples those again from the same weights."""
    settings = (
        "grpo.steps=4",
        "grpo.groups_per_step=2",  # of the three tasks, one is the spare
        "grpo.group_size=4",
        "grpo.concurrency=1",
        "grpo.eval_at_start=false",
        "grpo.eval_every=4",
        "grpo.learning_rate=0.05",
        "grpo.max_off_policy_steps=1",
        "grpo.max_replaced_groups=1",
        "grpo.retire_after=1",
    )
    _grpo(tmp_path / "straight", monkeypatch, warm_start, *settings)
    _killed_in_step_2(tmp_path / "resumed", monkeypatch, warm_start, settings)
    state = json.loads((tmp_path / "resumed" / "grpo_state.json").read_text())
    assert state["step"] == 2 and [p["step"] for p in state["plans"]] == [2]  # step 3's were in flight, unsaved
    _grpo(tmp_path / "resumed", monkeypatch, warm_start, *settings)

    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "resumed")
    steps = [r for r in straight if "rollout/reward_mean" in r]
    assert [r["rollout/off_policy_steps"] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert any("train/loss" in r for r in steps), "no step trained: the comparison would prove nothing"
    assert all(r["rollout/episodes"] == 4 * r["rollout/groups"] for r in steps)  # replaced groups counted in both
    key = (
        "rollout/reward_mean",
        "rollout/sampled_tokens",
        "rollout/replaced_groups",
        "rollout/retired_tasks",
        "train/loss",
    )
    assert [[r.get(k) for k in key] for r in steps] == [
        [r.get(k) for k in key] for r in resumed if "rollout/reward_mean" in r
    ]
    w1 = load_file(tmp_path / "straight" / "checkpoints" / "step-00004" / "trainable.safetensors")
    w2 = load_file(tmp_path / "resumed" / "checkpoints" / "step-00004" / "trainable.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not (tmp_path / "straight" / "checkpoints" / "step-00002").exists()  # no longer sampled from: dropped
