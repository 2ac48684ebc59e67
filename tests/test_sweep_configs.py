"""Every sweep file composes (with `+sweep=NAME`, read from sweeps/ through conf/sweep), its search space is
valid, and every parameter it searches is a real key of the composed config; a job outside a sweep reports
nothing."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hydra_plugins.tbexp_optuna_sweeper._space import SearchSpace
from tbexp.config import check
from tests.conftest import CONF, REPO

SWEEPS = sorted(p.stem for p in (REPO / "sweeps").glob("*.yaml"))


def compose_with_hydra(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_the_shipped_sweeps_are_there_and_conf_sweep_points_at_them():
    assert {"smoke", "grpo_optuna"} <= set(SWEEPS)
    assert (CONF / "sweep").resolve() == (REPO / "sweeps").resolve()


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_starts_with_its_command_and_is_global(name):
    lines = (REPO / "sweeps" / f"{name}.yaml").read_text().splitlines()
    assert lines[0] == "# @package _global_"
    assert lines[1].startswith("# python -m tbexp -m ") and f"+sweep={name}" in lines[1]


@pytest.mark.parametrize("name", SWEEPS)
def test_every_sweep_composes_with_a_valid_space_over_real_keys(name):
    experiment = [
        f"+experiment={e}" for e in ("grpo",) if name.startswith(e) and (CONF / "experiment" / f"{e}.yaml").exists()
    ]
    cfg = compose_with_hydra(*experiment, f"+sweep={name}")
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("TbexpOptunaSweeper") and sweeper.study_name == name
    assert cfg.hydra.sweep.dir == f"multirun/{name}"
    space = SearchSpace(sweeper.params)
    missing = [key for key in space.params if OmegaConf.select(cfg, key, default="<missing>") == "<missing>"]
    assert not missing, f"{name} searches keys the config does not have: {missing}"
    job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    check(job)


def test_grpo_sweep_samples_the_upper_solve_rate_bound_above_the_lower():
    space = SearchSpace(compose_with_hydra("+sweep=grpo_optuna").hydra.sweeper.params)
    assert space.params["task_filter.upper"].above == "task_filter.lower"
    assert {
        "grpo.learning_rate",
        "model.lora_rank",
        "grpo.group_size",
        "task_filter.lower",
        "task_filter.upper",
    } == set(space.params)


def test_grpo_sweep_prunes_at_the_rungs_and_never_at_the_last_eval_of_the_default_pipeline():
    import random

    import optuna

    from tbexp.study.storage import make_pruner

    cfg = compose_with_hydra("+sweep=grpo_optuna")
    pruner = make_pruner(OmegaConf.to_container(cfg.hydra.sweeper.pruner))
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner)
    evals = [*range(0, cfg.grpo.steps, cfg.grpo.eval_every), cfg.grpo.steps]  # GRPO's held-out evals: 0, 4, 8, 12
    study = optuna.create_study(direction="maximize", pruner=pruner)
    rng, pruned_at = random.Random(0), []
    for _ in range(16):
        trial, quality = study.ask(), rng.random()
        for step in evals:
            trial.report(quality * step, step)
            if trial.should_prune():
                pruned_at.append(step)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                break
        else:
            study.tell(trial, quality)
    assert set(pruned_at) == {4, 8}, pruned_at  # the rungs (min_resource x 2^k), and not the last eval at 12
    assert len(study.get_trials(states=[optuna.trial.TrialState.COMPLETE])) >= 2


def test_successive_halving_is_built_from_its_fields_and_a_misspelt_pruner_is_named():
    from tbexp.study.storage import make_pruner

    pruner = make_pruner({"name": "successive_halving", "min_resource": 3, "reduction_factor": 4})
    assert (pruner._min_resource, pruner._reduction_factor) == (3, 4)
    with pytest.raises(ValueError, match="successive_halving"):
        make_pruner({"name": "succesive_halving"})


def test_smoke_sweep_prunes_on_sft_held_out_nll_and_maximises_held_out_reward():
    cfg = compose_with_hydra("+sweep=smoke")
    s = cfg.hydra.sweeper
    assert (s.objective.metric, s.objective.direction, s.pruner.name, s.pruner.metric) == (
        "eval/reward",
        "maximize",
        "median",
        "eval/nll",
    )
    assert cfg.stage.name == "sft" and cfg.sft.eval_after and cfg.sft.eval_every < cfg.sft.steps


def test_misspelt_sweeper_key_names_the_key():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose_with_hydra("+sweep=smoke", "hydra.sweeper.n_trail=3")
    assert "n_trail" in str(err.value.__cause__ or err.value)


def test_report_outside_a_sweep_does_nothing():
    from tbexp.study import trial

    cfg = compose_with_hydra()
    assert cfg.trial.number == -1
    trial.report(cfg, "eval/nll", 1.0, step=1, higher_is_better=False)  # no study, no storage: returns at once
