"""Task sets: the built-in suite or a directory of Harbor tasks, chosen by the `tasks` config node.

A task of a directory that cannot be loaded is listed (`TaskSet.unloadable`, its reason logged once) and the
rest of the set runs; `tasks.strict=true` makes any such task fatal. A set with no loadable task is an error.
`tasks.manifest` (a check.json, tbexp.stages.check) keeps only the tasks it calls usable; the others are listed in
`TaskSet.excluded` with why.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tbexp.tasks.harbor_task import Task, TaskError, TaskSet, TaskStep, load_task, load_tasks

__all__ = ["Task", "TaskError", "TaskSet", "TaskStep", "load_task", "load_task_set", "load_tasks"]

log = logging.getLogger(__name__)
_reported: set[tuple[str, str]] = set()  # (task dir, reason) already logged: a set is loaded once per stage


def load_task_set(settings: Any, split: str | None = None, part: str | None = None) -> TaskSet:
    """The tasks `settings` names; `split` overrides `settings.split` for the built-in suite.

    `part` divides the built-in train split when `settings.rl_share` > 0: "rl" is that share of each
    family's tasks (seeded), kept for RL; "sft" is the rest, whose solutions SFT trains on.
    Terminal-Bench 1 directories are converted under `<cache>/migrated/` (cache = the parent of `tasks.cache_dir`).
    """
    migrated_dir = Path(settings.cache_dir).parent / "migrated"
    if settings.source == "builtin":
        from tbexp.tasks.builtin import write_suite

        name = f"builtin-seed{settings.seed}-{settings.train_per_family}x{settings.heldout_per_family}"
        root = write_suite(
            Path(settings.cache_dir) / name, settings.seed, settings.train_per_family, settings.heldout_per_family
        )
        tasks = load_tasks(root / (split or settings.split), migrated_dir)
    else:
        tasks = load_tasks(settings.path, migrated_dir)
    unloadable = _check_unloadable(tasks.unloadable, settings)
    if part and settings.rl_share > 0 and settings.source == "builtin" and (split or settings.split) == "train":
        rl = _rl_part(tasks, settings.rl_share, settings.seed)
        tasks = [t for t in tasks if (t.name in rl) == (part == "rl")]
    if settings.families:
        unknown = set(settings.families) - {t.family for t in tasks}
        if unknown:
            raise TaskError(f"tasks.families: no tasks of {sorted(unknown)}; have {sorted({t.family for t in tasks})}")
        tasks = [t for t in tasks if t.family in settings.families]
    excluded = {}
    if getattr(settings, "manifest", ""):
        tasks, excluded = _usable(tasks, Path(settings.manifest))
    if settings.limit:
        tasks = tasks[: settings.limit]
    return TaskSet(tasks, unloadable, excluded)


def _usable(tasks: list[Task], manifest: Path) -> tuple[list[Task], dict[str, str]]:
    """The tasks a check.json (tbexp.stages.check) calls usable; {task: why not} for the others."""
    try:
        rows = json.loads(manifest.read_text())["tasks"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise TaskError(f"tasks.manifest={manifest}: not a check.json that stage=check wrote: {err}") from err
    by_path = {str(Path(row.get("path", "")).resolve()): row for row in rows.values()}
    kept, excluded = [], {}
    for task in tasks:
        row = by_path.get(str(Path(task.path).resolve()))
        if row is None:
            excluded[task.name] = f"not in {manifest} (checked before the task was added: run stage=check again)"
        elif not row.get("usable"):
            excluded[task.name] = row.get("why") or row.get("problem") or "not usable"
        else:
            kept.append(task)
    return kept, excluded


def _check_unloadable(unloadable: dict[str, str], settings: Any) -> dict[str, str]:
    """Log each unloadable task once; with `tasks.strict`, refuse the set."""
    if unloadable and getattr(settings, "strict", False):
        listing = "\n".join(f"  {reason}" for reason in unloadable.values())
        raise TaskError(f"tasks.strict=true and {len(unloadable)} task(s) cannot be loaded:\n{listing}")
    for task_dir, reason in unloadable.items():
        if (task_dir, reason) not in _reported:
            _reported.add((task_dir, reason))
            log.warning("task %s cannot be loaded, skipped: %s", task_dir, reason)
    return unloadable


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
