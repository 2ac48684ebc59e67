"""The result caches: what names each cached result, where it lives, and how two jobs share one.

Four results are cached under the job's cache root (`cache_dir`), each named by a content key
(`tbexp.content_key`: the settings that decide it, the bytes it is computed from, the code):

| result | where | key | settings read |
|---|---|---|---|
| the oracle's verified turns | `trajectories/oracle-<agent>-<n>tasks-<key>.jsonl` | `trajectories_key` | agent, sandbox, collect; the SFT tasks' and the decontamination's reference tasks' names and directories |
| an SFT run | `sft/<key>/` | `sft_key` | model, sft, backend, seed; the data file's bytes |
| a held-out eval | `evals/<key>/` | `eval_key` | model, tasks, agent, sampling, eval, reward, backend, sandbox (and `harbor` under `eval.harness=harbor`), seed, the row's label; the checkpoint, the held-out tasks' names and directories |
| the filter's solve rates | `filter/<key>.json` | `filter_key` | model, backend, agent, sandbox, the sampling it ran with, `task_filter.k`, seed, the policy; the checkpoint, the candidates' names and directories |

Each key function names the config groups its result reads; NOT_DECIDING, the one table below, names the
settings inside those groups that decide no result, and every key leaves them out. A task set enters a key as
its tasks (names and directory contents), a local checkpoint as its files and the SFT data as its bytes: where
they lie on this machine decides nothing, so a path to them never enters a key. SFT reads no task and no agent
setting: they decide it through its data's bytes, so a sweep trial that changes what only the evals read (the
held-out tasks, the agent's turn limit) trains no new SFT.

Simplified: a setting in no group a key reads (logger, trial, pipeline, grpo, the filter's bounds) decides none
of these results by construction; the filter's bounds pick from cached rates. A change of the settings a key
reads, or of the code, recomputes the result once; old entries stay until `rm -r <cache>/{trajectories,sft,evals,filter}`.
"""

from __future__ import annotations

import fcntl
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from tbexp.content_key import content_key, resolved, task_contents

if TYPE_CHECKING:
    from tbexp.job import Job
    from tbexp.tasks.harbor_task import Task

P = ParamSpec("P")
R = TypeVar("R")

# Settings that decide no cached result, and why. Every key leaves each of them out.
NOT_DECIDING: dict[str, str] = {
    "backend.threads": "torch's threads while sampling: the same numbers with any count",
    "backend.train_threads": "torch's threads during updates: as backend.threads",
    "backend.share_cores": "whether those thread counts follow this job's share of the cores: as backend.threads",
    "sandbox.rootfs": "where the base root lies (under the cache root, so machine-specific); the root itself is "
    "what scripts/build_rootfs.sh builds, the same anywhere",
    "tasks.cache_dir": "where the built-in tasks are written (machine-specific); tasks enter a key as their names "
    "and directory contents",
    "sft.data": "where the SFT data lies; its bytes enter the SFT key",
    "tasks.manifest": "which tasks a check.json leaves out: the tasks a result is computed on enter its key",
    "backend.gpu_memory_fraction": "how much of the card the job may hold: the KV pool's size, which moves only "
    "the batching of replies (as eval.concurrency)",
    "backend.gradient_checkpointing": "activations recomputed in the backward pass: the same gradients",
    "backend.checkpoint_ttl_s": "how long a Tinker service keeps saved checkpoints, not what they hold",
    "sft.save_every": "extra checkpoints to resume from: the same steps and the same chosen checkpoint",
    "sft.eval_after": "stage=sft's evals after training, not the training",
    "eval.concurrency": "episodes at once: each reply's seed is its own (it moves only the rounding of sampling "
    "batches, which the keys treat as the same result, so trials that differ in speed settings share)",
    "eval.save_episodes": "how many transcripts an eval keeps as files, not its numbers",
    "eval.candidates": "stage=eval's list of candidates, not what one eval scores",
    "eval.promote_by": "the promotion gate's, read after the rows are scored",
    "eval.promote_margin": "the promotion gate's",
    "eval.promote_z": "the promotion gate's",
    "eval.incumbent": "which checkpoint the gate compares with, itself scored by a key of its own",
    "collect.split": "which tasks are collected on: they enter the key as their names and contents",
    "collect.concurrency": "episodes at once: the oracle draws nothing, so the same episodes at any count",
    "collect.data": "where stage=collect writes its data (the cached oracle rows have a path of their own)",
    "collect.format": "stage=collect's file format; the cached oracle rows are always tbexp rows",
    "collect.decontaminate_dirs": "where the extra tasks to check against lie: they enter the key as their contents",
    # policy=teacher's endpoint: its collection is written to collect.data and resumed by its ledger, never cached;
    # the one cached collection is the oracle's
    "collect.teacher_url": "policy=teacher's endpoint (the cached collection is the oracle's)",
    "collect.teacher_model": "policy=teacher's model (the cached collection is the oracle's)",
    "collect.teacher_key_env": "where policy=teacher's API key is read from",
    "collect.teacher_max_tokens": "policy=teacher's reply length (the cached collection is the oracle's)",
    "collect.teacher_timeout_s": "how long a teacher call may take before it is retried",
    "collect.teacher_retries": "how often a teacher call is retried",
    "collect.teacher_backoff_s": "how long a retried teacher call waits",
    "collect.teacher_max_rpm": "how fast teacher calls are made",
}


def settings(name: str, node: Any) -> dict[str, Any]:
    """The settings of config node `name` (a group: "model", "sandbox", …) that decide results: the node
    resolved, less NOT_DECIDING."""
    values: dict[str, Any] = resolved(node)
    for key in NOT_DECIDING:
        group, _, setting = key.partition(".")
        if group == name:
            values.pop(setting, None)
    return values


def decided_by(cfg: Any, groups: Sequence[str]) -> dict[str, Any]:
    """{group: its deciding settings} for `groups` of the config, and the seed."""
    return {**{group: settings(group, cfg[group]) for group in groups}, "seed": cfg.seed}


def trajectories_key(cfg: Any, tasks: Sequence[Task], references: Sequence[Task] = ()) -> str:
    """The oracle's verified turns on `tasks`: the agent, sandbox and verifier decide which oracle runs succeed, the
    collect settings which of them are kept (rejection sampling, decontamination against `references`, whose
    contents enter the key). The oracle draws nothing, so the seed is left out."""
    chosen = {group: settings(group, cfg[group]) for group in ("agent", "sandbox", "verifier", "collect")}
    against = task_contents(list(references)) if cfg.collect.decontaminate else []
    return content_key(chosen, [*task_contents(list(tasks)), b"references", *against], length=16)


def trajectories_file(job: Job, tasks: Sequence[Task], references: Sequence[Task] = ()) -> Path:
    """Where the oracle's verified turns on `tasks` (decontaminated against `references`) are kept."""
    key = trajectories_key(job.cfg, tasks, references)
    return job.cache_dir / "trajectories" / f"oracle-{job.cfg.agent.name}-{len(tasks)}tasks-{key}.jsonl"


def sft_key(cfg: Any, data: Path) -> str:
    """An SFT run on the conversations in `data`."""
    return content_key(decided_by(cfg, ("model", "sft", "backend")), [data.read_bytes()] if data.is_file() else [])


def sft_folder(job: Job, data: Path, link: Path) -> Path:
    """Where SFT on `data` trains: with `pipeline.cache_sft` a folder under the cache, which `link` points to (sweep
    trials and re-runs that share it train once); without, `link` itself."""
    if not job.cfg.pipeline.cache_sft:
        return link
    return shared_folder(job.cache_dir / "sft" / sft_key(job.cfg, data), link)


def eval_key(cfg: Any, tasks: Sequence[Task], checkpoint: str, label: str) -> str:
    """The held-out eval of `checkpoint` ("" = the base model) on `tasks`, reported as `label`."""
    groups = ("model", "tasks", "agent", "sampling", "eval", "reward", "backend", "sandbox", "verifier")
    chosen = decided_by(cfg, (*groups, "harbor") if cfg.eval.harness == "harbor" else groups)
    name, files = _checkpoint(checkpoint)
    return content_key({**chosen, "checkpoint": name, "label": label}, [*task_contents(list(tasks)), *files])


def eval_folder(job: Job, checkpoint: str, label: str, link: Path) -> Path:
    """Where the held-out eval of `checkpoint` runs once per content (`link` points there)."""
    return shared_folder(job.cache_dir / "evals" / eval_key(job.cfg, job.tasks("heldout"), checkpoint, label), link)


def filter_key(cfg: Any, tasks: Sequence[Task], policy: str, checkpoint: str, sampling: Any) -> str:
    """The solve rates of `tasks` under `policy` (policy=model: `checkpoint`'s weights sampled with `sampling`)."""
    chosen = decided_by(cfg, ("model", "backend", "agent", "sandbox", "verifier"))
    name, files = _checkpoint(checkpoint)
    decided = {**chosen, "sampling": settings("sampling", sampling), "k": cfg.task_filter.k}
    return content_key({**decided, "policy": policy, "checkpoint": name}, [*task_contents(list(tasks)), *files], 24)


def filter_file(job: Job, tasks: Sequence[Task], policy: str, checkpoint: str, sampling: Any) -> Path:
    """Where the solve rates of `tasks` are kept."""
    return job.cache_dir / "filter" / f"{filter_key(job.cfg, tasks, policy, checkpoint, sampling)}.json"


def shared_folder(folder: Path, link: Path) -> Path:
    """`folder` (under the cache), created, with `link` (in a run directory) pointing there."""
    folder.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(folder, target_is_directory=True)
    return folder


def one_at_a_time(folder: Path, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`work(*args, **kwargs)` holding a lock on `folder`: a second job that needs the same result waits, then
    finds it done (a training resumes its finished run, an eval reads its result)."""
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return work(*args, **kwargs)


def checkpoint_bytes(checkpoint: str) -> Iterator[bytes]:
    """A local checkpoint's files, each name and contents, in a fixed order (a tinker:// URI: none)."""
    if checkpoint and Path(checkpoint).is_dir():
        for file in sorted(Path(checkpoint).rglob("*")):
            if file.is_file():
                yield file.name.encode() + file.read_bytes()


def _checkpoint(checkpoint: str) -> tuple[str, list[bytes]]:
    """A checkpoint as a key sees it: a local directory by its files (where it lies decides nothing), a tinker://
    URI by itself, "" (the base model) as it is."""
    files = list(checkpoint_bytes(checkpoint))
    return ("local" if files else checkpoint), files
