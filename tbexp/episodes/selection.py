"""Rejection sampling: which of a collection's episodes become SFT rows.

From the ledger's rows (tbexp.episodes.ledger): an episode is kept only when it was verified a success:
scored (not invalid), nothing touched what the verifier reads, and either strict (every test passed and the
task's reward says so; `min_pass_fraction` = 1, the default) or, as an option, its per-test pass fraction is
at least `min_pass_fraction`. Of a task's verified episodes, identical trajectories (the same messages) are
kept once, and at most `max_per_task` (0 = all) are kept, the shortest first: fewest turns, then fewest reply
characters, then the earlier run (the efficiency the RL reward favours). Every row not kept is returned with
why, for the data card.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from typing import Any

Row = dict[str, Any]


def verified(row: Row, min_pass_fraction: float = 1.0) -> bool:
    """
    >>> v = {"strict": False, "pass_fraction": 0.5, "invalid": "", "tamper": []}
    >>> verified({"verdict": v}), verified({"verdict": v}, 0.5), verified({"verdict": {**v, "tamper": ["/tests"]}}, 0.5)
    (False, True, False)
    """
    v = row["verdict"]
    if v["invalid"] or v["tamper"]:
        return False
    return bool(v["strict"]) if min_pass_fraction >= 1.0 else v["pass_fraction"] >= min_pass_fraction


def length(row: Row) -> tuple[int, int, int]:
    """The order `max_per_task` keeps in: turns, reply characters, run."""
    replies = sum(len(m["content"]) for m in row["messages"] if m["role"] == "assistant")
    return row["turns"], replies, row["run"]


def select(rows: list[Row], min_pass_fraction: float = 1.0, max_per_task: int = 0) -> tuple[list[Row], list[Row]]:
    """(kept rows, in task then length order; dropped rows, each with a `dropped` reason)."""
    by_task: dict[str, list[Row]] = defaultdict(list)
    dropped: list[Row] = []
    for row in rows:
        if verified(row, min_pass_fraction):
            by_task[row["task"]].append(row)
        else:
            dropped.append({**row, "dropped": "not verified"})
    kept: list[Row] = []
    for task in sorted(by_task):
        seen: set[str] = set()
        mine = []
        for row in sorted(by_task[task], key=length):
            fingerprint = hashlib.sha256(json.dumps(row["messages"], sort_keys=True).encode()).hexdigest()
            if fingerprint in seen:
                dropped.append({**row, "dropped": "duplicate trajectory"})
                continue
            seen.add(fingerprint)
            mine.append(row)
        if max_per_task:
            dropped.extend({**row, "dropped": f"over max_per_task={max_per_task}"} for row in mine[max_per_task:])
            mine = mine[:max_per_task]
        kept.extend(mine)
    return kept, dropped
