"""Named random streams: every seed tbexp derives from the run's `seed` comes from here, by name.

`stream(seed, name, index)` is `seed * scale + offset + index` for the name's (scale, offset) in STREAMS.
The pairs are the ones the code used before the streams had names (`seed * 7919 + 17` for evals, and so
on), so a run keeps every number it had. What each stream seeds:

* `eval`: every reply's draw in the held-out evals whose rows a run reports (base, SFT, final): checkpoints
  compared on the same draws (common random numbers), so a difference between them is the weights', not
  the dice's; n runs of a task still differ (the policy mixes in task, run and turn).
* `grpo_eval`: GRPO's own held-out evals; not `eval`'s draws, so the checkpoint is chosen on one sample of
  the held-out episodes and reported on another, and the choice does not flatter the report.
* `filter`: the filter's samples of each candidate task, so its solve rates are reproducible.
* `rollout`: GRPO step `index`'s rollouts (index = step), so a resumed run samples what an uninterrupted one would.
* `epoch`: the shuffle of epoch `index` of a training loop's items (SFT conversations, GRPO tasks).
* `spares`: the order in which step `index` replaces groups whose rewards do not spread (`grpo.max_replaced_groups`).
* `candidates`: which `task_filter.max_tasks` candidates the filter samples.
* `val_split`: which SFT conversations are held out for NLL.
* `process`: Python's global `random`, seeded once by the entry point (nothing in tbexp draws from it).

Simplified: streams are integers, not independent generators, so two streams can meet (`rollout` and `epoch`
share a scale: step k's rollouts and epoch k's shuffle get the same integer). They seed different generators
(the sampler's per-reply seeds and a Python shuffle), so nothing is drawn twice from one sequence.
"""

from __future__ import annotations

STREAMS: dict[str, tuple[int, int]] = {  # name -> (scale, offset)
    "eval": (7919, 17),
    "grpo_eval": (7919, 18),
    "filter": (7919, 29),
    "rollout": (1_000_003, 0),
    "epoch": (1_000_003, 0),
    "spares": (1_000_003, 7919),
    "candidates": (1, 0),
    "val_split": (1, 0),
    "process": (1, 0),
}


def stream(seed: int, name: str, index: int = 0) -> int:
    """The integer seed of stream `name` (its `index`-th member: a step, an epoch) in a run seeded `seed`.

    >>> stream(0, "eval"), stream(2, "eval"), stream(1, "rollout", 3)
    (17, 15855, 1000006)
    """
    if name not in STREAMS:
        raise KeyError(f"no random stream {name!r}: choose one of {sorted(STREAMS)}")
    scale, offset = STREAMS[name]
    return seed * scale + offset + index
