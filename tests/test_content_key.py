"""The result caches' one content key, the named random streams and the job's cache root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tbexp import content_key as ck
from tbexp.caches import filter_key
from tbexp.seeds import STREAMS, stream
from tests.conftest import REPO, compose_config, compose_job

# The filter's key of two small task directories, as the stage computes it; run here and in a fresh process.
FILTER_KEY = """
import sys
from pathlib import Path
from types import SimpleNamespace
from tbexp.config import register
from tbexp.caches import filter_key
from tests.conftest import compose_config
register()
root, overrides = Path(sys.argv[1]), sys.argv[2:]
tasks = [SimpleNamespace(name=p.name, path=p) for p in sorted(root.iterdir())]
cfg = compose_config(*overrides)
print(filter_key(cfg, tasks, "model", "", cfg.sampling))
"""


@pytest.fixture
def tasks(tmp_path):
    found = []
    for name in ("a", "b"):
        (tmp_path / "tasks" / name).mkdir(parents=True)
        (tmp_path / "tasks" / name / "instruction.md").write_text(f"task {name}\n")
        found.append(SimpleNamespace(name=name, path=tmp_path / "tasks" / name))
    return found


def _filter_key(tasks, *overrides: str) -> str:
    cfg = compose_config(*overrides)
    return filter_key(cfg, tasks, "model", "", cfg.sampling)


@pytest.mark.parametrize(
    "override",
    [
        "seed=1",  # the filter's samples are seeded by it
        "sandbox.command_timeout_s=5",  # the sandbox's limits decide what a command can do
        "sandbox.memory_mb=256",
        "task_filter.k=4",
        "sampling.temperature=0.2",
        "agent.max_turns=2",
        "backend.packing=false",
    ],
)
def test_what_decides_the_filter_result_changes_its_key(tasks, override):
    assert _filter_key(tasks, override) != _filter_key(tasks)


@pytest.mark.parametrize("override", ["eval.concurrency=1", "backend.threads=2", "task_filter.lower=0.3"])
def test_what_does_not_decide_the_rates_leaves_the_key(tasks, override):
    assert _filter_key(tasks, override) == _filter_key(tasks)  # the bounds pick from the cached rates


def test_a_task_directory_edited_changes_the_key(tasks):
    before = _filter_key(tasks)
    (tasks[0].path / "instruction.md").write_text("another task\n")
    assert _filter_key(tasks) != before


def test_the_same_inputs_give_the_same_key_in_another_process(tmp_path, tasks):
    overrides = ["seed=3", "sandbox.pids_limit=64"]
    done = subprocess.run(
        [sys.executable, "-c", FILTER_KEY, str(tmp_path / "tasks"), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "TBEXP_CACHE": str(tmp_path / "elsewhere")},  # keys travel
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == _filter_key(tasks, *overrides)


def test_the_code_that_computes_a_result_is_part_of_its_key(tasks, monkeypatch):
    before = _filter_key(tasks)
    monkeypatch.setattr(ck, "code_fingerprint", lambda: "the code after an edit")
    assert _filter_key(tasks) != before


def test_editing_a_source_file_changes_the_fingerprint_and_a_report_module_does_not(tmp_path):
    copy = tmp_path / "tbexp"
    shutil.copytree(ck.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    first = ck.code_fingerprint(copy)
    assert first == ck.code_fingerprint.__wrapped__(ck.PACKAGE)  # a copy of the same files: the same fingerprint
    with open(copy / "study" / "report.py", "a") as f:
        f.write("# a report's edit changes no result\n")
    assert ck.code_fingerprint.__wrapped__(copy) == first
    with open(copy / "stages" / "filter.py", "a") as f:
        f.write("# an edit of the code that computes rates\n")
    assert ck.code_fingerprint.__wrapped__(copy) != first


def test_contents_are_length_prefixed():
    assert ck.content_key({}, [b"ab", b"c"]) != ck.content_key({}, [b"a", b"bc"])


@pytest.mark.parametrize("seed", [0, 1, 7, 123])
def test_named_streams_keep_the_numbers_the_code_drew_before_they_had_names(seed):
    assert stream(seed, "eval") == seed * 7919 + 17
    assert stream(seed, "grpo_eval") == seed * 7919 + 17 + 1
    assert stream(seed, "filter") == seed * 7919 + 29
    assert [stream(seed, "rollout", step) for step in range(3)] == [seed * 1_000_003 + step for step in range(3)]
    assert stream(seed, "epoch", 2) == seed * 1_000_003 + 2
    assert stream(seed, "candidates") == stream(seed, "val_split") == stream(seed, "process") == seed


def test_an_unknown_stream_is_refused_naming_the_streams():
    with pytest.raises(KeyError, match="no random stream 'evl'"):
        stream(0, "evl")
    assert "eval" in STREAMS


def test_the_jobs_cache_setting_is_the_cache_root_of_what_runs_below_the_config(tmp_path, monkeypatch):
    from tbexp.cache import cache_root
    from tbexp.tasks.migrate import default_migrated_dir

    monkeypatch.setenv("TBEXP_CACHE", str(tmp_path / "from-the-environment"))
    assert cache_root() == tmp_path / "from-the-environment"  # no job yet: the setting's default
    job = compose_job(f"cache_dir={tmp_path / 'the-jobs'}")
    assert job.cache_dir == tmp_path / "the-jobs"
    assert cache_root() == tmp_path / "the-jobs" and default_migrated_dir() == tmp_path / "the-jobs" / "migrated"
    assert compose_config().cache_dir == str(tmp_path / "from-the-environment")  # the env var stays the default
