"""What a training loop does at step n, as pure functions of (settings, seed, step).

Keeping the data order and the learning rate functions of the step alone is
what makes resuming exact: a run restarted at step n sees the batches and the
rates an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import random
from typing import Any, TypeVar

from tbexp.seeds import stream

T = TypeVar("T")


def epoch_batch(items: list[T], step: int, batch_size: int, seed: int) -> list[T]:
    """Items for `step`: consecutive slices of per-epoch shuffles of `items`.

    >>> epoch_batch(list("abc"), 0, 2, seed=0) + epoch_batch(list("abc"), 1, 2, seed=0)[:1] == sorted("abc")
    True
    """
    rows = []
    for index in range(step * batch_size, (step + 1) * batch_size):
        epoch, position = divmod(index, len(items))
        order = list(range(len(items)))
        random.Random(stream(seed, "epoch", epoch)).shuffle(order)
        rows.append(items[order[position]])
    return rows


def learning_rate(s: Any, step: int) -> float:
    """`s.learning_rate` after `s.warmup_steps` of linear warmup, then `s.lr_schedule` over `s.steps`."""
    if step < s.warmup_steps:
        return s.learning_rate * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    if s.lr_schedule == "cosine":
        return s.learning_rate * 0.5 * (1 + math.cos(math.pi * progress))
    if s.lr_schedule == "linear":
        return s.learning_rate * (1 - progress)
    return s.learning_rate
