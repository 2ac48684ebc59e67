"""From config nodes to the objects stages use: backends, samplers' settings, model policies, episodes.

Kept apart from the stages so that several stages (eval, collect, sft, grpo)
build these the same way, and apart from the backends so that they stay
free of config plumbing. `tbexp.job.Job` calls these once per job.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbexp.backends.base import TrainingBackend


def make_backend(
    cfg: Any, save_dir: Path, logit_scale_lr_factor: float = 0.0, service_client: Any = None
) -> TrainingBackend:
    """The backend `cfg.backend` names, holding `cfg.model`, with checkpoints under `save_dir`.

    `logit_scale_lr_factor`: how fast `model.logit_scale` trains, relative to the stage's lr (0: it stays put).
    `service_client`: backend=tinker's connection, when the job has one already.
    """
    m = cfg.model
    if cfg.backend.name == "tinker":
        from tbexp.backends.tinker_backend import TinkerBackend

        return TinkerBackend(
            m.path or m.name,
            lora_rank=m.lora_rank,
            lora_dropout=m.lora_dropout,
            lora_targets=list(m.lora_targets),
            logit_scale=m.logit_scale,
            seed=cfg.seed,
            base_url=cfg.backend.base_url,
            service_client=service_client,
        )
    if cfg.backend.name != "local":
        raise ValueError(f"backend.name={cfg.backend.name!r}: choose local or tinker")
    import torch

    from tbexp.backends.local import LocalBackend
    from tbexp.models import load_model

    if cfg.backend.threads:
        torch.set_num_threads(cfg.backend.threads)
    device = cfg.backend.device if cfg.backend.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(m, device=device)
    b = cfg.backend
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
        train_threads=b.train_threads or None,
        continuous_batching=b.continuous_batching,
        kv_cache_tokens=b.kv_cache_tokens,
    )


def sampling_params(settings: Any, stop: Any, seed: int | None = None):
    from tinker import types

    return types.SamplingParams(
        max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p, stop=stop, seed=seed
    )


def model_runtime(cfg: Any, sampler: Any, settings: Any, seed: int | None = None):
    """What policy=model episodes share: `sampler`, the model's renderer and `settings` (a sampling node).

    `seed` makes every reply's draw a function of (seed, task, run, turn) instead of the sampler's RNG.
    """
    from tbexp.policies import ModelRuntime
    from tbexp.renderers import make_renderer

    renderer = make_renderer(cfg.model.renderer, sampler.tokenizer)
    # Without a seed each call draws from the backend's RNG, so n runs of a task differ.
    return ModelRuntime(
        sampler, renderer, sampling_params(settings, renderer.stop()), cfg.model.max_length_tokens, seed
    )


def eval_seed(cfg: Any) -> int:
    """The sampling seed of every held-out eval in a run: checkpoints compared on the same draws (common random
    numbers), so a difference between them is the weights', not the dice's; n runs of a task still differ."""
    return cfg.seed * 7919 + 17


def run_policy(
    job: Any, tasks: list, n_runs: int, concurrency: int, policy: str, runtime: Any = None, desc: str = "episodes"
) -> list:
    """`n_runs` episodes of `policy` on every task, each in a fresh sandbox, `concurrency` at a time.

    The policy is built once per task before any sandbox starts, so a policy that
    cannot act (an oracle without a solution) fails before work is done; a task whose
    environment cannot be built is skipped, its reason printed once.
    """
    from tbexp.policies import make_policy
    from tbexp.rollout import run_episode, run_episodes
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
        return run_episode(
            task,
            run_index,
            agent,
            lambda t, a: make_policy(policy, t, a, runtime, run_index),
            job.sandbox_settings,
            job.cfg.agent.max_turns,
        )

    jobs = [(task, r) for r in range(n_runs) for task in tasks]
    return run_episodes(jobs, concurrency, run_one, desc=desc)


def checkpoint_bytes(checkpoint: str) -> Iterator[bytes]:
    """A local checkpoint's files, each name and contents, in a fixed order, for cache keys (a tinker:// URI: none)."""
    if checkpoint and Path(checkpoint).is_dir():
        for file in sorted(Path(checkpoint).rglob("*")):
            if file.is_file():
                yield file.name.encode() + file.read_bytes()
