"""Lockstep sampling batches: what concurrent episodes sample does not depend on thread timing.

Without it (`sampling.lockstep=false`) a batch is whatever requests arrived while the previous one ran, and a
batched product rounds differently from a lone one, so two runs of the same seeds differ in the last bits of
their logprobs and, where a draw is nearly tied, in the tokens drawn. Both tests shake the timing on purpose
(random sleeps, from an unseeded generator) and ask for the same batches and the same bits.
"""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from tbexp.backends.batch_sampling import BatchQueue, Request
from tbexp.episodes import policies
from tbexp.episodes.rollout import run_episodes
from tbexp.stages import eval as eval_stage
from tests.conftest import compose_job

JITTER = random.SystemRandom()


def _batches_of_one_run(workers: int, turns_by_job: list[int]) -> list[tuple[int, ...]]:
    """The batches (each a tuple of request seeds) when jobs of `turns_by_job[j]` requests each run at random pace."""
    batches: list[tuple[int, ...]] = []
    lock = threading.Lock()

    def run_batch(requests):
        with lock:
            batches.append(tuple(r.params.seed for r in requests))
        time.sleep(JITTER.random() * 0.004)
        return [r.params.seed for r in requests]

    queue = BatchQueue(run_batch, max_batch=3)  # smaller than the workers: a lockstep round runs in several batches

    def job(j: int, _run: int) -> SimpleNamespace:  # as run_policy's run_one: one episode's replies
        answers = []
        for turn in range(turns_by_job[j]):
            time.sleep(JITTER.random() * 0.004)  # a command's run time, different every run
            answers.append(queue.submit(Request([j], SimpleNamespace(seed=1000 * j + turn))))
        return SimpleNamespace(answers=answers, invalid="", damage="")

    jobs = [(j, 0) for j in range(len(turns_by_job))]
    episodes = run_episodes(jobs, workers, job, desc="lockstep", lockstep=queue)
    answers = [episode.answers for episode in episodes]
    assert answers == [[1000 * j + t for t in range(n)] for j, n in enumerate(turns_by_job)]  # each its own answer
    return batches


def test_lockstep_batches_are_the_same_whatever_the_timing():
    # Jobs with no request (episodes that end before sampling) too, first of all: a worker thread that ends its job
    # at once must still be there for the next round, or the others would wait for it forever.
    turns_by_job = [0, 0, 3, 1, 4, 1, 5, 0, 2, 6, 5, 3]
    first = _batches_of_one_run(4, turns_by_job)
    for _ in range(5):
        assert _batches_of_one_run(4, turns_by_job) == first
    assert all(list(batch) == sorted(batch) for batch in first)  # seed order, not arrival order
    assert max(len(batch) for batch in first) == 3 and sum(map(len, first)) == sum(turns_by_job)


@pytest.mark.sandbox
def test_an_eval_samples_the_same_bits_whatever_the_timing(rootfs, tmp_path, monkeypatch):
    """The base model's held-out eval, 4 episodes at a time, twice, with every reply's request delayed at random."""
    original = policies.sample_reply

    def late(runtime, tokens, params):
        time.sleep(JITTER.random() * 0.05)
        return original(runtime, tokens, params)

    monkeypatch.setattr(policies, "sample_reply", late)
    job = compose_job(
        "policy=model",
        "tasks.families=[file-move,json-sum,log-errors]",
        "tasks.heldout_per_family=2",
        "eval.n_runs=2",
        "eval.concurrency=4",
        "sampling.max_tokens=24",
        "agent.max_turns=3",
        f"tasks.cache_dir={tmp_path / 'cache' / 'tasks'}",
    )
    runs = []
    for attempt in range(2):
        seen = {}

        def recording(*args, **kwargs):
            episodes = original_run_policy(*args, **kwargs)
            seen["queue"] = args[5].queue
            seen["sampled"] = [
                (ep.task.name, ep.run, [(t.offset, t.tokens, t.logprobs) for t in ep.sampled.turns]) for ep in episodes
            ]
            return episodes

        original_run_policy = eval_stage.run_policy
        monkeypatch.setattr(eval_stage, "run_policy", recording)
        eval_stage.evaluate_checkpoint(job, tmp_path / f"eval-{attempt}", "", label="base", quiet=True)
        monkeypatch.setattr(eval_stage, "run_policy", original_run_policy)
        assert seen["queue"].requests > seen["queue"].batches, "no batch held two requests: nothing was shown"
        runs.append(seen["sampled"])
    assert runs[0] == runs[1]  # every token and every logprob, bit for bit
