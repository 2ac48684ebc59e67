"""From config nodes to the objects stages use: backends, samplers' settings, model policies, episodes.

The model hosts are what `backend._target_` names: `LocalHost` (transformers + peft in this process) and
`TinkerHost` (the Tinker service); each loads base weights, hands out trainers and samplers, and counts loads.

Kept apart from the stages so that several stages (eval, collect, sft, grpo)
build these the same way, and apart from the backends so that they stay
free of config plumbing. `tbexp.job.Job` calls these once per job.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tbexp.backends.base import Sampler, TrainingBackend

if TYPE_CHECKING:
    from tbexp.episodes.policies import ModelRuntime


def configure_threads(b: Any, device: str) -> Any:
    """Sets torch's threads for sampling and returns the updates' (an int, None = as set, or a callable that
    re-reads this job's share of its cores before each update: tbexp.jobs.cpu_share)."""
    import torch

    if not b.share_cores or device != "cpu":
        if b.threads:
            torch.set_num_threads(b.threads)
        return b.train_threads or None
    from tbexp.jobs.cpu_share import SharedThreads, job_cores, launcher_cpus_per_task, share

    cores = job_cores(launcher_cpus_per_task())
    shared = SharedThreads(b.train_threads or b.threads, cores)
    torch.set_num_threads(min(b.threads or cores, share(cores)))
    return shared


class LocalHost:
    """backend=local (`backend._target_`): the base model loaded into this process once; every trainer is that
    model with its trainable weights reset (so a second trainer ends the first), a sampler is a snapshot of
    a checkpoint's weights on it."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.loads = 0  # how many times base weights were loaded
        self._engine: Any = None

    def trainer(self, save_dir: Path, logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
        engine = self._local()
        engine.restart(save_dir, logit_scale_lr_factor)
        return engine

    def sampler(self, checkpoint: str = "") -> Sampler:
        return self._local().checkpoint_sampler(checkpoint)

    def _local(self) -> Any:
        if self._engine is None:
            self._engine = _local_backend(self.cfg, Path(self.cfg.cache_dir))  # save_dir is set by each trainer
            self.loads += 1
        return self._engine


class TinkerHost:
    """backend=tinker (`backend._target_`): one service connection; each trainer is a new LoRA training client,
    each sampler a sampling client over a checkpoint's sampler weights (no optimizer behind it)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.loads = 0  # training clients made: the service loads the base model for each
        self._service: Any = None

    def trainer(self, save_dir: Path, logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
        from tbexp.backends.tinker_backend import TinkerBackend

        m = self.cfg.model
        self.loads += 1
        return TinkerBackend(
            _tinker_model(m),
            lora_rank=m.lora_rank,
            lora_dropout=m.lora_dropout,
            lora_targets=list(m.lora_targets),
            lora_target_parameters=list(m.lora_target_parameters),
            logit_scale=m.logit_scale,
            seed=self.cfg.seed,
            base_url=self.cfg.backend.base_url,
            checkpoint_ttl_s=self.cfg.backend.checkpoint_ttl_s,
            service_client=self._connection(),
        )

    def sampler(self, checkpoint: str = "") -> Sampler:
        from tbexp.backends.tinker_backend import sampling_client

        return sampling_client(self._connection(), _tinker_model(self.cfg.model), checkpoint)

    def probe(self, losses: list[str]) -> None:
        """Refuse, by name and before any work, a model the service does not serve or an RL loss it refuses (SkyRL's
        JAX backend refuses gspo): the service's model list, then one forward pass per loss on a two-token datum
        through a training client made for it."""
        from tbexp.backends.tinker_backend import probe_service

        probe_service(self._connection(), self.cfg.backend.base_url, _tinker_model(self.cfg.model), losses)

    def _connection(self) -> Any:
        if self._service is None:
            from tbexp.backends.tinker_backend import _connect

            self._service = _connect(self.cfg.backend.base_url)
        return self._service


def _tinker_model(m: Any) -> str:
    """The base model's name for the service: model.path, or a shipped model's directory (a self-hosted server such as
    scripts/start_tinker_server.sh serves it by that path), else model.name."""
    from tbexp.models import SHIPPED, resolve_model_path

    return resolve_model_path(m) if m.path or m.name in SHIPPED else str(m.name)


def make_host(cfg: Any) -> Any:
    """The model host `cfg.backend._target_` names (LocalHost, TinkerHost or another with their two methods)."""
    from hydra.utils import get_class

    return get_class(cfg.backend._target_)(cfg)


def make_backend(cfg: Any, save_dir: Path) -> TrainingBackend:
    """A fresh training run on the backend `cfg.backend` chooses, holding `cfg.model`, checkpoints under `save_dir`."""
    return make_host(cfg).trainer(save_dir)


def _local_backend(cfg: Any, save_dir: Path, logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
    import torch

    from tbexp.backends.local import LocalBackend
    from tbexp.models import load_model

    m, b = cfg.model, cfg.backend
    device = b.device if b.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    train_threads = configure_threads(b, device)
    model, tokenizer = load_model(m, device=device)
    return LocalBackend(
        model,
        tokenizer,
        lora_rank=m.lora_rank,
        lora_alpha=m.lora_alpha,
        lora_dropout=m.lora_dropout,
        lora_targets=list(m.lora_targets),
        lora_target_parameters=list(m.lora_target_parameters),
        logit_scale=m.logit_scale,
        logit_scale_lr_factor=logit_scale_lr_factor,
        device=device,
        seed=cfg.seed,
        save_dir=save_dir,
        microbatch_tokens=b.microbatch_tokens,
        gradient_checkpointing=b.gradient_checkpointing,
        packing=b.packing,
        dtype=b.dtype or None,
        compile_backend=b.compile or None,
        cuda_graph_sampling=b.cuda_graph_sampling,
        train_threads=train_threads,
        continuous_batching=b.continuous_batching,
        kv_cache_tokens=b.kv_cache_tokens,
        max_sequence_tokens=m.max_length_tokens,
        gpu_memory_fraction=b.gpu_memory_fraction,
    )


def sampling_params(settings: Any, stop: Any, seed: int | None = None):
    from tinker import types

    return types.SamplingParams(
        max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p, stop=stop, seed=seed
    )


def model_runtime(cfg: Any, sampler: Any, settings: Any, seed: int | None = None) -> ModelRuntime:
    """What policy=model episodes share: `sampler`, the model's renderer and `settings` (a sampling node).

    `seed` makes every reply's draw a function of (seed, task, run, turn) instead of the sampler's RNG.
    """
    from tbexp.episodes.policies import ModelRuntime
    from tbexp.models.renderers import make_renderer

    renderer = make_renderer(cfg.model.renderer, sampler.tokenizer)
    # Without a seed each call draws from the backend's RNG, so n runs of a task differ.
    return ModelRuntime(
        sampler, renderer, sampling_params(settings, renderer.stop()), cfg.model.max_length_tokens, seed
    )


class EpisodeJob(Protocol):
    """What `run_policy` reads of a job (`tbexp.job.Job`, which imports this module): the config, the agent and the
    settings every episode's sandbox is built from."""

    cfg: Any

    @property
    def agent(self) -> Any: ...

    @property
    def sandbox_settings(self) -> Any: ...


class RolloutsCancelled(Exception):
    """The caller stopped `run_policy` (its `stop` was set) while episodes were in flight; they are discarded."""


def run_policy(
    job: EpisodeJob,
    tasks: list,
    n_runs: int,
    concurrency: int,
    policy: str,
    runtime: Any = None,
    desc: str = "episodes",
    stop: Any = None,
    done: Any = frozenset(),
    on_done: Any = None,
) -> list:
    """`n_runs` episodes of `policy` on every task, each in a fresh sandbox, `concurrency` at a time.

    The policy is built once per task before any sandbox starts, so a policy that
    cannot act (an oracle without a solution) fails before work is done; a task whose
    environment cannot be built is skipped, its reason printed once. Once `stop` (a
    threading.Event) is set, episodes not yet started raise RolloutsCancelled and the
    call ends when the running ones have finished. `done` holds the (task name, run) pairs already run (a
    resumed collection's ledger): they are not run again. `on_done(episode)` is called as each one ends.
    """
    from tbexp.episodes.policies import make_policy
    from tbexp.episodes.rollout import run_episode, run_episodes
    from tbexp.sandboxes.environments import prepare_environments

    agent = job.agent
    for task in tasks:
        for one in [task] if len(task.steps) == 1 else [task.for_step(step) for step in task.steps]:  # a policy a step
            make_policy(policy, one, agent, runtime)
    unrunnable = prepare_environments(tasks, job.sandbox_settings)  # each distinct environment built once, up front
    for name, reason in unrunnable.items():
        print(f"unrunnable task {name} (skipped): {reason}", file=sys.stderr)
    tasks = [task for task in tasks if task.name not in unrunnable]

    def run_one(task, run_index):
        if stop is not None and stop.is_set():
            raise RolloutsCancelled(f"{task.name} run {run_index}")
        return run_episode(
            task,
            run_index,
            agent,
            lambda t, a: make_policy(policy, t, a, runtime, run_index),
            job.sandbox_settings,
            job.cfg.agent.max_turns,
            job.cfg.verifier.isolation,
        )

    jobs = [(task, r) for r in range(n_runs) for task in tasks if (task.name, r) not in done]
    queue = getattr(runtime, "queue", None)
    # the same sampling batches on every run, so the results depend on the seeds alone
    lockstep = queue if hasattr(queue, "lockstep") and job.cfg.sampling.lockstep else None
    return run_episodes(jobs, concurrency, run_one, on_done=on_done, desc=desc, lockstep=lockstep)
