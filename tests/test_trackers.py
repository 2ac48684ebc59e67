"""logger=wandb (offline) and logger=trackio on a real eval run, read back from the files they write."""

from __future__ import annotations

import json
import os
import sqlite3
import struct
import subprocess
import sys
from pathlib import Path

from tbexp.jobs.tracking import Tracker
from tests.conftest import REPO, compose_config

SECRET = "hunter2"
# Places a secret can sit in a composed config: a URL with credentials in it (the Tinker base URL, a study
# storage). The other sinks and secret-named keys (api_key, token...): tests/test_redaction.py.
WITH_SECRETS = [
    "backend=tinker",  # base_url is a Tinker option; the oracle's eval never calls the service
    f"backend.base_url=https://me:{SECRET}@tinker.example/v1",
    f"trial.storage=postgresql://tb:{SECRET}@127.0.0.1/optuna",
]


def _eval(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))
    }  # offline unless a test says so
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tbexp",
            "stage=eval",
            "policy=oracle",
            "tasks.limit=2",
            "eval.n_runs=1",
            f"hydra.run.dir={run_dir}",
            *WITH_SECRETS,
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**base, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_wandb_offline_run_holds_group_job_type_redacted_config_metrics_and_table(rootfs, tmp_path):
    _eval(tmp_path, "logger=wandb", "trial.study=my-study")
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one W&B run per job"
    records = list(wandb_records(runs[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_group == "my-study" and run.job_type == "eval"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["backend"]["base_url"] == "https://<redacted>@tinker.example/v1"
    assert config["trial"]["storage"] == "postgresql://<redacted>@127.0.0.1/optuna"
    assert config["sampling"]["max_tokens"] == 96  # a count, not a token
    assert SECRET.encode() not in runs[0].read_bytes()
    history = {
        ".".join(item.nested_key) or item.key: item.value_json
        for r in records
        if r.WhichOneof("record_type") == "history"
        for item in r.history.item
    }
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert float(history["eval/strict_success"]) == summary["eval/strict_success"] == 1.0
    assert {"eval/reward", "eval/pass@1", "eval/valid_command_rate", "eval/avg_turns"} <= set(history)
    assert json.loads(history["eval/per_task._type"]) == "table-file"
    table = json.loads(
        next((runs[0].parent / "files" / "media" / "table").glob("eval/per_task_*.table.json")).read_text()
    )
    assert len(table["data"]) == 2 and "task" in table["columns"]


def test_trackio_logs_to_a_local_database(rootfs, tmp_path):
    _eval(tmp_path / "run", "logger=trackio", f"logger.dir={tmp_path / 'trackio'}", "logger.project=tbexp-test")
    db = sqlite3.connect(tmp_path / "trackio" / "tbexp-test.db")
    rows = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM metrics")]
    (config,) = [json.loads(c) for (c,) in db.execute("SELECT config FROM configs")]
    assert any(r.get("eval/strict_success") == 1.0 for r in rows)
    assert any(r.get("eval/per_task", {}).get("_type") == "trackio.table" for r in rows)
    assert config["job_type"] == "eval" and config["_Group"] == "eval"  # no sweep, no experiment: the stage
    assert (
        SECRET not in json.dumps(config)
        and SECRET.encode() not in (tmp_path / "trackio" / "tbexp-test.db").read_bytes()
    )


def test_none_logger_writes_only_metrics_jsonl_and_rewind_drops_redone_steps(tmp_path):
    tracker = Tracker(tmp_path, compose_config().logger)
    for step in range(1, 6):
        tracker.log({"train/nll": 1.0 / step}, step=step)
    tracker.log({"base/eval/reward": 0.5}, step=0)
    tracker.log_table("eval/per_task", [{"task": "a"}])
    tracker.log_checkpoint("/x", 5)
    tracker.rewind(3, ("train/",))  # a killed run resumes from its step-3 checkpoint
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/nll" in r] == [1, 2, 3] and any("base/eval/reward" in r for r in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def wandb_records(path: Path):
    """The protobuf records of an offline `.wandb` file (LevelDB log format: 32 KiB blocks of CRC, length, type, data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""  # after the 7-byte file header
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_note_result_puts_the_jobs_numbers_in_its_run_summary(monkeypatch):
    """The W&B sweep report reads each run's objective from its summary; the pipeline logs its rows under other names."""
    from tbexp.jobs import tracking

    noted = []

    class Run:
        def note(self, values):
            noted.append(values)

    tracking.note_result({"eval/reward": 0.5})  # no run: nothing to do, no error
    monkeypatch.setattr(tracking, "_active", Run())
    tracking.note_result({"eval/reward": 0.5, "grpo/steps_run": 12, "grpo/checkpoint": "/x/step-00012"})
    assert noted == [{"eval/reward": 0.5, "grpo/steps_run": 12}]
