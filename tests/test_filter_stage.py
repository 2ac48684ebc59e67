"""The solve-rate filter: rates with intervals, the kept set, the cache, and refused bounds."""

from __future__ import annotations

import json

import pytest

from tbexp.config import ConfigError, check
from tbexp.job import Job
from tbexp.stages import filter as filter_stage
from tests.conftest import compose_config, make_task

COIN = "from pathlib import Path\ndef test_a():\n    assert True\ndef test_b():\n    assert True\ndef test_heads():\n    assert Path('/app/coin.txt').read_text().strip() == '1'\n"


@pytest.fixture
def candidates(tmp_path, rootfs):
    """Three tasks the oracle solves always, about half the time, and never."""
    root = tmp_path / "tasks"
    make_task(root, "always")
    make_task(root, "coin", solution="echo $((RANDOM % 2)) > /app/coin.txt\n", tests=COIN)
    make_task(root, "never", solution="echo nope > /app/out.txt\n")
    return root


def _filter(tmp_path, monkeypatch, candidates, *overrides):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    monkeypatch.chdir(run)
    cfg = compose_config(
        "stage=filter",
        "tasks=dir",
        f"tasks.path={candidates}",
        f"tasks.cache_dir={tmp_path}/cache/tasks",
        "task_filter.k=16",
        *overrides,
    )
    check(cfg)
    return filter_stage.run(Job(cfg)), json.loads((run / "kept_tasks.json").read_text())


def test_keeps_the_tasks_between_the_bounds_and_caches_the_rates(tmp_path, monkeypatch, candidates):
    metrics, kept = _filter(tmp_path, monkeypatch, candidates, "task_filter.lower=0.1", "task_filter.upper=0.9")
    assert kept["rates"]["test/always"] == 1.0 and kept["rates"]["test/never"] == 0.0
    assert 0.0 < kept["rates"]["test/coin"] < 1.0  # 16 fair coins all alike: p = 2**-15
    assert kept["kept"] == ["test/coin"] and metrics["filter/kept"] == 1.0

    def no_sampling(*args, **kwargs):
        raise AssertionError("resampled although the inputs were cached")

    monkeypatch.setattr(filter_stage, "run_policy", no_sampling)
    _, again = _filter(tmp_path, monkeypatch, candidates, "task_filter.lower=0.0", "task_filter.upper=0.95")
    assert again["rates"] == kept["rates"] and set(again["kept"]) == {"test/coin", "test/never"}


def test_none_keeps_everything_without_sampling(tmp_path, monkeypatch, candidates):
    monkeypatch.setattr(filter_stage, "run_policy", lambda *a, **k: pytest.fail("task_filter=none must not sample"))
    metrics, kept = _filter(tmp_path, monkeypatch, candidates, "task_filter=none")
    assert metrics["filter/kept"] == 3.0


def test_wilson_interval_brackets_the_rate():
    lo, hi = filter_stage.wilson_interval(4, 8)
    assert lo < 0.5 < hi and filter_stage.wilson_interval(0, 8)[0] == 0.0


def test_small_k_warns(caplog):
    with caplog.at_level("WARNING"):
        filter_stage._warn_if_k_too_small(8, 0.1)
    assert "no success 43%" in caplog.text


@pytest.mark.parametrize(
    "overrides", [["task_filter.lower=0.5", "task_filter.upper=0.5"], ["task_filter.lower=-0.1"], ["task_filter.k=0"]]
)
def test_bad_bounds_are_refused_at_compose_time(overrides):
    with pytest.raises(ConfigError):
        check(compose_config("stage=filter", *overrides))


def test_an_unknown_split_is_refused_by_the_schema():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose_config("stage=filter", "task_filter.split=dev")
    assert "train, heldout" in str(err.value.__cause__)
