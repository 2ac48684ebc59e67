"""Pipelined rollouts and online difficulty control, with stub samplers: the staleness bound, resume, replacement.

The real loop over sandboxes runs in tests/test_grpo_stage.py (max_off_policy_steps=1, resumed exactly).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from tbexp.episodes.difficulty import DifficultyPool
from tbexp.stages.grpo_rollouts import Plan, RolloutPipeline, Rollouts, make_plan, sample_groups

TASKS = [f"t{i}" for i in range(6)]


class Trainer:
    """A stand-in for the GRPO loop's trainer: `version` counts updates, each plan records the version it sampled."""

    def __init__(self, steps: int, bound: int, saved: list[Plan] = (), start_step: int = 0):
        self.steps, self.version, self.trained = steps, start_step, []
        self.sampled = threading.Event()  # set by the stub sampler: rollouts ran while we trained
        self.pipeline = RolloutPipeline(bound, self.run)
        self.pipeline.resume(list(saved), start_step, lambda plan: f"weights-{plan.version}")

    def plan_for(self, step: int) -> Plan:
        return make_plan(step, TASKS, 2, 0, self.version, f"ckpt-{self.version}", spares=False)

    def run(self, plan, sampler, stop):
        assert sampler == f"weights-{plan.version}"  # the plan's own weights, also after a resume
        self.sampled.set()
        return Rollouts(plan, [])

    def live(self):
        return f"weights-{self.version}"

    def train(self, upto: int, overlap: bool = False) -> None:
        for step in range(self.version, upto):
            self.pipeline.advance(step, step + 1, self.plan_for, self.live)
            rollouts = self.pipeline.take(step)
            self.sampled.clear()
            self.pipeline.advance(step, self.steps, self.plan_for, self.live)
            assert len(self.pipeline.pending()) <= self.pipeline.bound
            if overlap and step + self.pipeline.bound < self.steps:  # a step was launched: it runs now
                assert self.sampled.wait(10), f"step {step + 1}'s rollouts did not run while step {step} trained"
            self.trained.append((step, rollouts.plan.version, rollouts.plan.tasks))
            self.version += 1


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_each_step_trains_on_rollouts_exactly_the_bound_old(bound):
    trainer = Trainer(steps=6, bound=bound)
    trainer.train(6, overlap=True)
    trainer.pipeline.close()
    assert [version for _, version, _ in trainer.trained] == [max(0, step - bound) for step in range(6)]
    # the tasks are the synchronous loop's: a function of the step alone
    assert [tasks for _, _, tasks in trainer.trained] == [
        make_plan(step, TASKS, 2, 0, 0, "", spares=False).tasks for step in range(6)
    ]


def test_a_resumed_pipeline_replays_the_plans_in_flight_from_their_weights():
    straight = Trainer(steps=7, bound=2)
    straight.train(7)
    first = Trainer(steps=7, bound=2)
    first.train(3)  # killed after step 3's checkpoint, with steps 3 and 4 in flight
    saved = [Plan.load(p.dump()) for p in first.pipeline.pending()]
    first.pipeline.close()
    assert [p.step for p in saved] == [3, 4]
    resumed = Trainer(steps=7, bound=2, saved=saved, start_step=3)
    resumed.train(7)
    assert first.trained + resumed.trained == straight.trained
    assert resumed.pipeline.requeued == 0


def test_plans_older_than_a_smaller_bound_are_requeued_and_counted():
    first = Trainer(steps=7, bound=3)
    first.train(4)
    saved = first.pipeline.pending()  # steps 4..6, sampled from the weights of steps 1..3
    first.pipeline.close()
    resumed = Trainer(steps=7, bound=1, saved=saved, start_step=4)
    assert resumed.pipeline.requeued == 3
    resumed.train(7)
    assert [(step, version) for step, version, _ in resumed.trained] == [(4, 4), (5, 4), (6, 5)]


def test_closing_discards_rollouts_in_flight():
    started, stopped = threading.Event(), threading.Event()

    def run(plan, sampler, stop):
        started.set()
        assert stop.wait(10), "close() never signalled the rollouts to stop"
        stopped.set()
        raise RuntimeError("cancelled")

    pipeline = RolloutPipeline(1, run)
    pipeline.launch(make_plan(0, TASKS, 2, 0, 0, "", spares=False), None)
    pipeline.launch(make_plan(1, TASKS, 2, 0, 0, "", spares=False), None)
    assert started.wait(10)
    pipeline.close()
    assert stopped.is_set()


def _episode(task: str, reward: float, valid: bool = True):
    sampled = SimpleNamespace(turns=[1])
    return SimpleNamespace(
        task=SimpleNamespace(name=task), reward=reward, invalid="" if valid else "broken", sampled=sampled
    )


def _sampler(rewards_by_task: dict[str, list[float]], calls: list):
    def sample(names):
        calls.append(list(names))
        return [_episode(name, r) for name in names for r in rewards_by_task[name]]

    return sample


def _rewards(episodes):
    return {id(ep): ep.reward for ep in episodes}


def test_flat_groups_are_replaced_by_spares_until_every_group_spreads():
    rewards = {"a": [1, 0], "b": [1, 1], "c": [0, 0], "d": [0, 0], "e": [1, 0], "f": [0, 1]}
    plan = Plan(0, ["a", "b", "c"], 0, "", spares=["d", "e", "f"])
    calls = []
    episodes, replaced = sample_groups(plan, _sampler(rewards, calls), _rewards, max_replaced=10)
    # b and c are flat: two spares (d, e); d is flat too: one more (f); then three groups spread
    assert calls == [["a", "b", "c"], ["d", "e"], ["f"]]
    assert replaced == 3 and len(episodes) == 12


def test_replacement_stops_at_the_cap_or_when_the_spares_run_out():
    rewards = {name: [0, 0] for name in "abcdef"}
    calls = []
    _, replaced = sample_groups(Plan(0, ["a", "b"], 0, "", ["c", "d", "e", "f"]), _sampler(rewards, calls), _rewards, 3)
    assert calls == [["a", "b"], ["c", "d"], ["e"]] and replaced == 3
    calls = []
    _, replaced = sample_groups(Plan(0, ["a", "b"], 0, "", ["c"]), _sampler(rewards, calls), _rewards, 10)
    assert calls == [["a", "b"], ["c"]] and replaced == 1
    calls = []
    _, replaced = sample_groups(Plan(0, ["a", "b"], 0, "", ["c"]), _sampler(rewards, calls), _rewards, 0)
    assert calls == [["a", "b"]] and replaced == 0


def test_a_group_whose_episodes_are_all_invalid_is_replaced():
    def sample(names):
        return [_episode(name, 1.0, valid=name != "a") for name in names for _ in range(2)] + (
            [_episode("b", 0.0)] if "b" in names else []
        )

    _, replaced = sample_groups(Plan(0, ["a", "b"], 0, "", ["c"]), sample, _rewards, 5)
    assert replaced == 1


def test_spares_are_the_other_active_tasks_in_a_fixed_order():
    plan = make_plan(3, TASKS, 2, seed=1, version=3, checkpoint="c", spares=True)
    assert sorted(plan.tasks + plan.spares) == TASKS and not set(plan.tasks) & set(plan.spares)
    assert plan == make_plan(3, TASKS, 2, seed=1, version=3, checkpoint="c", spares=True)
    assert plan.spares != make_plan(4, TASKS, 2, seed=1, version=3, checkpoint="c", spares=True).spares


def test_the_pool_retires_always_and_never_solved_tasks_but_keeps_enough():
    pool = DifficultyPool(["a", "b", "c", "d"], retire_after=2, min_active=2)
    assert pool.update(0, {"a": [True, True], "b": [False, False], "c": [True, False]}) == []
    assert pool.update(1, {"a": [True, True], "b": [False, False], "c": [False, False]}) == ["a", "b"]
    assert pool.active() == ["c", "d"] and pool.retired == 2
    assert pool.update(2, {"c": [False, False], "d": [False]}) == []  # c's streak is 2 now, but two must stay
    assert pool.records["c"].solve_rate == pytest.approx(1 / 6)
    restored = DifficultyPool(["a", "b", "c", "d"], retire_after=2, min_active=2)
    restored.restore(pool.state())
    assert restored.active() == pool.active() and restored.state() == pool.state()


def test_a_solved_streak_restarts_when_a_group_is_mixed():
    pool = DifficultyPool(["a", "b"], retire_after=2, min_active=1)
    pool.update(0, {"a": [True, True]})
    pool.update(1, {"a": [True, False]})
    assert pool.update(2, {"a": [True, True]}) == [] and pool.records["a"].streak == 1
    assert pool.update(3, {"a": [], "b": [True]}) == []  # no valid episode: nothing counted
    assert pool.records["a"].streak == 1 and pool.records["a"].episodes == 6
