"""The GRPO stage: reinforcement learning from test results, episodes in fresh sandboxes.

resume or start (the start checkpoint's weights, or the base model's) → held-out
eval of the start (step 0) → each step: `groups_per_step` RL tasks (epoch-wise
shuffles, a function of the step), `group_size` episodes each at
`grpo.temperature` in fresh sandboxes → rewards per group → group-relative
advantages and one datum per episode on its tokens exactly as sampled
(`tbexp.advantages`); invalid episodes (broken sandbox or verifier) are
dropped, never scored 0 → `forward_backward(importance_sampling | ppo)` + `optim_step` → every
`eval_every` steps a held-out eval and a kept checkpoint → the checkpoint at
peak held-out reward is the stage's result.

Advantages are divided by the number of sampled tokens in the step
(`normalize`), so the summed loss Tinker defines is a mean and a learning rate
means the same at any group size. With `kl_coef` > 0 the KL estimate is
against the starting weights.

Resuming: `grpo_state.json` names the last checkpoint (weights, optimizer,
RNG, step); the tasks of a step and every reply's sampling seed are
functions of (seed, step, task, run, turn), so a resumed run samples what an
uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tbexp import trial
from tbexp.advantages import grpo_datums
from tbexp.build import eval_seed, run_policy
from tbexp.job import TrainedCheckpoint
from tbexp.preemption import interruptible
from tbexp.schedule import epoch_batch, learning_rate
from tbexp.scoring import score_episodes, summarize
from tbexp.stages.eval import ROW_METRICS as EVAL_KEYS
from tbexp.tracking import Tracker, write_summary
from tbexp.trajectories import DataError

log = logging.getLogger(__name__)


class RLResult(TrainedCheckpoint):
    """The checkpoint at peak held-out reward and the run's numbers (`grpo/…` and that eval's `eval/…`)."""

    KEY = "grpo/checkpoint"


def run(job: Any) -> dict[str, Any]:
    out = job.run_dir
    start = job.cfg.load_checkpoint
    summary = train(job, start, rl_tasks(job, start, out), out).summary()
    write_summary(out, summary)
    print(f"run directory: {out}")
    return summary


def rl_tasks(job: Any, start: str, out: Path) -> list:
    """The kept tasks of `grpo.tasks_file`; without one, the filter rates `start` first, in `out/filter`
    (task_filter=none keeps every candidate)."""
    if job.cfg.grpo.tasks_file:
        return kept_tasks(job, Path(job.cfg.grpo.tasks_file))
    if job.cfg.task_filter.name == "none":
        return job.tasks("rl")
    from tbexp.stages import filter as filter_stage

    return kept_tasks(job, filter_stage.select_for_rl(job, out / "filter", start).path)


def kept_tasks(job: Any, path: Path) -> list:
    """The RL candidates that a selection file (the filter's kept_tasks.json) keeps; none kept is an error."""
    if not path.exists():
        raise DataError(f"grpo.tasks_file={path}: no such file (the filter stage writes kept_tasks.json)")
    candidates = job.tasks("rl")
    selection = json.loads(path.read_text())
    kept = set(selection["kept"])
    tasks = [t for t in candidates if t.name in kept]
    if not tasks:
        f = job.cfg.task_filter
        rated = len(selection.get("rates") or candidates)  # the filter rates task_filter.max_tasks of the candidates
        raise DataError(
            f"{path}: no RL tasks kept (solve rate in [{f.lower}, {f.upper}] of {rated} candidates rated); widen task_filter.lower/upper, raise task_filter.k, or train SFT further"
        )
    return tasks


def train(job: Any, start: str, tasks: list, out: Path) -> RLResult:
    """Run (or resume) GRPO in `out` from `start`'s weights ("" = the base model) on `tasks`; keep the peak."""
    from tqdm import trange

    from tbexp.plots import plot_curve

    cfg = job.cfg
    g = cfg.grpo
    state_path = out / "grpo_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"step": 0, "checkpoint": "", "evals": []}
    backend = job.models.trainer(out / "checkpoints", start, logit_scale_lr_factor=g.logit_scale_lr_factor)
    reference = backend.sampler() if g.kl_coef else None  # a snapshot of the starting weights
    if state["checkpoint"]:
        backend.load_state(state["checkpoint"])  # a resumed run: its optimizer and random state too
        log.info("grpo: resuming after step %d from %s", state["step"], state["checkpoint"])
    tracker = job.tracker(out)
    tracker.rewind(state["step"], ("rollout/", "train/", "optim/", "time/", "heldout/"))  # a killed step's rows
    log.info(
        "grpo: %d RL tasks, %d steps of %d groups x %d episodes", len(tasks), g.steps, g.groups_per_step, g.group_size
    )

    if g.eval_at_start and not state["evals"]:
        _evaluate(job, out, backend, state, tracker, step=0)
        _save(state, state_path)
    steps = trange(state["step"], g.steps, desc="grpo", initial=state["step"], total=g.steps, unit="step")
    # Every step ends with its checkpoint, so on SLURM's warning signal there is nothing more to save: just stop.
    for step in interruptible(steps, checkpoint=lambda step: None):
        metrics = _step(job, backend, reference, epoch_batch(tasks, step, g.groups_per_step, cfg.seed), step)
        tracker.log(metrics, step=step + 1)
        previous = state["checkpoint"]
        state["step"], state["checkpoint"] = step + 1, backend.save_state(f"step-{step + 1:05d}")
        if (step + 1) % g.eval_every == 0 or step + 1 == g.steps:
            _evaluate(job, out, backend, state, tracker, step=step + 1)
        _save(state, state_path)
        tracker.log_checkpoint(state["checkpoint"], step + 1)
        _drop_unless_kept(previous, state)

    # ties: the earlier, less-trained one; an eval with no valid episode (NaN) is never the peak
    best = max(state["evals"], key=lambda e: (not math.isnan(e["eval/reward"]), e["eval/reward"], -e["step"]))
    plot_curve(
        [(e["step"], e["eval/reward"]) for e in state["evals"]],
        out / "grpo.png",
        "held-out reward over RL steps",
        mark=best["step"],
    )
    (out / "chosen_checkpoint.txt").write_text(best["checkpoint"] + "\n")
    tracker.log_checkpoint(best["checkpoint"], best["step"], "chosen")
    print(_curve_table(state["evals"], best["step"]))
    print(f"peak held-out reward {best['eval/reward']:.3f} at step {best['step']} -> {best['checkpoint']}")
    tracker.finish()
    metrics = {
        "grpo/best_step": float(best["step"]),
        "grpo/best_reward": best["eval/reward"],
        "grpo/steps_run": float(state["step"]),
        "grpo/rl_tasks": float(len(tasks)),
        **{k: best[k] for k in EVAL_KEYS},
    }
    return RLResult(best["checkpoint"], metrics)


def _step(job: Any, backend, reference, tasks: list, step: int) -> dict[str, float]:
    from tinker import types

    cfg = job.cfg
    g = cfg.grpo
    clock = time.perf_counter()
    settings = OmegaConf.merge(cfg.sampling, {"temperature": g.temperature})
    runtime = job.models.runtime(backend.sampler(), settings, seed=cfg.seed * 1_000_003 + step)
    # A group is group_size runs of one task; a failed episode comes back invalid, never ending the step.
    episodes = run_policy(
        job, list({t.name: t for t in tasks}.values()), g.group_size, g.concurrency, "model", runtime, desc="rollouts"
    )
    rollout_s = time.perf_counter() - clock

    rewards = score_episodes(episodes, cfg.reward)
    datums, counts = grpo_datums(
        episodes, rewards, g.scale_by_std, reference, g.kl_coef, g.normalize, g.negative_weight
    )
    clock = time.perf_counter()
    train_metrics: dict[str, float] = {}
    lr = learning_rate(g, step)
    # Rollouts cost far more than updates, so a step may update several times on its samples; the ratio to the
    # sampler's logprobs (clipped under ppo) keeps the later updates near the policy that sampled.
    for _ in range(g.updates_per_step if datums else 0):
        fb = backend.forward_backward(
            datums,
            g.loss_fn,
            {"clip_low_threshold": g.clip_low_threshold, "clip_high_threshold": g.clip_high_threshold},
        )
        opt = backend.optim_step(
            types.AdamParams(learning_rate=lr, weight_decay=g.weight_decay, grad_clip_norm=g.grad_clip_norm)
        )
        fb, opt = fb.result(), opt.result()
        train_metrics = {
            "train/loss": fb.loss,
            "optim/lr": lr,
            **{f"train/{k}": v for k, v in fb.metrics.items()},
            **{f"optim/{k}": v for k, v in opt.items()},
        }
    train_s = time.perf_counter() - clock

    rollout = {k.replace("eval/", "rollout/"): v for k, v in summarize(episodes, rewards).items()}
    valid = [ep for ep in episodes if not ep.invalid]
    timing = {
        "time/rollout": rollout_s,  # wall clock of the step's episodes, run concurrently
        # the sampler's busy wall time (batches run one at a time); without a batch queue, each episode's waits summed
        "time/sample": runtime.queue.busy_s if runtime.queue is not None else sum(ep.sampled.sample_s for ep in valid),
        # sandbox-seconds, summed over the episodes that ran concurrently: starts, commands and stops; then tests
        "time/env": sum(
            ep.time_s.get("start", 0) + ep.time_s.get("agent", 0) + ep.time_s.get("stop", 0) - ep.sampled.sample_s
            for ep in valid
        ),
        "time/verify": sum(ep.time_s.get("verify", 0) for ep in valid),
        "time/train": train_s,
        "time/step": rollout_s + train_s,
    }
    return {
        "rollout/reward_mean": rollout["rollout/reward"],
        "rollout/strict_success": rollout["rollout/strict_success"],
        "rollout/valid_command_rate": rollout["rollout/valid_command_rate"],
        "rollout/turns": rollout["rollout/avg_turns"],
        "rollout/invalid_episodes": rollout["rollout/invalid_episodes"],
        **{f"rollout/{k}": float(v) for k, v in counts.items()},
        **train_metrics,
        **timing,
    }


def _evaluate(job: Any, out: Path, backend, state: dict, tracker: Tracker, step: int) -> None:
    from tbexp.stages.eval import evaluate

    cfg = job.cfg
    # Every eval point on the same draws, but not the draws the final rows use: the checkpoint is chosen on one
    # sample of the held-out episodes and reported on another, so the choice does not flatter the report.
    runtime = job.models.runtime(backend.sampler(), cfg.sampling, seed=eval_seed(cfg) + 1)
    folder = out / "evals" / f"step-{step:05d}"
    metrics = evaluate(
        job, folder, "model", runtime, label=f"grpo step {step}", quiet=True, n_runs=cfg.grpo.eval_n_runs
    )
    checkpoint = state["checkpoint"] or backend.save_state(f"step-{step:05d}")
    state["evals"].append({"step": step, "checkpoint": checkpoint, **{k: metrics[k] for k in EVAL_KEYS}})
    tracker.log({k.replace("eval/", "heldout/"): metrics[k] for k in EVAL_KEYS}, step=step)
    _report(cfg, state["evals"], step)


def _report(cfg: Any, evals: list[dict], step: int) -> None:
    """Tell the job's sweep trial, if any, where it stands; the sweep's pruner may stop the job here (TrialPruned).

    A sweep prunes on one of two signals (its pruner.metric): eval/reward, the held-out reward at this step,
    or grpo/best_reward, the peak so far, which is what the stage returns if it stops now. A sweep that
    scores the chosen checkpoint (the pipeline's) wants the peak: a trial whose RL spoils a good start still
    returns that start, and judged on its latest reward it would be stopped and its good result thrown away.
    """
    trial.report(cfg, "eval/reward", evals[-1]["eval/reward"], step)
    trial.report(
        cfg,
        "grpo/best_reward",
        max((e["eval/reward"] for e in evals if not math.isnan(e["eval/reward"])), default=math.nan),
        step,
    )


def _drop_unless_kept(checkpoint: str, state: dict) -> None:
    """Delete a superseded per-step checkpoint unless an eval keeps it (local paths only)."""
    if not checkpoint or checkpoint.startswith("tinker://") or checkpoint == state["checkpoint"]:
        return
    if any(e["checkpoint"] == checkpoint for e in state["evals"]):
        return
    shutil.rmtree(checkpoint, ignore_errors=True)


def _save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def _curve_table(evals: list[dict], best_step: int) -> str:
    lines = [f"{'step':>5} {'reward':>7} {'strict':>7} {'valid':>6} {'turns':>6}"]
    for e in evals:
        mark = "  <- peak" if e["step"] == best_step else ""
        lines.append(
            f"{e['step']:>5} {e['eval/reward']:7.3f} {e['eval/strict_success']:7.3f} {e['eval/valid_command_rate']:6.3f} {e['eval/avg_turns']:6.2f}{mark}"
        )
    return "\n".join(lines)
