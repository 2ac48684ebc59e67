"""One job's shared parts, built once per process by the entry point and handed to every stage.

A stage reads its own settings from `job.cfg` but never copies the config to
pass a result on: results travel as values (each stage module defines its
result type), and what all stages share lives here:

* `run_dir` and `cache_dir`: where the job writes, and the root of the result
  caches (`<cache_dir>/{tasks,trajectories,sft,evals,filter}`). `cache_dir` is the
  config's top-level key (default `$TBEXP_CACHE`); a `tasks.cache_dir` set on its own (older commands)
  still moves the result caches beside it. It is also the process's `tbexp.cache.cache_root()`, where the
  environment builds, the verifier's provisioning and converted tasks go.
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
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

from tbexp.jobs.tracking import Tracker, run_dir

if TYPE_CHECKING:  # the backends import torch and tinker: not needed to compose or print a config
    from tbexp.agents.base import Agent
    from tbexp.backends.base import Sampler, TrainingBackend
    from tbexp.config import Config
    from tbexp.episodes.policies import ModelRuntime
    from tbexp.tasks.harbor_task import TaskSet

TASK_SETS = ("sft", "rl", "heldout")


@dataclass
class Job:
    cfg: Config  # the composed config: an OmegaConf node of this schema, read as its dataclass
    run_dir: Path = field(default_factory=run_dir)

    def __post_init__(self) -> None:
        from tbexp.cache import use_root

        use_root(self.cache_dir)  # the one source: what runs below the config (environment builds...) reads it

    @cached_property
    def cache_dir(self) -> Path:
        root = Path(self.cfg.cache_dir)
        tasks = Path(self.cfg.tasks.cache_dir)
        return root if tasks == root / "tasks" else tasks.parent

    def tasks(self, name: str) -> TaskSet:
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
    def _task_sets(self) -> dict[str, TaskSet]:
        return {}

    @cached_property
    def agent(self) -> Agent:
        from tbexp.agents.base import make_agent

        return make_agent(self.cfg.agent)

    @property
    def sandbox_settings(self) -> Any:
        return self.cfg.sandbox

    @cached_property
    def reward(self) -> Any:
        """The reward function `reward._target_` names, bound to the node's options (tbexp.episodes.rewards)."""
        from tbexp.episodes.rewards import make_reward

        return make_reward(self.cfg.reward)

    def tracker(self, folder: Path) -> Tracker:
        return Tracker(folder, self.cfg.logger)

    @cached_property
    def models(self) -> ModelHost:
        return ModelHost(self.cfg)


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A training stage's result: the checkpoint it chose, its numbers, and that checkpoint written for use
    without tbexp. In summaries (summary.json, the pipeline's state file) the checkpoint stands among the numbers
    under KEY, as it always has, and the export beside it under `<stage>/adapter` (a PEFT adapter directory) or
    `<stage>/hf_model` (full fine-tuning: the whole model in Hugging Face format)."""

    KEY: ClassVar[str] = "checkpoint"
    EXPORT_KINDS: ClassVar[tuple[str, ...]] = ("adapter", "hf_model")
    checkpoint: str
    metrics: dict[str, float]
    exported: dict[str, str] = field(default_factory=dict)  # export kind -> directory

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, self.KEY: self.checkpoint, **{self._key(k): v for k, v in self.exported.items()}}

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> Self:
        exported = {kind: summary[cls._key(kind)] for kind in cls.EXPORT_KINDS if cls._key(kind) in summary}
        export_keys = {cls._key(kind) for kind in cls.EXPORT_KINDS}
        metrics = {k: v for k, v in summary.items() if k != cls.KEY and k not in export_keys}
        return cls(summary[cls.KEY], metrics, exported)

    @classmethod
    def _key(cls, kind: str) -> str:
        stage = cls.KEY.rpartition("/")[0]
        return f"{stage}/{kind}" if stage else kind


class Host(Protocol):
    """What `backend._target_` names: a model host (tbexp.build.LocalHost, tbexp.build.TinkerHost)."""

    loads: int

    def trainer(self, save_dir: Path, logit_scale_lr_factor: float = 0.0) -> TrainingBackend: ...

    def sampler(self, checkpoint: str = "") -> Sampler: ...


class ModelHost:
    """The base model, loaded once per job; trainers and samplers over it, made by the host that `backend._target_`
    names (tbexp.build.LocalHost, tbexp.build.TinkerHost)."""

    def __init__(self, cfg: Any):
        from tbexp.build import make_host

        self.cfg = cfg
        self._host: Host = make_host(cfg)

    def probe(self) -> None:
        """A remote host checks, before any work, that it serves this job's model and the RL loss it will train with."""
        probe = getattr(self._host, "probe", None)
        if probe is None:
            return
        c = self.cfg
        if c.policy != "model" and c.stage.name not in ("sft", "grpo", "pipeline"):
            return  # the oracle, the do-nothing policy or a teacher endpoint: this job never calls the service
        rl = c.stage.name == "grpo" or (c.stage.name == "pipeline" and "grpo" in c.pipeline.stages)
        probe([c.grpo.loss_fn] if rl else [])

    @property
    def loads(self) -> int:
        """How many times base weights were loaded (one per distinct set of weights is the aim)."""
        return self._host.loads

    def runtime(self, sampler: Sampler, settings: Any, seed: int | None) -> ModelRuntime:
        """What model-policy episodes share: `sampler`, the renderer, `settings` (a sampling node), seeds from `seed`."""
        from tbexp.build import model_runtime

        return model_runtime(self.cfg, sampler, settings, seed)

    def trainer(self, save_dir: Path, start: str = "", logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
        """A training run on the base model from `start`'s weights ("" = fresh adapters), with a fresh optimizer."""
        engine = self._host.trainer(save_dir, logit_scale_lr_factor)
        if start:
            engine.load_weights(start)
        return engine

    def sampler(self, checkpoint: str = "") -> Sampler:
        """A sampler over `checkpoint`'s weights ("" = the base model's); it needs no optimizer."""
        return self._host.sampler(checkpoint)
