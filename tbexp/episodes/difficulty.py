"""Online difficulty control for GRPO: which groups teach, and a solve-rate pool that retires tasks during RL.

A group teaches when its rewards spread (`group_spreads`: two or more valid
episodes whose rewards are not all equal, the rule by which
`tbexp.episodes.advantages.grpo_datums` skips a group). The GRPO stage samples
fresh groups in place of the ones that do not, up to a cap per step.

`DifficultyPool` keeps, per RL task, the strict solve rate of its rollouts so far
and how many of its groups in a row were all solved or all unsolved. A task whose
last `retire_after` groups were all one or the other is retired: later steps no
longer draw it. The offline filter (tbexp.stages.filter) chooses the starting
tasks; this pool only shrinks that set as the policy moves. Retiring never leaves
fewer than `min_active` tasks, so a step can still fill its groups.

Simplified: a retired task never comes back (a policy that forgets a solved task
is not noticed), and a group's streak counts strict success only, so a group that
is all solved but whose efficiency bonus spreads its rewards still counts
toward retirement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def group_spreads(rewards: list[float]) -> bool:
    """Whether a group's rewards give any episode a non-zero advantage.

    >>> group_spreads([1.0, 0.0]), group_spreads([0.5, 0.5]), group_spreads([1.0])
    (True, False, False)
    """
    return len(rewards) >= 2 and max(rewards) != min(rewards)


@dataclass
class TaskRecord:
    episodes: int = 0  # valid RL episodes of this task so far
    solved: int = 0  # of those, strictly solved
    streak: int = 0  # groups in a row that were all solved or all unsolved
    retired_at: int = -1  # the step after which it was retired; -1 = active

    @property
    def solve_rate(self) -> float:
        return self.solved / self.episodes if self.episodes else float("nan")


class DifficultyPool:
    """Per-task solve rates from the rollouts; `active()` is the tasks later steps draw from."""

    def __init__(self, names: list[str], retire_after: int = 0, min_active: int = 1):
        self.names = list(names)  # the order the filter kept them in: epoch shuffles index into it
        self.retire_after = retire_after
        self.min_active = min_active
        self.records = {name: TaskRecord() for name in self.names}

    def active(self) -> list[str]:
        return [n for n in self.names if self.records[n].retired_at < 0]

    @property
    def retired(self) -> int:
        return len(self.names) - len(self.active())

    def update(self, step: int, solved_by_task: dict[str, list[bool]]) -> list[str]:
        """Count one step's groups (each task's valid episodes, solved or not); return the tasks retired now.

        >>> pool = DifficultyPool(["a", "b", "c"], retire_after=2, min_active=1)
        >>> pool.update(0, {"a": [True, True], "b": [True, False]}), pool.update(1, {"a": [True, True]})
        ([], ['a'])
        >>> pool.active(), pool.records["b"].solve_rate
        (['b', 'c'], 0.5)
        """
        now = []
        for name, solved in solved_by_task.items():
            record = self.records[name]
            if not solved:
                continue  # every episode invalid: nothing learnt about the task
            record.episodes += len(solved)
            record.solved += sum(solved)
            record.streak = record.streak + 1 if all(solved) or not any(solved) else 0
            retire = self.retire_after and record.streak >= self.retire_after and record.retired_at < 0
            if retire and len(self.active()) > self.min_active:
                record.retired_at = step
                now.append(name)
        return now

    def state(self) -> dict:
        return {name: asdict(record) for name, record in self.records.items()}

    def restore(self, saved: dict) -> None:
        """Counts saved by `state()` (a resumed run); tasks no longer among the names are ignored."""
        for name, record in saved.items():
            if name in self.records:
                self.records[name] = TaskRecord(**record)
