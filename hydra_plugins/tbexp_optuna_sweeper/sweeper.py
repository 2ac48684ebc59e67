"""The Hydra plugin class; the sweep itself is in `_study_loop` (imported only when a sweep runs)."""

from __future__ import annotations

from typing import Any, List

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class TbexpOptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:
        # One DictConfig of TbexpOptunaSweeperConf's fields, typed by the schema the sweep file was checked against.
        self.settings = OmegaConf.create({k: v for k, v in settings.items()})
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None
        self.launcher = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: List[str]) -> Any:
        from ._study_loop import run_sweep

        return run_sweep(self, list(arguments))
