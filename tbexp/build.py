"""From config nodes to the objects stages use: backends, samplers' settings, model policies.

Kept apart from the stages so that several stages (eval, collect, sft, grpo)
build these the same way, and apart from the backends so that they stay
free of config plumbing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbexp.backends.base import TrainingBackend


def make_backend(cfg: Any, save_dir: Path, logit_scale_lr_factor: float = 0.0) -> TrainingBackend:
    """The backend `cfg.backend` names, holding `cfg.model`, with checkpoints under `save_dir`.

    `logit_scale_lr_factor`: how fast `model.logit_scale` trains, relative to the stage's lr (0: it stays put).
    """
    m = cfg.model
    if cfg.backend.name == "tinker":
        from tbexp.backends.tinker_backend import TinkerBackend

        return TinkerBackend(m.path or m.name, lora_rank=m.lora_rank, lora_dropout=m.lora_dropout, lora_targets=list(m.lora_targets), logit_scale=m.logit_scale, seed=cfg.seed, base_url=cfg.backend.base_url)
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
        model, tokenizer, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout, lora_targets=list(m.lora_targets), lora_target_parameters=list(m.lora_target_parameters),
        logit_scale=m.logit_scale, logit_scale_lr_factor=logit_scale_lr_factor,
        device=device, seed=cfg.seed, save_dir=save_dir, microbatch_tokens=b.microbatch_tokens, gradient_checkpointing=b.gradient_checkpointing, packing=b.packing,
        dtype=b.dtype or None, compile_backend=b.compile or None, cuda_graph_sampling=b.cuda_graph_sampling, train_threads=b.train_threads or None,
        continuous_batching=b.continuous_batching, kv_cache_tokens=b.kv_cache_tokens,
    )


def sampling_params(settings: Any, stop: Any, seed: int | None = None):
    from tinker import types

    return types.SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature, top_p=settings.top_p, stop=stop, seed=seed)


def model_runtime(cfg: Any, save_dir: Path, backend: TrainingBackend | None = None, settings: Any = None, seed: int | None = None):
    """What policy=model episodes share: a sampler over `backend`'s current weights (built from cfg if not given).

    `settings` replaces `cfg.sampling` (GRPO rolls out at its own temperature); `seed` makes
    every reply's draw a function of (seed, task, run, turn) instead of the backend's RNG.
    """
    from tbexp.policies import ModelRuntime
    from tbexp.renderers import make_renderer

    if backend is None:
        backend = make_backend(cfg, save_dir)
        if cfg.load_checkpoint:
            backend.load_state(cfg.load_checkpoint)
    renderer = make_renderer(cfg.model.renderer, backend.tokenizer)
    # Without a seed each call draws from the backend's RNG, so n runs of a task differ.
    return ModelRuntime(backend.sampler(), renderer, sampling_params(settings or cfg.sampling, renderer.stop()), cfg.model.max_length_tokens, seed)


def eval_seed(cfg: Any) -> int:
    """The sampling seed of every held-out eval in a run: checkpoints compared on the same draws (common random
    numbers), so a difference between them is the weights', not the dice's; n runs of a task still differ."""
    return cfg.seed * 7919 + 17


def run_policy(cfg: Any, tasks: list, n_runs: int, concurrency: int, runtime: Any = None, desc: str = "episodes") -> list:
    """`n_runs` episodes of `cfg.policy` on every task, each in a fresh sandbox, `concurrency` at a time.

    The policy is built once per task before any sandbox starts, so a policy that
    cannot act (an oracle without a solution) fails before work is done; a task whose
    environment cannot be built is skipped, its reason printed once.
    """
    from tbexp.agents.base import make_agent
    from tbexp.policies import make_policy
    from tbexp.rollout import run_episode, run_episodes

    from tbexp.sandboxes.environments import prepare_environments

    agent = make_agent(cfg.agent)
    for task in tasks:
        for one in [task] if len(task.steps) == 1 else [task.for_step(step) for step in task.steps]:  # a policy a step
            make_policy(cfg.policy, one, agent, runtime)
    unrunnable = prepare_environments(tasks, cfg.sandbox)  # each distinct environment built once, up front
    for name, reason in unrunnable.items():
        print(f"unrunnable task {name} (skipped): {reason}", file=sys.stderr)
    tasks = [task for task in tasks if task.name not in unrunnable]

    def run_one(task, run_index):
        return run_episode(task, run_index, agent, lambda t, a: make_policy(cfg.policy, t, a, runtime, run_index), cfg.sandbox, cfg.agent.max_turns)

    jobs = [(task, r) for r in range(n_runs) for task in tasks]
    return run_episodes(jobs, concurrency, run_one, desc=desc)


def checkpoint_bytes(checkpoint: str) -> Iterator[bytes]:
    """A local checkpoint's files, each name and contents, in a fixed order, for cache keys (a tinker:// URI: none)."""
    if checkpoint and Path(checkpoint).is_dir():
        for file in sorted(Path(checkpoint).rglob("*")):
            if file.is_file():
                yield file.name.encode() + file.read_bytes()


def with_overrides(cfg: Any, **overrides: Any) -> Any:
    """A copy of `cfg` with dotted keys set: `with_overrides(cfg, policy="model", **{"eval.n_runs": 2})`."""
    from omegaconf import OmegaConf

    copy = cfg.copy()
    for key, value in overrides.items():
        OmegaConf.update(copy, key, value, merge=False)
    return copy
