"""The SFT stage on the tiny model: a few real steps, resume, checkpoint choice, bad data."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tbexp.stages import sft as sft_stage
from tests.conftest import REPO, collect_oracle, compose_config, compose_job

pytestmark = pytest.mark.slow


def _sft(run_dir, monkeypatch, data, *overrides):
    run_dir.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(run_dir)
    return sft_stage.run(
        compose_job(
            "stage=sft",
            f"sft.data={data}",
            "sft.batch_size=4",
            "sft.eval_every=3",
            "sft.warmup_steps=1",
            "sft.patience=0",
            *overrides,
        )
    )


@pytest.fixture(scope="module")
def gold(tmp_path_factory, rootfs):
    """Verified oracle conversations of a dozen train tasks."""
    path = tmp_path_factory.mktemp("gold") / "gold.jsonl"
    metrics = collect_oracle(path, "tasks.limit=12")
    assert metrics["collect/kept"] == 12.0
    return path


def test_resumed_run_ends_where_an_uninterrupted_one_does(gold, tmp_path, monkeypatch):
    straight = _sft(tmp_path / "straight", monkeypatch, gold, "sft.steps=6")
    real_batch = sft_stage.epoch_batch

    def dies_at_step_4(train, step, batch_size, seed):
        if step == 4:
            raise KeyboardInterrupt  # the job is killed during step 5, after the checkpoint of step 3
        return real_batch(train, step, batch_size, seed)

    monkeypatch.setattr(sft_stage, "epoch_batch", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        _sft(tmp_path / "interrupted", monkeypatch, gold, "sft.steps=6")
    monkeypatch.setattr(sft_stage, "epoch_batch", real_batch)
    resumed = _sft(tmp_path / "interrupted", monkeypatch, gold, "sft.steps=6")
    evals = json.loads((tmp_path / "interrupted" / "sft_state.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [3, 6]  # the first three steps were not redone
    assert resumed["sft/val_nll"] == pytest.approx(straight["sft/val_nll"], rel=1e-6)


def test_the_checkpoint_before_nll_stops_improving_is_chosen(gold, tmp_path, monkeypatch):
    # A learning rate this high makes held-out NLL rise after the first evaluations.
    metrics = _sft(tmp_path, monkeypatch, gold, "sft.steps=12", "sft.learning_rate=0.05", "sft.lr_schedule=constant")
    evals = json.loads((tmp_path / "sft_state.json").read_text())["evals"]
    best = min(evals, key=lambda e: e["val_nll"])
    assert metrics["sft/chosen_step"] == best["step"]
    assert (tmp_path / "chosen_checkpoint.txt").read_text().strip() == best["checkpoint"]


def test_patience_stops_early_and_keeps_the_checkpoint_before_the_rise(gold, tmp_path, monkeypatch):
    # Held-out NLL (made up here) improves for two evaluations, then rises.
    nlls = iter([3.0, 2.0, 2.5, 2.7, 2.9, 3.1])
    monkeypatch.setattr(sft_stage, "_nll", lambda backend, val: next(nlls))
    metrics = _sft(tmp_path, monkeypatch, gold, "sft.steps=30", "sft.patience=2")
    evals = json.loads((tmp_path / "sft_state.json").read_text())["evals"]
    assert [e["step"] for e in evals] == [3, 6, 9, 12]  # two evaluations without improvement, then stop
    assert metrics["sft/chosen_step"] == 6.0


def test_stalled_counts_evaluations_since_the_best():
    evals = [{"val_nll": v} for v in (3.0, 2.0, 2.5)]
    assert not sft_stage._stalled(evals, 2) and sft_stage._stalled(evals + [{"val_nll": 2.1}], 2)
    assert not sft_stage._stalled(evals + [{"val_nll": 9.0}] * 5, 0)  # 0 = never stop early


def test_overlong_conversations_are_counted(gold, tmp_path, monkeypatch):
    from tbexp.episodes.trajectories import read_conversations
    from tbexp.models import load_model
    from tbexp.models.renderers import make_renderer

    cfg = compose_config()
    renderer = make_renderer(cfg.model.renderer, load_model(cfg.model)[1])
    lengths = sorted(len(renderer.supervised(c)[0]) for c in read_conversations(gold))
    cut = f"sft.max_length_tokens={lengths[len(lengths) // 2]}"  # about half the conversations are longer
    metrics = _sft(tmp_path, monkeypatch, gold, "sft.steps=1", "sft.val_fraction=0.5", cut)
    assert metrics["sft/dropped_overlong"] > 0
    metrics = _sft(
        tmp_path / "t", monkeypatch, gold, "sft.steps=1", "sft.val_fraction=0.5", cut, "sft.overlong=truncate"
    )
    assert metrics["sft/truncated_overlong"] > 0 and metrics["sft/dropped_overlong"] == 0


def test_replies_longer_than_the_sampler_writes_are_warned_of(gold, caplog):
    from tbexp.episodes.trajectories import read_conversations
    from tbexp.models import load_model
    from tbexp.models.renderers import make_renderer

    cfg = compose_config()
    renderer = make_renderer(cfg.model.renderer, load_model(cfg.model)[1])
    conversations = read_conversations(gold)
    lengths = sft_stage._datums(conversations, renderer, 10**6, "drop", 0.25, 0)[3]
    sft_stage._warn_of_long_replies(lengths, cfg.sampling.max_tokens)
    assert not caplog.records  # the default job's raw commands fit the default sampling.max_tokens
    sft_stage._warn_of_long_replies(lengths, 4)
    n_replies = sum(m["role"] == "assistant" for c in conversations for m in c)
    assert f"of {n_replies} replies in the data are longer than sampling.max_tokens=4" in caplog.text


@pytest.mark.parametrize(
    "content,needle",
    [
        (
            '{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ls"}]}\nnot json\n',
            ":2: not JSON",
        ),
        ("", "empty"),
        ('{"prompt": "x"}\n', ":1: a raw-command row needs"),
    ],
)
def test_bad_data_file_is_refused_with_the_line(tmp_path, content, needle):
    data = tmp_path / "bad.jsonl"
    data.write_text(content)
    out = subprocess.run(
        [sys.executable, "-m", "tbexp", "stage=sft", f"sft.data={data}", f"hydra.run.dir={tmp_path}/run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and needle in out.stderr and str(data) in out.stderr


def test_held_out_rows_only_recombine_words_seen_in_training():
    def conv(cmd):
        return [{"role": "user", "content": "do it"}, {"role": "assistant", "content": cmd}]

    rows = [conv(f"cat /app/{a}/{b}.txt") for a in ("logs", "data", "feeds") for b in ("x", "y", "z")] + [
        conv("ls /app/unique_name")
    ]
    train, val = sft_stage._split(rows, 0.3, seed=0)
    train_words = {w for c in train for w in c[1]["content"].replace("/", " ").replace(".", " ").split()}
    assert len(val) == 3 and conv("ls /app/unique_name") in train
    for c in val:
        assert set(c[1]["content"].replace("/", " ").replace(".", " ").split()) <= train_words
