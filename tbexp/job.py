"""One job's shared parts, built once per process by the entry point and handed to every stage.

A stage reads its own settings from `job.cfg` but never copies the config to
pass a result on: results travel as values (each stage module defines its
result type), and what all stages share lives here:

* `run_dir` and `cache_dir`: where the job writes, and the root of the result
  caches (`<cache_dir>/{tasks,trajectories,sft,evals,filter}`). `cache_dir` is the
  config's top-level key; a `tasks.cache_dir` set on its own (older commands)
  still moves the result caches beside it.
* `tasks(name)`: the named task sets `sft` (the train split's SFT part), `rl`
  (the filter's candidates) and `heldout` (what evals score), each loaded once.
* `agent`, `sandbox_settings` (every episode's fresh sandbox is built from them),
  `reward` and `tracker(folder)`.
* `models`: the `ModelHost`, which loads the base weights once and hands out
  trainers (a fresh training run on them) and samplers over a checkpoint (no
  optimizer; on Tinker a sampling client). `models.loads` counts weight loads.

Simplified: one trainer at a time. On `backend=local` every trainer is the one
loaded model with its trainable weights reset, so a second trainer ends the
first (samplers already handed out keep their weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tbexp.tracking import Tracker, run_dir

if TYPE_CHECKING:  # the backends import torch and tinker: not needed to compose or print a config
    from tbexp.backends.base import Sampler, TrainingBackend

TASK_SETS = ("sft", "rl", "heldout")


@dataclass
class Job:
    cfg: Any
    run_dir: Path = field(default_factory=run_dir)

    @cached_property
    def cache_dir(self) -> Path:
        root = Path(self.cfg.cache_dir)
        tasks = Path(self.cfg.tasks.cache_dir)
        return root if tasks == root / "tasks" else tasks.parent

    def tasks(self, name: str) -> list:
        """The task set `name` (one of TASK_SETS), loaded on first use."""
        if name not in self._task_sets:
            from tbexp.tasks import load_task_set

            c = self.cfg
            where = {"sft": (c.collect.split, "sft"), "rl": (c.task_filter.split, "rl"), "heldout": (None, None)}
            if name not in where:
                raise KeyError(f"no task set {name!r}: choose one of {TASK_SETS}")
            split, part = where[name]
            self._task_sets[name] = load_task_set(c.tasks, split=split, part=part)
        return self._task_sets[name]

    @cached_property
    def _task_sets(self) -> dict[str, list]:
        return {}

    @cached_property
    def agent(self) -> Any:
        from tbexp.agents.base import make_agent

        return make_agent(self.cfg.agent)

    @property
    def sandbox_settings(self) -> Any:
        return self.cfg.sandbox

    @property
    def reward(self) -> Any:
        return self.cfg.reward

    def tracker(self, folder: Path) -> Tracker:
        return Tracker(folder, self.cfg.logger)

    @cached_property
    def models(self) -> ModelHost:
        return ModelHost(self.cfg)


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A training stage's result: the checkpoint it chose and its numbers. In summaries (summary.json, the
    pipeline's state file) the checkpoint stands among the numbers under KEY, as it always has."""

    KEY: ClassVar[str] = "checkpoint"
    checkpoint: str
    metrics: dict[str, float]

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, self.KEY: self.checkpoint}

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> TrainedCheckpoint:
        return cls(summary[cls.KEY], {k: v for k, v in summary.items() if k != cls.KEY})


class ModelHost:
    """The base model, loaded once per job; trainers and samplers over it."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.loads = 0  # how many times base weights were loaded (one per distinct set of weights is the aim)
        self._engine: Any = None  # backend=local: the one loaded model
        self._service: Any = None  # backend=tinker: the one service connection

    def runtime(self, sampler: Sampler, settings: Any, seed: int | None) -> Any:
        """What model-policy episodes share: `sampler`, the renderer, `settings` (a sampling node), seeds from `seed`."""
        from tbexp.build import model_runtime

        return model_runtime(self.cfg, sampler, settings, seed)

    def trainer(self, save_dir: Path, start: str = "", logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
        """A training run on the base model from `start`'s weights ("" = fresh adapters), with a fresh optimizer."""
        if self.cfg.backend.name == "local":
            engine = self._local()
            engine.restart(save_dir, logit_scale_lr_factor)
        else:
            engine = self._tinker_trainer()
        if start:
            engine.load_weights(start)
        return engine

    def sampler(self, checkpoint: str = "") -> Sampler:
        """A sampler over `checkpoint`'s weights ("" = the base model's); it needs no optimizer."""
        if self.cfg.backend.name == "local":
            return self._local().checkpoint_sampler(checkpoint)
        from tbexp.backends.tinker_backend import sampling_client

        return sampling_client(self._tinker_service(), self.cfg.model.path or self.cfg.model.name, checkpoint)

    def _local(self):
        if self._engine is None:
            from tbexp.build import make_backend

            self._engine = make_backend(self.cfg, self.cfg.cache_dir)  # save_dir is set by each trainer
            self.loads += 1
        return self._engine

    def _tinker_service(self) -> Any:
        if self._service is None:
            from tbexp.backends.tinker_backend import _connect

            self._service = _connect(self.cfg.backend.base_url)
        return self._service

    def _tinker_trainer(self) -> TrainingBackend:
        from tbexp.build import make_backend

        self.loads += 1  # a new LoRA training client: the service loads the base model for it
        return make_backend(self.cfg, Path("."), service_client=self._tinker_service())
