"""stage=collect with policy=teacher: real sandboxes and verifier, rejection sampling, and a collection killed with
SIGKILL that resumes where it stopped.

The teacher here is tests/teacher_server.py, a scripted STAND-IN endpoint: whether an episode succeeds must be
known in advance to check what rejection sampling keeps, and a served model's choices cannot be. It answers
raw_command turns by each episode's seed (the one TeacherPolicy sends: crc32(f"{seed}/{task}/{run}") + turn):
(its first seed) % 3 == 0 writes the wrong word (fails its tests), 1 solves in one command, 2 runs `ls` first and then
solves (a longer success). The endpoint a collection really runs against, `python -m tbexp.serve`, is driven
in test_collect_served.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter

import pytest

from tests.conftest import REPO, compose_job, make_task
from tests.teacher_server import ScriptedTeacher

N_TASKS, N_RUNS, SEED = 3, 4, 0


def _first_seed(task: str, run: int) -> int:
    return zlib.crc32(f"{SEED}/{task}/{run}".encode()) % 2**31


def _kind(task: str, run: int) -> int:
    return _first_seed(task, run) % 3


def _answer(messages, body) -> str:
    turn = len(messages) // 2
    kind = (body["seed"] - turn) % 3
    script = {0: ["echo nope > /app/out.txt"], 1: ["echo done > /app/out.txt"], 2: ["ls", "echo done > /app/out.txt"]}
    commands = script[kind]
    return commands[turn] if turn < len(commands) else "exit"


def _slow_answer(messages, body) -> str:
    time.sleep(0.4)  # so that a kill finds episodes in flight
    return _answer(messages, body)


@pytest.fixture
def task_dir(tmp_path):
    root = tmp_path / "tasks"
    for i in range(N_TASKS):
        make_task(root, name=f"t{i}")
    return root


def _overrides(task_dir, url, data, *more):
    return [
        "stage=collect",
        "policy=teacher",
        "tasks.source=dir",
        f"tasks.path={task_dir}",
        f"collect.n_runs={N_RUNS}",
        "collect.concurrency=3",
        f"collect.teacher_url={url}",
        "collect.teacher_model=scripted",
        "collect.teacher_backoff_s=0.01",
        f"collect.data={data}",
        "sandbox.command_timeout_s=10",
        *more,
    ]


def _expected():
    """{task: kinds of its runs}: which runs succeed, and how long each success is."""
    return {f"test/t{i}": [_kind(f"test/t{i}", r) for r in range(N_RUNS)] for i in range(N_TASKS)}


@pytest.mark.sandbox
def test_only_verified_distinct_shortest_successes_are_kept(rootfs, task_dir, tmp_path, monkeypatch):
    from tbexp.stages import collect

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    with ScriptedTeacher(_answer, faults=["429", "garbage"]) as teacher:  # a hosted API's hiccups, retried
        metrics = collect.run(compose_job(*_overrides(task_dir, teacher.url, data, "collect.max_per_task=1")))
    expected = _expected()
    successes = {task: [k for k in kinds if k] for task, kinds in expected.items()}
    assert metrics["collect/episodes"] == N_TASKS * N_RUNS
    assert metrics["collect/verified"] == sum(len(s) for s in successes.values())
    assert metrics["collect/teacher_retries"] == 2
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # one row per task that had a success (max_per_task=1), the shorter kind (1: one command) when there was one
    assert sorted(row["task"] for row in rows) == sorted(task for task, s in successes.items() if s)
    for row in rows:
        assert row["turns"] == min(successes[row["task"]]) + 1  # its commands and `exit`
        assert row["verdict"]["strict"] and row["verdict"]["passed"] == row["verdict"]["tests"] == 3
        assert row["teacher"].startswith("openai/scripted@http://127.0.0.1")
        assert row["sandbox"].startswith("bwrap") and row["tokens"]["calls"] == row["turns"]
        assert row["tokens"]["completion"] > 0
    # the card beside the data: counts, the teacher's solve rate per task, lengths in the model's tokens, drops
    card = json.loads((tmp_path / "data.card.json").read_text())
    assert card["rows"] == len(rows) and sum(card["per_family"].values()) == len(rows)
    assert list(card["per_teacher"]) == [rows[0]["teacher"]] and card["per_source"] == {"teacher": len(rows)}
    assert card["solve_rate"] == {task: len(s) / N_RUNS for task, s in successes.items()}
    assert card["length_unit"] == "tiny tokens" and card["lengths"]["min"] > 0
    assert sum(card["dropped"].values()) == N_TASKS * N_RUNS - len(rows)
    assert card["dropped"]["not verified"] == N_TASKS * N_RUNS - metrics["collect/verified"]
    assert (tmp_path / "data.lengths.png").read_bytes()[:4] == b"\x89PNG"
    assert "solve rate" in (tmp_path / "data.card.md").read_text()
    # the same ledger, written as chat rows: nothing runs again (every episode is entered), only the format changes
    job = compose_job(*_overrides(task_dir, "http://127.0.0.1:9/v1", data, "collect.max_per_task=1"))
    client = collect.TeacherClient(collect.teacher_settings(job.cfg.collect, job.cfg.sampling, 0))
    again = collect.collect(job, job.tasks("sft"), "teacher", data, client, "chat").metrics
    assert again["collect/resumed_episodes"] == N_TASKS * N_RUNS and not client.usage  # no call made
    chat = [json.loads(line) for line in data.read_text().splitlines()]
    assert [list(row) for row in chat] == [["messages"]] * len(rows)
    assert [row["messages"] for row in chat] == [row["messages"] for row in rows]
    # identical successful trajectories of a task count once: without the cap, one row per distinct length
    ledger = [json.loads(line) for line in (tmp_path / "data.ledger.jsonl").read_text().splitlines()[1:]]
    kept, dropped = collect.select(ledger, 1.0, 0)
    assert len(kept) == sum(len(set(s)) for s in successes.values())
    assert Counter(d["dropped"] for d in dropped)["duplicate trajectory"] == sum(
        len(s) - len(set(s)) for s in successes.values()
    )


@pytest.mark.sandbox
def test_a_killed_collection_resumes_and_runs_no_entered_episode_again(rootfs, task_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    ledger = tmp_path / "data.ledger.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first_turns: Counter[int] = Counter()  # first-turn seeds the teacher saw: one per episode started

    def counting(messages, body):
        if len(messages) == 1:
            first_turns[body["seed"]] += 1
        return _slow_answer(messages, body)

    with ScriptedTeacher(counting) as teacher:
        args = [
            sys.executable,
            "-m",
            "tbexp",
            *_overrides(task_dir, teacher.url, data),
            f"hydra.run.dir={tmp_path}/run",
        ]
        process = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            if ledger.exists() and len(ledger.read_text().splitlines()) >= 1 + 4:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the collection ended before it could be killed"
        process.send_signal(signal.SIGKILL)  # as a pre-empted job dies: no handler runs
        process.wait()
        entered = {(r["task"], r["run"]) for r in map(json.loads, ledger.read_text().splitlines()[1:])}
        assert 4 <= len(entered) < N_TASKS * N_RUNS
        resumed = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in ledger.read_text().splitlines()[1:]]
    assert sorted((r["task"], r["run"]) for r in rows) == sorted(
        (f"test/t{i}", r) for i in range(N_TASKS) for r in range(N_RUNS)
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["collect/resumed_episodes"] >= len(entered)
    for task, run in entered:  # an episode in the ledger was never started again
        assert first_turns[_first_seed(task, run)] == 1
    assert summary["collect/verified"] == sum(1 for kinds in _expected().values() for k in kinds if k)
