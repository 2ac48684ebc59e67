"""GRPO's rollouts: which groups a step samples, fresh groups in place of flat ones, and sampling ahead of training.

A `Plan` fixes a step's rollouts when they are launched: the tasks of its groups
(epoch-wise shuffles of the active RL tasks, a function of the step), the spare
tasks that replace groups whose rewards do not spread (a shuffle of the other
active tasks, also a function of the step), and the checkpoint whose weights
sample them. `sample_groups` samples the groups, then, round by round, as many
spares as there were flat groups, until every group spreads or
`grpo.max_replaced_groups` fresh groups were sampled.

`RolloutPipeline` samples the plans of later steps on one background thread
while the trainer updates: with `grpo.max_off_policy_steps` = k, the rollouts of
step t are launched at the start of step t - k, from the weights as they are
then (after t - k updates), so they are exactly k updates old when step t trains
on them (fewer in the first k steps, which sample from the start). The bound holds
by construction: the pipeline never launches a step more than k ahead, so no
episode is ever older than the bound and none is dropped during a run. The
importance ratio of `importance_sampling`/`ppo` corrects for the lag: every datum
carries the logprobs of the weights that sampled it (tbexp.episodes.advantages).

Resuming: the stage saves the plans in flight with each checkpoint and keeps the
checkpoints they sample from; a resumed run discards what was in flight and
launches the same plans again from the same weights, with the same seeds, so it
samples what the uninterrupted run sampled. A saved plan older than the bound (a
run resumed with a smaller max_off_policy_steps) is re-queued: planned afresh
from the live weights, and counted (`requeued`).

Simplified: one background thread, so the rollouts of two steps never run at
once (on a few cores they would only compete); a cancelled run finishes the
episodes already running before it stops.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from tbexp.episodes.difficulty import group_spreads
from tbexp.jobs.schedule import epoch_batch
from tbexp.seeds import stream

if TYPE_CHECKING:
    from tbexp.episodes.rollout import Episode


@dataclass(frozen=True)
class Plan:
    step: int  # the step that trains on these rollouts
    tasks: list[str]  # the task of each group, in order
    version: int  # how many updates the sampling weights had when launched
    checkpoint: str  # those weights: a saved checkpoint, the start ("" = the base model's)
    spares: list[str] = field(default_factory=list)  # tasks tried, in order, in place of flat groups

    @classmethod
    def load(cls, saved: dict[str, Any]) -> Plan:
        return cls(**saved)

    def dump(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(
    step: int, active: list[str], groups: int, seed: int, version: int, checkpoint: str, spares: bool
) -> Plan:
    """Step `step`'s groups from the active tasks (epoch-wise shuffles) and, with `spares`, its replacement order.

    >>> plan = make_plan(0, ["a", "b", "c"], 2, 0, 0, "", spares=True)
    >>> plan.tasks, plan.spares
    (['a', 'c'], ['b'])
    """
    tasks = list(dict.fromkeys(epoch_batch(active, step, groups, seed)))  # a task twice in a step is one group
    rest = [name for name in active if name not in tasks] if spares else []
    random.Random(stream(seed, "spares", step)).shuffle(rest)
    return Plan(step, tasks, version, checkpoint, rest)


@dataclass
class Rollouts:
    plan: Plan
    episodes: list[Episode]
    replaced: int = 0  # fresh groups sampled in place of flat ones
    rollout_s: float = 0.0  # wall clock of the sampling, on whichever thread ran it
    sample_s: float = 0.0  # of which the sampler was busy


def sample_groups(
    plan: Plan,
    sample: Callable[[list[str]], list[Episode]],
    rewards_of: Callable[[list[Episode]], dict[int, float]],
    max_replaced: int,
) -> tuple[list[Episode], int]:
    """The plan's groups, plus fresh groups from its spares in place of flat ones (at most `max_replaced`).

    `sample(names)` runs one group per task name; `rewards_of(episodes)` scores them (keyed by id(episode)).
    """
    episodes = sample(plan.tasks)
    spares, replaced, latest = list(plan.spares), 0, episodes
    while replaced < max_replaced and spares:
        flat = _flat_groups(latest, rewards_of(latest))
        fresh = spares[: min(flat, max_replaced - replaced)]
        if not fresh:
            break
        del spares[: len(fresh)]
        replaced += len(fresh)
        latest = sample(fresh)
        episodes += latest
    return episodes, replaced


def _flat_groups(episodes: list[Episode], rewards: dict[int, float]) -> int:
    """How many task groups among `episodes` teach nothing (rewards that do not spread, or no valid episode)."""
    groups: dict[str, list[float]] = {}
    for ep in episodes:
        scores = groups.setdefault(ep.task.name, [])  # a task whose episodes are all invalid is a flat group too
        if not ep.invalid and ep.sampled is not None and ep.sampled.turns:
            scores.append(rewards[id(ep)])
    return sum(not group_spreads(g) for g in groups.values())


class RolloutPipeline:
    """Rollouts of later steps sampled on a background thread while the caller trains.

    `run(plan, sampler, stop)` samples one plan (it should give up once `stop` is set: run_policy's `stop`).
    """

    def __init__(self, bound: int, run: Callable[[Plan, Any, threading.Event], Rollouts]):
        self.bound = bound
        self._run = run
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-rollouts")
        self._inflight: dict[int, tuple[Plan, Future[Rollouts]]] = {}
        self._stop = threading.Event()
        self.launched = -1  # the latest step launched
        self.requeued = 0  # saved plans older than the bound, planned again

    def resume(self, saved: list[Plan], step: int, sampler_for: Callable[[Plan], Any]) -> None:
        """Launch again the plans a stopped run had in flight, from their own weights. If one is older than the
        bound (the run was resumed with a smaller one), all are re-queued: `advance` plans them afresh."""
        saved = sorted((p for p in saved if p.step >= step), key=lambda p: p.step)  # earlier ones were trained on
        if any(p.step - p.version > self.bound or p.step > step + self.bound for p in saved):
            self.requeued += len(saved)
            return
        for plan in saved:
            self.launch(plan, sampler_for(plan))

    def advance(self, step: int, steps: int, plan_for: Callable[[int], Plan], live_sampler: Callable[[], Any]) -> None:
        """Launch every step up to `step` + bound (below `steps`) not yet launched, from the live weights."""
        for t in range(max(self.launched + 1, step), min(step + self.bound, steps - 1) + 1):
            self.launch(plan_for(t), live_sampler())

    def launch(self, plan: Plan, sampler: Any) -> None:
        self._inflight[plan.step] = (plan, self._worker.submit(self._timed, plan, sampler))
        self.launched = max(self.launched, plan.step)

    def _timed(self, plan: Plan, sampler: Any) -> Rollouts:
        clock = time.perf_counter()
        rollouts = self._run(plan, sampler, self._stop)
        rollouts.rollout_s = time.perf_counter() - clock
        return rollouts

    def take(self, step: int) -> Rollouts:
        """Step `step`'s rollouts, waiting for them if they are still being sampled."""
        if step not in self._inflight:
            raise KeyError(f"step {step}'s rollouts were never launched (launched up to {self.launched})")
        _, future = self._inflight.pop(step)
        return future.result()

    def pending(self) -> list[Plan]:
        """The plans in flight, in step order: what a checkpoint must remember to resume exactly."""
        return [plan for _, (plan, _) in sorted(self._inflight.items())]

    def close(self) -> None:
        """Discard what is in flight: episodes not started are skipped, running ones finish first."""
        self._stop.set()
        self._worker.shutdown(wait=True, cancel_futures=True)
