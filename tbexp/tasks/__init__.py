"""Task sets: the built-in suite or a directory of Harbor tasks, chosen by the `tasks` config node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tbexp.tasks.harbor_task import Task, TaskError, load_task, load_tasks

__all__ = ["Task", "TaskError", "load_task", "load_tasks", "load_task_set"]


def load_task_set(settings: Any, split: str | None = None) -> list[Task]:
    """The tasks `settings` names; `split` overrides `settings.split` for the built-in suite."""
    if settings.source == "builtin":
        from tbexp.tasks.builtin import write_suite

        name = f"builtin-seed{settings.seed}-{settings.train_per_family}x{settings.heldout_per_family}"
        root = write_suite(Path(settings.cache_dir) / name, settings.seed, settings.train_per_family, settings.heldout_per_family)
        tasks = load_tasks(root / (split or settings.split))
    else:
        tasks = load_tasks(settings.path)
    if settings.families:
        unknown = set(settings.families) - {t.family for t in tasks}
        if unknown:
            raise TaskError(f"tasks.families: no tasks of {sorted(unknown)}; have {sorted({t.family for t in tasks})}")
        tasks = [t for t in tasks if t.family in settings.families]
    if settings.limit:
        tasks = tasks[: settings.limit]
    return tasks
