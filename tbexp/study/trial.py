"""A job's side of an Optuna trial: report held-out values, stop when the pruner says so.

Under `hydra/sweeper=tbexp_optuna` the sweeper adds `trial.number=N
trial.study=S trial.storage=URL trial.pruning_metric=M` to each job's
overrides (`tbexp.config.TrialConfig`), so a job on any process or SLURM node
reaches its trial through the study's storage. Outside a sweep
(`trial.number=-1`) `report` does nothing, so stages call it unconditionally:

    trial.report(cfg, "eval/nll", nll, step, higher_is_better=False)

Only the sweep's pruning metric is reported; a pipeline job whose SFT and
GRPO both call `report` therefore feeds the pruner one series. Values are
stored in the study's direction (NLL negated in a maximised study) because
Optuna's pruners compare intermediate values in that direction.

When the pruner says stop, the job marks the trial PRUNED itself (the storage
is the one place every process agrees on) and `report` raises
`TrialPruned`, which the entry point turns into a normal end of the job.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

log = logging.getLogger(__name__)


class TrialPruned(Exception):
    """The study stopped this trial: the pruner said so, or the trial was already finished elsewhere."""


def report(cfg: Any, metric: str, value: float, step: int, higher_is_better: bool = True) -> None:
    """Report `metric` at `step` to this job's trial; raise TrialPruned if the trial should stop."""
    settings = cfg.get("trial") if hasattr(cfg, "get") else None
    if settings is None or settings.number < 0 or metric != settings.pruning_metric:
        return
    if math.isnan(value):  # an eval with no valid episode says nothing about the trial; the pruner is not told
        log.warning(
            "trial %s: %s is NaN at step %d (no valid episode); not reported to the pruner",
            settings.number,
            metric,
            step,
        )
        return
    import optuna
    from optuna.exceptions import UpdateFinishedTrialError

    from tbexp.redaction import register_resolver

    register_resolver()  # a storage URL with a password comes as `${tbexp_secret:…}`, whatever app this job runs
    study, trial = _trial(settings.storage, settings.study, settings.number)
    maximised = study.direction == optuna.study.StudyDirection.MAXIMIZE
    stored = float(value) if higher_is_better == maximised else -float(value)
    try:
        trial.report(stored, step)
        should_prune = trial.should_prune()
    except UpdateFinishedTrialError:
        # A restarted sweeper failed this trial as orphaned (and queued a retry): this run is no longer wanted.
        raise TrialPruned(
            f"trial {settings.number} of study {settings.study!r} was already finished; stopping this orphaned job"
        ) from None
    if should_prune:
        from tbexp.study.storage import PRUNED_AT_ATTR

        trial.set_user_attr(PRUNED_AT_ATTR, step)
        study.tell(settings.number, state=optuna.trial.TrialState.PRUNED)
        raise TrialPruned(f"trial {settings.number} pruned at step {step} ({metric}={value:.4g})")


@functools.cache
def _trial(storage: str, study_name: str, number: int) -> tuple[Any, Any]:
    """The study and a live Trial handle, opened once per job (opening a storage costs a connection)."""
    import optuna

    from tbexp.study.storage import load_study

    study = load_study(storage, study_name, create_tables=False)
    trial_id = study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
    return study, optuna.trial.Trial(study, trial_id)
