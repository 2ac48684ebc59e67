"""The sweeper's search space, in memory: kinds of parameters, the lower < upper constraint, grids, overrides."""

from __future__ import annotations

import math

import optuna
import pytest

from hydra_plugins.tbexp_optuna_sweeper._space import SearchSpace, SearchSpaceError, override_value, overrides

BOUNDS = {
    "task_filter.lower": {"type": "float", "low": 0.0, "high": 0.5},
    "task_filter.upper": {"type": "float", "low": 0.3, "high": 1.0, "above": "task_filter.lower", "gap": 0.1},
}


def _sample(space: SearchSpace, sampler, n: int) -> list[dict]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=sampler)
    values = []
    for _ in range(n):
        trial = study.ask()
        v = space.suggest(trial)
        values.append(v)
        study.tell(trial, v.get("task_filter.upper", 0.0) - v.get("task_filter.lower", 0.0))
    return values


@pytest.mark.parametrize(
    "sampler",
    [
        optuna.samplers.RandomSampler(seed=1),
        optuna.samplers.TPESampler(seed=1, n_startup_trials=5, multivariate=True, constant_liar=True),
    ],
    ids=["random", "tpe"],
)
def test_upper_bound_is_always_sampled_above_the_lower(sampler):
    for v in _sample(SearchSpace(BOUNDS), sampler, 60):
        lower, upper = v["task_filter.lower"], v["task_filter.upper"]
        assert 0.0 <= lower <= 0.5 and 0.3 <= upper <= 1.0
        assert upper >= lower + 0.1 - 1e-12, v


def test_parameter_kinds_log_int_categorical():
    space = SearchSpace(
        {
            "lr": {"type": "float", "low": 1e-5, "high": 1e-2, "log": True},
            "model.lora_rank": {"type": "int", "low": 4, "high": 64, "log": True},
            "grpo.group_size": {"type": "categorical", "choices": [4, 8, 16]},
        }
    )
    values = _sample(space, optuna.samplers.RandomSampler(seed=0), 40)
    assert all(1e-5 <= v["lr"] <= 1e-2 for v in values)
    assert all(isinstance(v["model.lora_rank"], int) and 4 <= v["model.lora_rank"] <= 64 for v in values)
    assert {v["grpo.group_size"] for v in values} <= {4, 8, 16}
    # log-uniform: about as many draws below the geometric midpoint (~3.2e-4) as above it
    below = sum(v["lr"] < math.sqrt(1e-5 * 1e-2) for v in values)
    assert 8 <= below <= 32


def test_int_and_stepped_float_bounds_stay_ordered_and_on_their_grid():
    space = SearchSpace(
        {
            "lo": {"type": "int", "low": 1, "high": 5},
            "hi": {"type": "int", "low": 2, "high": 6, "above": "lo"},
            "a": {"type": "float", "low": 0.0, "high": 0.6, "step": 0.2},
            "b": {"type": "float", "low": 0.2, "high": 1.0, "step": 0.2, "above": "a"},
        }
    )
    for v in _sample(space, optuna.samplers.RandomSampler(seed=3), 60):
        assert v["hi"] > v["lo"]
        assert v["b"] > v["a"] + 1e-9
        assert abs(v["b"] / 0.2 - round(v["b"] / 0.2)) < 1e-6


def test_grid_holds_only_feasible_pairs_in_a_seeded_order():
    space = SearchSpace(
        {
            "lo": {"type": "float", "low": 0.0, "high": 0.6, "step": 0.3},
            "hi": {"type": "float", "low": 0.3, "high": 0.9, "step": 0.3, "above": "lo"},
            "rank": {"type": "categorical", "choices": [8, 16]},
        }
    )
    grid = space.grid(seed=0)
    pairs = {(p["lo"], p["hi"]) for p in grid}
    assert pairs == {(0.0, 0.3), (0.0, 0.6), (0.0, 0.9), (0.3, 0.6), (0.3, 0.9), (0.6, 0.9)}
    assert len(grid) == 12
    assert grid == space.grid(seed=0) and grid != space.grid(seed=1)


@pytest.mark.parametrize(
    "params,message",
    [
        (
            {
                "a": {"type": "float", "low": 0.0, "high": 0.5},
                "b": {"type": "float", "low": 0.0, "high": 0.5, "above": "a"},
            },
            "leaves no value above a",
        ),
        ({"b": {"type": "float", "low": 0.0, "high": 1.0, "above": "nope"}}, "no such parameter"),
        (
            {
                "a": {"type": "float", "low": 0, "high": 1, "above": "b"},
                "b": {"type": "float", "low": 0, "high": 1, "above": "a"},
            },
            "round in a circle",
        ),
        ({"lr": {"type": "float", "low": 0.0, "high": 1.0, "log": True}}, "log scale needs low > 0"),
        ({"r": {"type": "int", "low": 1.5, "high": 4}}, "integer low"),
        ({"c": {"type": "categorical"}}, "choices"),
        ({"c": {"type": "gaussian", "low": 0, "high": 1}}, "choose float, int or categorical"),
        ({}, "at least one parameter"),
    ],
)
def test_bad_search_spaces_are_refused_naming_the_parameter(params, message):
    with pytest.raises(SearchSpaceError, match=message):
        SearchSpace(params)


def test_continuous_float_needs_a_grid_for_the_grid_sampler():
    with pytest.raises(SearchSpaceError, match="params.lr"):
        SearchSpace({"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}}).grid(0)
    assert SearchSpace({"lr": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True, "grid": [1e-4, 1e-3]}}).grid(0)


def test_overrides_are_valid_hydra_syntax():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    values = {
        "lr": 1e-05,
        "model.lora_rank": 16,
        "flag": True,
        "name": "eval/reward",
        "url": "sqlite:////tmp/it's.db",
        "targets": ["q_proj", "v_proj"],
        "none": None,
    }
    parsed = OverridesParser.create().parse_overrides(overrides(values))
    assert [o.value() for o in parsed] == [
        1e-05,
        16,
        True,
        "eval/reward",
        "sqlite:////tmp/it's.db",
        ["q_proj", "v_proj"],
        None,
    ]
    assert override_value(0.1) == "0.1"
