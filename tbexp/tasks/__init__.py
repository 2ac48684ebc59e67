"""Task sets: the built-in suite or a directory of Harbor tasks, chosen by the `tasks` config node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tbexp.tasks.harbor_task import Task, TaskError, load_task, load_tasks

__all__ = ["Task", "TaskError", "load_task", "load_tasks", "load_task_set"]


def load_task_set(settings: Any, split: str | None = None, part: str | None = None) -> list[Task]:
    """The tasks `settings` names; `split` overrides `settings.split` for the built-in suite.

    `part` divides the built-in train split when `settings.rl_share` > 0: "rl" is that share of each
    family's tasks (seeded), kept for RL; "sft" is the rest, whose solutions SFT trains on.
    """
    if settings.source == "builtin":
        from tbexp.tasks.builtin import write_suite

        name = f"builtin-seed{settings.seed}-{settings.train_per_family}x{settings.heldout_per_family}"
        root = write_suite(Path(settings.cache_dir) / name, settings.seed, settings.train_per_family, settings.heldout_per_family)
        tasks = load_tasks(root / (split or settings.split))
    else:
        tasks = load_tasks(settings.path)
    if part and settings.rl_share > 0 and settings.source == "builtin" and (split or settings.split) == "train":
        rl = _rl_part(tasks, settings.rl_share, settings.seed)
        tasks = [t for t in tasks if (t.name in rl) == (part == "rl")]
    if settings.families:
        unknown = set(settings.families) - {t.family for t in tasks}
        if unknown:
            raise TaskError(f"tasks.families: no tasks of {sorted(unknown)}; have {sorted({t.family for t in tasks})}")
        tasks = [t for t in tasks if t.family in settings.families]
    if settings.limit:
        tasks = tasks[: settings.limit]
    return tasks


def _rl_part(tasks: list[Task], share: float, seed: int) -> set[str]:
    """`share` of each family's tasks, chosen by a seeded hash of the name: stable as the suite grows."""
    import zlib
    from collections import defaultdict

    families: dict[str, list[Task]] = defaultdict(list)
    for t in tasks:
        families[t.family].append(t)
    chosen: set[str] = set()
    for members in families.values():
        members.sort(key=lambda t: zlib.crc32(f"{seed}/{t.name}".encode()))
        chosen.update(t.name for t in members[: round(share * len(members))])
    return chosen
