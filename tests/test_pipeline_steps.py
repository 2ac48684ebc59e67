"""The pipeline's typed steps (tbexp.stages.pipeline.Steps) without sandboxes or a model: each step's result is kept
as it finishes and rebuilt, typed, by a re-run, which redoes nothing; a state file of older code resumes; a
Selection carries its tasks. The whole recipe on a miniature runs in tests/test_pipeline_stage.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tbexp.stages import pipeline
from tbexp.stages.collect import Trajectories
from tbexp.stages.eval import ROW_METRICS, Scores
from tbexp.stages.filter import NoTasksKept, Selection
from tbexp.stages.grpo import RLResult
from tbexp.stages.sft import SFTResult
from tests.conftest import compose_job

CANDIDATES = [SimpleNamespace(name=name) for name in ("t/a", "t/b", "t/c")]
ROW = {**dict.fromkeys(ROW_METRICS, 0.5), "eval/pass@1_stderr": 0.1}


class Fakes:
    """Each step of the recipe, counting its calls and returning what the real one returns, typed."""

    def __init__(self, kept: list[str]):
        self.calls: list[str] = []
        self.kept = kept

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(pipeline, "_oracle_turns", self.oracle_turns)
        monkeypatch.setattr(pipeline, "_sft", self.sft)
        monkeypatch.setattr(pipeline, "_held_out", self.held_out)
        monkeypatch.setattr(pipeline, "select_for_rl", self.select_for_rl)
        monkeypatch.setattr(pipeline, "_rl", self.rl)

    def oracle_turns(self, job) -> Trajectories:
        self.calls.append("collect")
        return Trajectories(job.run_dir / "turns.jsonl", {})

    def sft(self, job, data: Trajectories) -> SFTResult:
        self.calls.append(f"sft on {data.path.name}")
        return SFTResult("sft-checkpoint", {"sft/val_nll": 1.0})

    def held_out(self, job, row: str, checkpoint: str) -> Scores:
        self.calls.append(f"{row} of {checkpoint or 'base'}")
        return Scores({**ROW, "eval/reward": {"base": 0.1, "sft": 0.2, "rl": 0.3}[row]})

    def select_for_rl(self, job, out: Path, checkpoint: str) -> Selection:
        self.calls.append(f"filter of {checkpoint}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "kept_tasks.json").write_text(json.dumps({"kept": self.kept, "rates": {}}))
        metrics = {"filter/candidates": 3.0, "filter/kept": float(len(self.kept))}
        return Selection(out / "kept_tasks.json", self.kept, metrics, [t for t in CANDIDATES if t.name in self.kept])

    def rl(self, job, start: str, tasks: list) -> RLResult:
        self.calls.append(f"grpo from {start} on {[t.name for t in tasks]}")
        return RLResult("rl-checkpoint", {"grpo/best_step": 2.0})


@pytest.fixture
def job(tmp_path, monkeypatch):
    made = compose_job("stage=pipeline", "pipeline.stages=[collect,sft,filter,grpo,eval]")
    made.run_dir = tmp_path
    monkeypatch.setattr(made, "tasks", lambda name: CANDIDATES)
    return made


def test_a_rerun_rebuilds_each_typed_result_and_redoes_nothing(job, monkeypatch):
    first = Fakes(kept=["t/b", "t/c"])
    first.install(monkeypatch)
    value = pipeline.run(job)
    assert first.calls == [
        "collect",
        "sft on turns.jsonl",
        "base of base",
        "sft of sft-checkpoint",
        "filter of sft-checkpoint",
        "grpo from sft-checkpoint on ['t/b', 't/c']",
        "rl of rl-checkpoint",
    ]
    assert value["eval/reward"] == 0.3
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert set(summary) == {"base", "sft", "rl", "collect", "sft_training", "filter", "grpo", "promotion"}
    assert summary["filter"]["filter/kept_tasks"] == str(job.run_dir / "filter" / "kept_tasks.json")

    again = Fakes(kept=[])
    again.install(monkeypatch)
    assert pipeline.run(job) == value and again.calls == []
    assert json.loads((job.run_dir / "summary.json").read_text()) == summary


def test_a_filter_that_keeps_nothing_ends_the_job_after_reporting_the_rows_done(job, monkeypatch):
    Fakes(kept=[]).install(monkeypatch)
    with pytest.raises(NoTasksKept, match=r"no RL tasks kept \(solve rate in \[0.1, 0.8\] of 3 candidates rated\)"):
        pipeline.run(job)
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert set(summary) == {"base", "sft", "collect", "sft_training", "filter", "promotion"}
    assert "| sft |" in (job.run_dir / "table.md").read_text()


def test_a_state_file_of_older_code_resumes(job, monkeypatch):
    """pipeline_state.json as the dict-valued parts wrote it before the steps were typed."""
    (job.run_dir / "filter").mkdir()
    (job.run_dir / "filter" / "kept_tasks.json").write_text(json.dumps({"kept": ["t/a"], "rates": {"t/a": 0.5}}))
    state = {
        "collect": {"collect/data": "/cache/trajectories/oracle.jsonl"},
        "sft_training": {"sft/val_nll": 1.0, "sft/checkpoint": "/cache/sft/k/step-00010", "sft/adapter": "/a"},
        "base": ROW,
        "sft_eval": ROW,
        "filter": {
            "filter/candidates": 3.0,
            "filter/kept": 1.0,
            "filter/kept_tasks": str(job.run_dir / "filter" / "kept_tasks.json"),
        },
    }
    (job.run_dir / "pipeline_state.json").write_text(json.dumps(state))
    fakes = Fakes(kept=[])
    fakes.install(monkeypatch)
    pipeline.run(job)
    assert fakes.calls == ["grpo from /cache/sft/k/step-00010 on ['t/a']", "rl of rl-checkpoint"]


def test_steps_keep_each_result_as_its_summary_and_restore_it_typed(tmp_path):
    steps = pipeline.Steps(tmp_path / "state.json")
    made = steps.run("sft_training", SFTResult.from_summary, SFTResult, "ckpt", {"sft/val_nll": 2.0}, {"adapter": "/a"})
    assert json.loads((tmp_path / "state.json").read_text())["sft_training"] == made.summary()
    restored = pipeline.Steps(tmp_path / "state.json").run("sft_training", SFTResult.from_summary, pytest.fail, "")
    assert isinstance(restored, SFTResult) and restored == made
    assert "sft_training" in steps and "grpo" not in steps


def test_a_selection_rebuilt_from_its_summary_carries_its_tasks_among_the_candidates(tmp_path):
    (tmp_path / "kept_tasks.json").write_text(json.dumps({"kept": ["t/c", "t/a"], "rates": {}}))
    summary = {"filter/kept": 2.0, "filter/candidates": 3.0, "filter/kept_tasks": str(tmp_path / "kept_tasks.json")}
    selection = Selection.from_summary(summary, CANDIDATES)
    assert [t.name for t in selection.tasks] == ["t/a", "t/c"]  # in the candidates' order, as GRPO takes them
    assert selection.summary() == summary
