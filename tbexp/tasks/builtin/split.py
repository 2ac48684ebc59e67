"""Choosing which pool combinations become train and which held-out instances.

All valid combinations of a family's pools are shuffled with a seeded rng.
Train takes `n_train` of them, first those that bring in a pool entry not yet
covered (so that every entry is seen in training when `n_train` allows it),
then the rest in shuffled order. Held-out takes the next `n_heldout`
combinations that are not in train and whose every entry *is* in train: a
held-out instance is a new combination of known names, never a new name. A
held-out-only family has no train split; its held-out instances are simply
the first `n_heldout` shuffled combinations.
"""

from __future__ import annotations

import itertools
import random

from tbexp.tasks.builtin.family import Combo, Family


def split_combos(family: Family, seed: int, n_train: int, n_heldout: int) -> tuple[list[Combo], list[Combo]]:
    """(train, heldout) combinations of `family`; raises ValueError when the pools are too small."""
    dims = list(family.pools)
    combos = [dict(zip(dims, values)) for values in itertools.product(*family.pools.values())]
    combos = [c for c in combos if family.allows(c)]
    random.Random(f"{seed}:{family.name}:combos").shuffle(combos)
    if family.heldout_only:
        if n_heldout > len(combos):
            raise ValueError(f"{family.name}: {n_heldout} held-out instances asked, only {len(combos)} combinations")
        return [], combos[:n_heldout]
    if n_train + n_heldout > len(combos):
        raise ValueError(f"{family.name}: {n_train}+{n_heldout} instances asked, only {len(combos)} combinations")
    train_ids = _covering_choice(combos, dims, n_train)
    train = [combos[i] for i in sorted(train_ids)]
    seen = {(d, c[d]) for c in train for d in dims}
    heldout = [c for i, c in enumerate(combos) if i not in train_ids and all((d, c[d]) in seen for d in dims)][
        :n_heldout
    ]
    if len(heldout) < n_heldout:
        raise ValueError(
            f"{family.name}: only {len(heldout)} unseen combinations of seen entries for {n_heldout} held-out "
            f"instances; ask for more train or fewer held-out instances"
        )
    return train, heldout


def _covering_choice(combos: list[Combo], dims: list[str], n: int) -> set[int]:
    """Indices of `n` combos: first the ones that add an uncovered entry, then the earliest others."""
    chosen: set[int] = set()
    covered: set[tuple] = set()
    for i, combo in enumerate(combos):
        if len(chosen) == n:
            break
        entries = {(d, combo[d]) for d in dims}
        if not entries <= covered:
            chosen.add(i)
            covered |= entries
    for i in range(len(combos)):
        if len(chosen) == n:
            break
        chosen.add(i)
    return chosen
