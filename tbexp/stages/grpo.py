"""The GRPO stage: reinforcement learning from test results, episodes in fresh sandboxes.

resume or start (weights of `load_checkpoint`, or the base model) → held-out
eval of the start (step 0) → each step: `groups_per_step` RL tasks (epoch-wise
shuffles, a function of the step), `group_size` episodes each at
`grpo.temperature` in fresh sandboxes → rewards per group → advantage =
reward − group mean (÷ group std with `scale_by_std`; below-mean advantages
× `negative_weight`, 1 = plain GRPO); groups whose rewards
are all equal teach nothing and are skipped; invalid episodes (broken
sandbox or verifier) are dropped, never scored 0 → one datum per episode:
the episode's tokens exactly as sampled, the sampler's logprobs and the
advantage on the sampled tokens, 0 on prompts and observations →
`forward_backward(importance_sampling | ppo)` + `optim_step` → every
`eval_every` steps a held-out eval and a kept checkpoint → the checkpoint at
peak held-out reward is the stage's result.

Advantages are divided by the number of sampled tokens in the step, so the
summed loss Tinker defines is the per-token mean and a learning rate means
the same at any group size. With `kl_coef` > 0 each sampled token's
advantage is lowered by kl_coef · (log π_sampler − log π_start), the
per-token KL estimate against the starting weights.

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
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tbexp import trial
from tbexp.build import eval_seed, make_backend, model_runtime, run_policy, with_overrides
from tbexp.preemption import interruptible
from tbexp.schedule import epoch_batch, learning_rate
from tbexp.scoring import score_episodes, summarize
from tbexp.tasks import load_task_set
from tbexp.tracking import Tracker, run_dir, write_summary
from tbexp.trajectories import DataError

log = logging.getLogger(__name__)
EVAL_KEYS = ("eval/reward", "eval/strict_success", "eval/pass@1", "eval/valid_command_rate", "eval/avg_turns")


def run(cfg: Any) -> dict[str, float]:
    out = run_dir()
    result = train(cfg, out)
    write_summary(out, result)
    print(f"run directory: {out}")
    return result


def train(cfg: Any, out: Path) -> dict[str, Any]:
    """Run (or resume) GRPO in `out`; returns metrics with the peak checkpoint's path under `grpo/checkpoint`."""
    from tbexp.plots import plot_curve
    from tqdm import trange

    g = cfg.grpo
    tasks = _rl_tasks(cfg, out)
    state_path = out / "grpo_state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {"step": 0, "checkpoint": "", "evals": []}
    backend = make_backend(cfg, out / "checkpoints", logit_scale_lr_factor=g.logit_scale_lr_factor)
    if cfg.load_checkpoint:
        backend.load_weights(cfg.load_checkpoint)
    reference = backend.sampler() if g.kl_coef else None  # a snapshot of the starting weights
    if state["checkpoint"]:
        backend.load_state(state["checkpoint"])
        log.info("grpo: resuming after step %d from %s", state["step"], state["checkpoint"])
    tracker = Tracker(out, cfg.logger)
    tracker.rewind(state["step"], ("rollout/", "train/", "optim/", "time/", "heldout/"))  # a killed step's rows
    eval_cfg = with_overrides(cfg, policy="model")
    log.info("grpo: %d RL tasks, %d steps of %d groups x %d episodes", len(tasks), g.steps, g.groups_per_step, g.group_size)

    if g.eval_at_start and not state["evals"]:
        _evaluate(eval_cfg, out, backend, state, tracker, step=0)
        _save(state, state_path)
    steps = trange(state["step"], g.steps, desc="grpo", initial=state["step"], total=g.steps, unit="step")
    # Every step ends with its checkpoint, so on SLURM's warning signal there is nothing more to save: just stop.
    for step in interruptible(steps, checkpoint=lambda step: None):
        metrics = _step(cfg, backend, reference, epoch_batch(tasks, step, g.groups_per_step, cfg.seed), step)
        tracker.log(metrics, step=step + 1)
        previous = state["checkpoint"]
        state["step"], state["checkpoint"] = step + 1, backend.save_state(f"step-{step + 1:05d}")
        if (step + 1) % g.eval_every == 0 or step + 1 == g.steps:
            _evaluate(eval_cfg, out, backend, state, tracker, step=step + 1)
        _save(state, state_path)
        tracker.log_checkpoint(state["checkpoint"], step + 1)
        _drop_unless_kept(previous, state)

    # ties: the earlier, less-trained one; an eval with no valid episode (NaN) is never the peak
    best = max(state["evals"], key=lambda e: (not math.isnan(e["eval/reward"]), e["eval/reward"], -e["step"]))
    plot_curve([(e["step"], e["eval/reward"]) for e in state["evals"]], out / "grpo.png", "held-out reward over RL steps", mark=best["step"])
    (out / "chosen_checkpoint.txt").write_text(best["checkpoint"] + "\n")
    tracker.log_checkpoint(best["checkpoint"], best["step"], "chosen")
    print(_curve_table(state["evals"], best["step"]))
    print(f"peak held-out reward {best['eval/reward']:.3f} at step {best['step']} -> {best['checkpoint']}")
    tracker.finish()
    return {"grpo/best_step": float(best["step"]), "grpo/best_reward": best["eval/reward"], "grpo/steps_run": float(state["step"]), "grpo/rl_tasks": float(len(tasks)), "grpo/checkpoint": best["checkpoint"], **{k: best[k] for k in EVAL_KEYS}}


def _rl_tasks(cfg: Any, out: Path) -> list:
    """The kept tasks of `grpo.tasks_file`; without one, the filter runs first (task_filter=none keeps all)."""
    candidates = load_task_set(cfg.tasks, split=cfg.task_filter.split, part="rl")
    if not cfg.grpo.tasks_file:
        if cfg.task_filter.name == "none":
            return candidates
        from tbexp.stages import filter as filter_stage

        kept = filter_stage.select_for_rl(cfg, out / "filter", cfg.load_checkpoint)  # the weights RL starts from
        cfg = with_overrides(cfg, **{"grpo.tasks_file": kept["filter/kept_tasks"]})
    path = Path(cfg.grpo.tasks_file)
    if not path.exists():
        raise DataError(f"grpo.tasks_file={path}: no such file (the filter stage writes kept_tasks.json)")
    selection = json.loads(path.read_text())
    kept = set(selection["kept"])
    tasks = [t for t in candidates if t.name in kept]
    if not tasks:
        f = cfg.task_filter
        rated = len(selection.get("rates") or candidates)  # the filter rates task_filter.max_tasks of the candidates
        raise DataError(f"{path}: no RL tasks kept (solve rate in [{f.lower}, {f.upper}] of {rated} candidates rated); widen task_filter.lower/upper, raise task_filter.k, or train SFT further")
    return tasks


def _step(cfg: Any, backend, reference, tasks: list, step: int) -> dict[str, float]:
    from tinker import types

    g = cfg.grpo
    clock = time.perf_counter()
    rollout_cfg = with_overrides(cfg, policy="model")
    settings = OmegaConf.merge(cfg.sampling, {"temperature": g.temperature})
    runtime = model_runtime(cfg, Path("."), backend, settings=settings, seed=cfg.seed * 1_000_003 + step)
    # A group is group_size runs of one task; a failed episode comes back invalid, never ending the step.
    episodes = run_policy(rollout_cfg, list({t.name: t for t in tasks}.values()), g.group_size, g.concurrency, runtime, desc="rollouts")
    rollout_s = time.perf_counter() - clock

    rewards = score_episodes(episodes, cfg.reward)
    datums, counts = _datums(episodes, rewards, g.scale_by_std, reference, g.kl_coef, g.normalize, g.negative_weight)
    clock = time.perf_counter()
    train_metrics: dict[str, float] = {}
    lr = learning_rate(g, step)
    # Rollouts cost far more than updates, so a step may update several times on its samples; the ratio to the
    # sampler's logprobs (clipped under ppo) keeps the later updates near the policy that sampled.
    for _ in range(g.updates_per_step if datums else 0):
        fb = backend.forward_backward(datums, g.loss_fn, {"clip_low_threshold": g.clip_low_threshold, "clip_high_threshold": g.clip_high_threshold})
        opt = backend.optim_step(types.AdamParams(learning_rate=lr, weight_decay=g.weight_decay, grad_clip_norm=g.grad_clip_norm))
        fb, opt = fb.result(), opt.result()
        train_metrics = {"train/loss": fb.loss, "optim/lr": lr, **{f"train/{k}": v for k, v in fb.metrics.items()}, **{f"optim/{k}": v for k, v in opt.items()}}
    train_s = time.perf_counter() - clock

    rollout = {k.replace("eval/", "rollout/"): v for k, v in summarize(episodes, rewards).items()}
    valid = [ep for ep in episodes if not ep.invalid]
    timing = {
        "time/rollout": rollout_s,  # wall clock of the step's episodes, run concurrently
        # the sampler's busy wall time (batches run one at a time); without a batch queue, each episode's waits summed
        "time/sample": runtime.queue.busy_s if runtime.queue is not None else sum(ep.policy.sample_s for ep in valid),
        # sandbox-seconds, summed over the episodes that ran concurrently: starts, commands and stops; then tests
        "time/env": sum(ep.time_s.get("start", 0) + ep.time_s.get("agent", 0) + ep.time_s.get("stop", 0) - ep.policy.sample_s for ep in valid),
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


def _datums(episodes: list, rewards: dict[int, float], scale_by_std: bool, reference, kl_coef: float, normalize: str = "token", negative_weight: float = 1.0) -> tuple[list, dict[str, float]]:
    from tinker import types

    groups: dict[str, list] = defaultdict(list)
    for ep in episodes:
        if not ep.invalid and ep.policy.record:
            groups[ep.task.name].append(ep)
    advantaged, skipped = [], 0
    for group in groups.values():
        scores = [rewards[id(ep)] for ep in group]
        if len(group) < 2 or max(scores) == min(scores):
            skipped += 1  # every advantage would be 0
            continue
        mean = statistics.fmean(scores)
        scale = (statistics.pstdev(scores) + 1e-6) if scale_by_std else 1.0
        advantaged += [(ep, (s - mean) / scale * (negative_weight if s < mean else 1.0)) for ep, s in zip(group, scores)]
    n_sampled = sum(len(turn.tokens) for ep, _ in advantaged for turn in ep.policy.record)
    datums, kl_sum = [], 0.0
    for ep, advantage in advantaged:
        tokens = ep.policy.tokens
        logprobs, advantages = [0.0] * len(tokens), [0.0] * len(tokens)
        ref = reference.compute_logprobs(types.ModelInput.from_ints(tokens)).result() if reference is not None else None
        # token: every sampled token of the step weighs the same; episode: every episode does, whatever its length
        share = n_sampled if normalize == "token" else len(advantaged) * sum(len(turn.tokens) for turn in ep.policy.record)
        for turn in ep.policy.record:
            for i, logp in enumerate(turn.logprobs):
                at = turn.offset + i
                logprobs[at] = logp
                kl = logp - ref[at] if ref is not None else 0.0
                kl_sum += kl
                advantages[at] = (advantage - kl_coef * kl) / share
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": logprobs[1:], "advantages": advantages[1:]}))
    counts = {"groups": float(len(groups)), "groups_skipped": float(skipped), "datums": float(len(datums)), "sampled_tokens": float(n_sampled)}
    if reference is not None and n_sampled:
        counts["kl_start"] = kl_sum / n_sampled
    return datums, counts


def _evaluate(cfg: Any, out: Path, backend, state: dict, tracker: Tracker, step: int) -> None:
    from tbexp.stages.eval import evaluate

    n_runs = cfg.grpo.eval_n_runs
    # Every eval point on the same draws, but not the draws the final rows use: the checkpoint is chosen on one
    # sample of the held-out episodes and reported on another, so the choice does not flatter the report.
    runtime = model_runtime(cfg, Path("."), backend, seed=eval_seed(cfg) + 1)
    metrics = evaluate(with_overrides(cfg, **{"eval.n_runs": n_runs}), out / "evals" / f"step-{step:05d}", runtime, label=f"grpo step {step}", quiet=True)
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
    trial.report(cfg, "grpo/best_reward", max((e["eval/reward"] for e in evals if not math.isnan(e["eval/reward"])), default=math.nan), step)


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
        lines.append(f"{e['step']:>5} {e['eval/reward']:7.3f} {e['eval/strict_success']:7.3f} {e['eval/valid_command_rate']:6.3f} {e['eval/avg_turns']:6.2f}{mark}")
    return "\n".join(lines)
