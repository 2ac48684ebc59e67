"""Create or load the study a sweep file names, with its sampler and pruner, and leave notes for the jobs.

The sampler's seed is offset by the trials the study already has, so a
restarted sweep does not draw the same random points again. The pruner's
settings, the objective and the pruning metric go into the study's user
attributes: Optuna does not store a pruner, and each job rebuilds the same
one from there (tbexp.study.trial); the report reads the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tbexp.study.storage import (
    OBJECTIVE_ATTR,
    PRUNER_ATTR,
    PRUNING_METRIC_ATTR,
    SWEEP_DIR_ATTR,
    make_pruner,
    open_storage,
)


class SweepError(Exception):
    """The sweep cannot go on (a bad setting, a config that does not compose); the message says why."""


def open_study(settings: Any, storage_url: str, sweep_dir: Path, pruning_metric: str) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep logs each trial itself, with its job directory
    direction = settings.objective.direction
    if direction not in ("maximize", "minimize"):
        raise SweepError(f"hydra.sweeper.objective.direction={direction!r}: choose maximize or minimize")
    study = optuna.create_study(
        study_name=settings.study_name, storage=open_storage(storage_url), direction=direction, load_if_exists=True
    )
    if study.direction.name.lower() != direction:
        raise SweepError(
            f"study {settings.study_name!r} in {storage_url} exists with direction {study.direction.name.lower()}; the sweep says {direction}. Rename the study or fix the direction"
        )
    pruner = OmegaConf.to_container(settings.pruner)
    study.sampler = _sampler(settings.sampler, settings.sampler.seed + len(study.get_trials(deepcopy=False)))
    study.pruner = make_pruner(pruner)
    for key, value in (
        (PRUNER_ATTR, pruner),
        (OBJECTIVE_ATTR, settings.objective.metric),
        (PRUNING_METRIC_ATTR, pruning_metric),
        (SWEEP_DIR_ATTR, str(sweep_dir)),
    ):
        study.set_user_attr(key, value)
    return study


def _sampler(settings: Any, seed: int) -> Any:
    import optuna

    if settings.name == "tpe":
        # A bound that moves (`above`) drops out of multivariate TPE's joint model and is sampled on its own.
        return optuna.samplers.TPESampler(
            seed=seed,
            n_startup_trials=settings.n_startup_trials,
            multivariate=settings.multivariate,
            constant_liar=settings.constant_liar,
        )
    if settings.name in ("random", "grid"):  # grid: the points are queued trials; the sampler only orders the rest
        return optuna.samplers.RandomSampler(seed=seed)
    raise SweepError(f"hydra.sweeper.sampler.name={settings.name!r}: choose tpe, random or grid")
