"""Decontamination: planted overlaps with held-out tasks are caught and their rows dropped; the default job's data
(the built-in train tasks against the built-in held-out tasks) has none."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tbexp.tasks import load_task
from tbexp.tasks.decontamination import References, decontaminate, words
from tests.conftest import compose_job, make_task

HELD_OUT = (
    "The service under /srv/ledger keeps a write-ahead journal; replay every committed transaction in order, "
    "skip the aborted ones, and write the final balance of each account to /app/balances.txt sorted by name.\n"
)


@pytest.fixture
def held_out(tmp_path):
    """Two held-out tasks of their own family."""
    root = tmp_path / "heldout"
    make_task(root, "journal")
    (root / "journal" / "instruction.md").write_text(HELD_OUT)
    make_task(root, "other", tests="def test_other():\n    assert True\n")
    (root / "other" / "instruction.md").write_text("Compress /app/logs into /app/logs.tar.gz.\n")
    _family(root / "journal", "journal")
    return root


def _family(task: Path, family: str) -> None:
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace('family = "demo"', f'family = "{family}"'))


def _train(tmp_path, name: str, instruction: str, family: str = "chores", tests: str | None = None):
    root = tmp_path / "train"
    make_task(root, name, tests=tests or f"def test_{name.replace('-', '_')}():\n    assert True\n")
    (root / name / "instruction.md").write_text(instruction)
    _family(root / name, family)
    return load_task(root / name)


def _references(held_out):
    return References([load_task(p) for p in sorted(held_out.iterdir())], n=13)


def test_a_planted_instruction_ngram_is_caught_and_its_rows_dropped(held_out, tmp_path):
    planted = "Before anything else: " + " ".join(words(HELD_OUT)[3:16]) + ". Then print ok."  # 13 of its words
    clean = "Count the lines of /app/data.txt and write the number to /app/n.txt.\n"
    tasks = [_train(tmp_path, "planted", planted), _train(tmp_path, "clean", clean)]
    rows = [{"task": "test/planted", "run": 0}, {"task": "test/clean", "run": 0}, {"task": "test/planted", "run": 1}]
    kept, overlaps = decontaminate(rows, tasks, _references(held_out))
    assert kept == [{"task": "test/clean", "run": 0}]
    assert [(o.task, o.reference, o.why) for o in overlaps] == [("test/planted", "test/journal", "ngram")]
    assert len(overlaps[0].evidence.split()) == 13


def test_twelve_shared_words_are_not_a_13_gram(held_out, tmp_path):
    near = "Before anything else: " + " ".join(words(HELD_OUT)[3:15]) + " and then stop."  # 12 of its words
    assert _references(held_out).overlaps(_train(tmp_path, "near", near)) == []


def test_same_id_same_instruction_and_same_test_file_are_each_caught(held_out, tmp_path):
    refs = _references(held_out)
    same_id = tmp_path / "copy" / "journal"
    shutil.copytree(held_out / "journal", same_id)
    (same_id / "instruction.md").write_text("Something else entirely.\n")
    (same_id / "tests" / "test_outputs.py").write_text("def test_x():\n    assert 1\n")
    assert [o.why for o in refs.overlaps(load_task(same_id))] == ["id"]
    # the same instruction in another family, reworded only in case and punctuation
    same_text = _train(tmp_path, "retitled", HELD_OUT.upper().replace(";", ","), family="journal-copy")
    assert "instruction" in [o.why for o in refs.overlaps(same_text)]
    same_tests = _train(
        tmp_path,
        "tests-copy",
        "Do a different thing.\n",
        tests=(held_out / "other" / "tests" / "test_outputs.py").read_text(),
    )
    assert [o.why for o in refs.overlaps(same_tests)] == ["tests"]


def test_a_task_is_not_compared_with_itself(held_out):
    refs = _references(held_out)
    task = load_task(held_out / "journal")
    assert refs.overlaps(task) == [] and refs.same_directory([task]) == ["test/journal"]


def test_the_default_jobs_data_overlaps_no_held_out_task():
    """The default job collects on the built-in train tasks and evaluates on the built-in held-out ones."""
    from tbexp.stages.collect import reference_tasks

    job = compose_job()
    train = list(job.tasks("sft"))
    references = References(reference_tasks(job), job.cfg.collect.decontaminate_ngram)
    assert len(train) == 200 and len(references.tasks) == 48
    assert [o for task in train for o in references.overlaps(task)] == []
    # the same check catches a held-out instance copied into the train set
    copy = load_task(references.tasks[0].path)
    assert references.same_directory([copy]) and not references.overlaps(copy)  # itself: not compared


def test_named_task_directories_join_the_references(held_out):
    from tbexp.stages.collect import reference_tasks

    names = [t.name for t in reference_tasks(compose_job(f"collect.decontaminate_dirs=[{held_out}]"))]
    assert len(names) == 48 + 2 and names[-2:] == ["test/journal", "test/other"]
