"""Decontamination: which collected tasks overlap the tasks a model is scored on, so their rows are dropped.

A collected task overlaps a reference task (the held-out set, the eval set, any task directory a user names) when:
* **id**: they have the same name;
* **instruction**: their instructions are the same after normalising (lower case, words only);
* **n-gram**: their instructions share a run of `n` words (13 by default, the n-gram length GPT-3's and later
  decontamination reports use), normalised the same way;
* **tests**: a file under `tests/` has the same bytes in both.

Text that several reference tasks share is their set's boilerplate, not one task's content: an n-gram found in
more than one reference task's instruction, and a test file found in more than one reference task (a common
`test.sh`), count for nothing. A reference with one task of a kind gets no such allowance: its whole text counts.

Two tasks of one family (task.toml's `[metadata] family`, set on both) are instances of one template: the
built-in suite's held-out instances of train families share up to 97% of their instruction's words with a train
instance (measured: 43 of the default job's 200 train tasks are covered >= 80% by 13-grams of one held-out task),
differing in the instance's values (directories, file and field names, data). That is what a held-out instance
of a seen family is for, so between tasks of one family the n-gram check gives way to the instance checks
(same id, same instruction, same test file bytes). Tasks of different families, or without one, get all four.
Simplified: so a near-copy of a held-out instance *within its family* with one value changed is not caught.

A task is never compared with itself (the same directory): with `tasks.source=dir` every split is the one
directory, and training on it is the user's choice, reported (`same_directory`) rather than dropped.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_NGRAM = 13
_WORD = re.compile(r"[a-z0-9_]+")


@dataclass(frozen=True)
class Overlap:
    task: str  # the collected task
    reference: str  # the task it overlaps
    why: str  # id | instruction | ngram | tests
    evidence: str  # the shared n-gram or file

    def row(self) -> dict[str, str]:
        return {"task": self.task, "reference": self.reference, "why": self.why, "evidence": self.evidence}


def words(text: str) -> list[str]:
    """
    >>> words("Write the SUM of `price` to /app/sum.txt.")
    ['write', 'the', 'sum', 'of', 'price', 'to', 'app', 'sum', 'txt']
    """
    return _WORD.findall(text.lower())


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


def test_files(path: Path) -> dict[str, str]:
    """{sha256 of the bytes: relative path} of each file under the task's tests/."""
    tests = path / "tests"
    files = sorted(f for f in tests.rglob("*") if f.is_file()) if tests.is_dir() else []
    return {hashlib.sha256(f.read_bytes()).hexdigest(): str(f.relative_to(path)) for f in files}


class References:
    """The reference tasks, indexed once: names, instructions, their own n-grams and test files."""

    def __init__(self, tasks: Iterable[Any], n: int = DEFAULT_NGRAM):
        self.n = n
        self.tasks = list(tasks)
        self.paths = {Path(t.path).resolve() for t in self.tasks}
        self.names = {t.name: t.name for t in self.tasks}
        self.instructions = {" ".join(words(t.instruction)): t.name for t in self.tasks}
        gram_counts: Counter[tuple[str, ...]] = Counter()
        file_counts: Counter[str] = Counter()
        per_task = []
        for t in self.tasks:
            grams, files = ngrams(t.instruction, n), test_files(Path(t.path))
            gram_counts.update(grams)
            file_counts.update(files.keys())
            per_task.append((t.name, grams, files))
        self.families = {t.name: getattr(t, "family", "") for t in self.tasks}
        self.grams = {g: name for name, grams, _ in per_task for g in grams if gram_counts[g] == 1}
        self.files = {h: (name, files[h]) for name, _, files in per_task for h in files if file_counts[h] == 1}

    def overlaps(self, task: Any) -> list[Overlap]:
        """How `task` overlaps the references; [] when it does not (or when it is one of them, by directory)."""
        if Path(task.path).resolve() in self.paths:
            return []
        found = []
        if task.name in self.names:
            found.append(Overlap(task.name, task.name, "id", task.name))
        text = " ".join(words(task.instruction))
        if text in self.instructions:
            found.append(Overlap(task.name, self.instructions[text], "instruction", text[:120]))
        family = getattr(task, "family", "")
        for gram in sorted(ngrams(task.instruction, self.n)):
            if gram in self.grams and not (family and self.families[self.grams[gram]] == family):
                found.append(Overlap(task.name, self.grams[gram], "ngram", " ".join(gram)))
                break  # one shared n-gram is enough
        for digest, rel in test_files(Path(task.path)).items():
            if digest in self.files:
                reference, theirs = self.files[digest]
                found.append(Overlap(task.name, reference, "tests", f"{rel} = {theirs}"))
                break
        return found

    def same_directory(self, tasks: Sequence[Any]) -> list[str]:
        """The collected tasks that are reference tasks themselves (not compared: tasks.source=dir)."""
        return [t.name for t in tasks if Path(t.path).resolve() in self.paths]


def decontaminate(rows: list[dict[str, Any]], tasks: Sequence[Any], references: References) -> tuple[list, list]:
    """(rows of tasks that overlap nothing, the overlaps found); a row names its task by `task`."""
    overlaps = [o for task in tasks for o in references.overlaps(task)]
    bad = {o.task for o in overlaps}
    return [row for row in rows if row["task"] not in bad], overlaps
