"""The schema of `hydra/sweeper=tbexp_optuna`, registered in Hydra's ConfigStore.

A sweep file (`sweeps/NAME.yaml`, selected with `+sweep=NAME`) chooses the
values under `hydra.sweeper`; a misspelt key or a wrong type fails at
composition and names the key, like every other tbexp config group.

No `from __future__ import annotations` here: Hydra's plugin scan executes
this module before it is in sys.modules, and dataclasses then cannot resolve
string annotations.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ParamConf:
    """One dimension of the search space; its name is the config key it overrides (`model.lora_rank`)."""

    type: str = "float"  # float | int | categorical
    low: Optional[float] = None  # float, int: inclusive bounds
    high: Optional[float] = None
    log: bool = False  # float, int: sample the logarithm uniformly
    step: Optional[float] = None  # float, int: spacing of the values; None = continuous (float) or 1 (int)
    choices: Optional[List[Any]] = None  # categorical: the values
    above: Optional[str] = None  # another parameter this one must exceed: sampled after it, from just above its value
    gap: float = 0.0  # with `above`: the least distance between the two (int: at least 1)
    grid: Optional[List[Any]] = None  # sampler=grid: the values to try; default the choices, or low..high by step


@dataclass
class ObjectiveConf:
    metric: str = "eval/reward"  # what each job returns (tbexp: a key of the stage's metrics)
    direction: str = "maximize"  # maximize | minimize


@dataclass
class SamplerConf:
    name: str = "tpe"  # tpe | random | grid
    seed: int = 0  # a resumed study adds its trial count, so a restart does not replay the same draws
    n_startup_trials: int = 10  # tpe: random trials before the model takes over
    multivariate: bool = True  # tpe: model the parameters jointly (lr and LoRA rank interact)
    constant_liar: bool = True  # tpe: count running trials as bad, so trials started together spread out


@dataclass
class PrunerConf:
    name: str = "none"  # none | median | successive_halving | hyperband
    metric: str = (
        ""  # the intermediate metric jobs report ("eval/nll" in SFT, "eval/reward" in GRPO); "" = objective.metric
    )
    n_startup_trials: int = 5  # median: finished trials before any is pruned
    n_warmup_steps: int = 0  # median: no pruning before this step
    interval_steps: int = 1  # median: check every this many steps
    min_resource: int = 1  # successive_halving, hyperband: steps every trial gets (the first rung)
    max_resource: int = 0  # hyperband: steps of a full trial; 0 = Optuna's "auto" (the first finished trials' length)
    reduction_factor: int = (
        3  # successive_halving, hyperband: at each rung (min_resource x factor^k steps) 1 trial in this many goes on
    )


@dataclass
class TbexpOptunaSweeperConf:
    _target_: str = "hydra_plugins.tbexp_optuna_sweeper.sweeper.TbexpOptunaSweeper"
    study_name: str = "tbexp"
    storage: str = "sqlite:///multirun/optuna.db"  # SQLAlchemy URL or journal file path (tbexp.study.storage); relative to the launch directory
    objective: ObjectiveConf = field(default_factory=ObjectiveConf)
    sampler: SamplerConf = field(default_factory=SamplerConf)
    pruner: PrunerConf = field(default_factory=PrunerConf)
    n_trials: int = 20  # for the whole study, across restarts; trials failed because their sweeper died do not count
    n_jobs: int = 2  # trials running at once; the next starts as soon as one ends
    params: Dict[str, ParamConf] = field(default_factory=dict)
    trial_key: str = "trial"  # config node through which a job learns its trial (tbexp.config.TrialConfig); "" = none
    trial_timeout_s: float = (
        0.0  # basic launcher: kill a trial's job after this and mark it FAIL; 0 = never (submitit: timeout_min)
    )
    heartbeat_s: float = 30.0  # how often the sweeper marks its running trials alive in the storage
    stale_after_s: float = (
        300.0  # a RUNNING trial of a sweeper on another host that has been silent this long is failed
    )


ConfigStore.instance().store(group="hydra/sweeper", name="tbexp_optuna", node=TbexpOptunaSweeperConf, provider="tbexp")
