"""The GRPO stage: reinforcement learning from test results, episodes in fresh sandboxes.

resume or start (the start checkpoint's weights, or the base model's) → held-out
eval of the start (step 0) → each step: `groups_per_step` RL tasks (epoch-wise
shuffles, a function of the step), `group_size` episodes each at
`grpo.temperature` in fresh sandboxes → rewards per group → group-relative
advantages and one datum per episode on its tokens exactly as sampled
(`tbexp.episodes.advantages`); invalid episodes (broken sandbox or verifier) are
dropped, never scored 0 → `forward_backward(importance_sampling | ppo)` + `optim_step` → every
`eval_every` steps a held-out eval and a kept checkpoint → the checkpoint at
peak held-out reward is the stage's result, also written as a PEFT adapter
(`adapter/`, tbexp.backends.adapters).

Two options change the loop (both off by default; docs/grpo.md). With
`max_off_policy_steps` = k, step t's rollouts are sampled in the background from
the weights after t - k updates while the steps before it train
(`tbexp.stages.grpo_rollouts`); the loss's importance ratio is taken against the
logprobs of those weights. With `max_replaced_groups` a step samples fresh groups
in place of groups whose rewards do not spread, and with `retire_after` a
solve-rate pool over the rollouts retires tasks that became always or never
solved (`tbexp.episodes.difficulty`).

Advantages are divided by the number of sampled tokens in the step
(`normalize`), so the summed loss Tinker defines is a mean and a learning rate
means the same at any group size. With `kl_coef` > 0 the KL estimate is
against the starting weights; with `kl_scaled_reference`, against the starting
weights at the policy's current logit scale (`backends.logit_scale.ScaledReference`).

Resuming: `grpo_state.json` names the last checkpoint (weights, optimizer,
RNG, step); the tasks of a step and every reply's sampling seed are
functions of (seed, step, task, run, turn), so a resumed run samples what an
uninterrupted one would have. The pool's counts and the plans of rollouts in flight
are saved with each checkpoint, and the checkpoints those plans sample from are
kept, so a pipelined run resumes exactly too.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from tbexp.build import run_policy
from tbexp.episodes.advantages import grpo_datums, loss_fn_config
from tbexp.episodes.difficulty import DifficultyPool
from tbexp.episodes.scoring import apply_tamper, score_episodes, summarize
from tbexp.job import Job, TrainedCheckpoint
from tbexp.jobs.preemption import interruptible
from tbexp.jobs.schedule import learning_rate
from tbexp.jobs.tracking import Tracker, write_summary
from tbexp.seeds import stream
from tbexp.stages.eval import ROW_METRICS as EVAL_KEYS
from tbexp.stages.filter import NoTasksKept, kept_tasks, rl_tasks  # noqa: F401  (stage=grpo's tasks; older callers)
from tbexp.stages.grpo_rollouts import Plan, RolloutPipeline, Rollouts, make_plan, sample_groups
from tbexp.study import trial

if TYPE_CHECKING:
    from tbexp.backends.base import Sampler, TrainingBackend
    from tbexp.config import Config, GRPOConfig
    from tbexp.episodes.policies import SampledTokens
    from tbexp.episodes.rollout import Episode
    from tbexp.tasks.harbor_task import Task

log = logging.getLogger(__name__)


class RLResult(TrainedCheckpoint):
    """The checkpoint at peak held-out reward and the run's numbers (`grpo/…` and that eval's `eval/…`)."""

    KEY = "grpo/checkpoint"


def run(job: Job) -> dict[str, Any]:
    out = job.run_dir
    start = job.cfg.load_checkpoint
    summary = train(job, start, rl_tasks(job, start, out), out).summary()
    write_summary(out, summary)
    print(f"run directory: {out}")
    return summary


def train(job: Job, start: str, tasks: list[Task], out: Path) -> RLResult:
    """Run (or resume) GRPO in `out` from `start`'s weights ("" = the base model) on `tasks`; keep the peak."""
    from tqdm import trange

    from tbexp.jobs.plots import plot_curve

    cfg = job.cfg
    g = cfg.grpo
    state_path = out / "grpo_state.json"
    state: dict[str, Any] = (
        json.loads(state_path.read_text()) if state_path.exists() else {"step": 0, "checkpoint": "", "evals": []}
    )
    backend = job.models.trainer(out / "checkpoints", start, logit_scale_lr_factor=g.logit_scale_lr_factor)
    reference: Any = backend.sampler() if g.kl_coef else None  # a snapshot of the starting weights
    if reference is not None and g.kl_scaled_reference:
        from tbexp.backends.logit_scale import ScaledReference

        reference = ScaledReference(reference, backend)
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
    source = _RolloutSource(job, backend, start, state, tasks)
    steps = trange(state["step"], g.steps, desc="grpo", initial=state["step"], total=g.steps, unit="step")
    try:
        # Every step ends with its checkpoint, so on SLURM's warning signal there is nothing more to save: just stop.
        for step in interruptible(steps, checkpoint=lambda step: None):
            rollouts, control = source.take(step)
            metrics = {**_step(job, backend, reference, rollouts, step), **control}
            if source.pipeline is not None:
                metrics["time/step"] = time.perf_counter() - source.started_s  # the wait and the update
            tracker.log(metrics, step=step + 1)
            previous = state["checkpoint"]
            state["step"], state["checkpoint"] = step + 1, backend.save_state(f"step-{step + 1:05d}")
            source.remember(state)
            if (step + 1) % g.eval_every == 0 or step + 1 == g.steps:
                _evaluate(job, out, backend, state, tracker, step=step + 1)
            _save(state, state_path)
            tracker.log_checkpoint(state["checkpoint"], step + 1)
            _drop_unless_kept(previous, state, backend.delete_checkpoint)
    finally:
        source.close()

    best = peak(state["evals"])
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
    exported = backend.export_checkpoint(best["checkpoint"], str(out))  # out/adapter, for use without tbexp
    print(exported.describe())
    metrics = {
        "grpo/best_step": float(best["step"]),
        "grpo/best_reward": best["eval/reward"],
        "grpo/steps_run": float(state["step"]),
        "grpo/rl_tasks": float(len(tasks)),
        **{k: best[k] for k in EVAL_KEYS},
    }
    return RLResult(best["checkpoint"], metrics, {exported.kind: exported.path} if exported.path else {})


def peak(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """The eval point with the highest held-out reward: on a tie the earlier, less-trained one; an eval with no valid
    episode (NaN) is never the peak unless every one is.

    >>> peak([{"step": 0, "eval/reward": math.nan}, {"step": 4, "eval/reward": 0.5}, {"step": 8, "eval/reward": 0.5}])
    {'step': 4, 'eval/reward': 0.5}
    """
    return max(evals, key=lambda e: (not math.isnan(e["eval/reward"]), e["eval/reward"], -e["step"]))


class _RolloutSource:
    """Each step's rollouts: sampled then from the live weights, or (max_off_policy_steps > 0) taken from the
    pipeline, which then launches the next ones; the difficulty pool is updated from every step's rollouts."""

    def __init__(self, job: Job, backend: TrainingBackend, start: str, state: dict[str, Any], tasks: list[Task]):
        g = job.cfg.grpo
        self.job, self.backend, self.start, self.state = job, backend, start, state
        self.pool = DifficultyPool([t.name for t in tasks], g.retire_after, min_active=g.groups_per_step)
        self.pool.restore(state.get("pool", {}))
        self.by_name = {t.name: t for t in tasks}
        self.started_s = 0.0  # when the latest step began waiting for its rollouts
        self.pipeline = None
        if g.max_off_policy_steps:
            self.pipeline = RolloutPipeline(
                g.max_off_policy_steps, lambda plan, sampler, stop: _rollouts(job, plan, self.by_name, sampler, stop)
            )
            saved = [Plan.load(p) for p in state.get("plans", [])]
            self.pipeline.resume(saved, state["step"], lambda plan: job.models.sampler(plan.checkpoint))

    def plan(self, step: int) -> Plan:
        """Step `step`'s plan, from the active tasks and the live weights as they are now."""
        g, state = self.job.cfg.grpo, self.state
        checkpoint, seed, spares = state["checkpoint"] or self.start, self.job.cfg.seed, g.max_replaced_groups > 0
        return make_plan(step, self.pool.active(), g.groups_per_step, seed, state["step"], checkpoint, spares)

    def take(self, step: int) -> tuple[Rollouts, dict[str, float]]:
        """Step `step`'s rollouts and the control numbers (`_control_metrics`)."""
        g = self.job.cfg.grpo
        self.started_s = time.perf_counter()
        if self.pipeline is None:
            rollouts = _rollouts(self.job, self.plan(step), self.by_name, self.backend.sampler())
        else:
            self.pipeline.advance(step, step + 1, self.plan, self.backend.sampler)  # the first, or a re-queued one
            rollouts = self.pipeline.take(step)
        wait_s = time.perf_counter() - self.started_s
        retired = self.pool.update(step, _solved_by_task(rollouts.episodes))
        if retired:
            log.info("grpo: step %d retires %s (always or never solved)", step + 1, ", ".join(retired))
        metrics = _control_metrics(g, rollouts, self.pool, self.pipeline)
        if self.pipeline is not None:  # the next steps' rollouts start now, from the weights before this update
            self.pipeline.advance(step, g.steps, self.plan, self.backend.sampler)
            metrics["time/rollout_wait"] = wait_s  # the part of the rollouts the update did not hide
        return rollouts, metrics

    def remember(self, state: dict[str, Any]) -> None:
        """Into the checkpoint's state: the pool's counts and the plans in flight (what an exact resume needs)."""
        if self.job.cfg.grpo.retire_after:
            state["pool"] = self.pool.state()
        if self.pipeline is not None:
            state["plans"] = [plan.dump() for plan in self.pipeline.pending()]

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()  # rollouts still in flight are discarded; a resumed run samples them again


def _rollouts(
    job: Job, plan: Plan, by_name: dict[str, Task], sampler: Sampler, stop: threading.Event | None = None
) -> Rollouts:
    """A plan's groups, `group_size` episodes each at `grpo.temperature` from `sampler`, flat ones replaced."""
    cfg = job.cfg
    g = cfg.grpo
    clock = time.perf_counter()
    settings = OmegaConf.merge(cfg.sampling, {"temperature": g.temperature})
    runtime = job.models.runtime(sampler, settings, seed=stream(cfg.seed, "rollout", plan.step))

    rounds = itertools.count()  # replacement rounds of this plan

    def sample(names: list[str]) -> list[Episode]:  # a failed episode comes back invalid, never ending the step
        tasks = [by_name[name] for name in names]
        if g.harness == "harbor":  # Harbor's trials; terminus-2's rollout details are the tokens trained on
            from tbexp.episodes.harbor_trials import run_trials

            round_ = next(rounds)  # a replacement round's trials beside the step's first ones
            trials = job.run_dir / "trials" / (f"step-{plan.step:05d}" + (f"-round-{round_}" if round_ else ""))
            episodes = run_trials(cfg, tasks, g.group_size, g.concurrency, "model", runtime, trials, "rollouts")
        else:
            episodes = run_policy(job, tasks, g.group_size, g.concurrency, "model", runtime, desc="rollouts", stop=stop)
        return apply_tamper(episodes, g.tamper)  # before scoring: a tampered episode never teaches its gain

    episodes, replaced = sample_groups(
        plan, sample, lambda episodes: score_episodes(episodes, job.reward), g.max_replaced_groups
    )
    valid = [ep for ep in episodes if not ep.invalid]
    # the sampler's busy wall time (batches run one at a time); without a batch queue, each episode's waits summed
    sample_s = runtime.queue.busy_s if runtime.queue is not None else sum(_sampled(ep).sample_s for ep in valid)
    return Rollouts(plan, episodes, replaced, time.perf_counter() - clock, sample_s)


def _sampled(ep: Episode) -> SampledTokens:
    """A GRPO episode's sampled tokens (policy=model: every episode has them)."""
    assert ep.sampled is not None, f"{ep.task.name} run {ep.run}: a model episode without its sampled tokens"
    return ep.sampled


def _solved_by_task(episodes: list[Episode]) -> dict[str, list[bool]]:
    solved: dict[str, list[bool]] = {}
    for ep in episodes:
        solved.setdefault(ep.task.name, [])
        if not ep.invalid:
            solved[ep.task.name].append(bool(ep.report and ep.report.strict))  # a valid episode has its report
    return solved


def _control_metrics(
    g: GRPOConfig, rollouts: Rollouts, pool: DifficultyPool, pipeline: RolloutPipeline | None
) -> dict[str, float]:
    """The pipeline's and the difficulty control's numbers, each only when that part is on (the default logs none)."""
    metrics: dict[str, float] = {}
    if pipeline is not None:
        metrics["rollout/off_policy_steps"] = float(rollouts.plan.step - rollouts.plan.version)
        metrics["rollout/stale_requeued"] = float(pipeline.requeued)
    if g.max_replaced_groups:
        metrics["rollout/replaced_groups"] = float(rollouts.replaced)
    if g.retire_after:
        metrics["rollout/retired_tasks"] = float(pool.retired)
        metrics["rollout/active_tasks"] = float(len(pool.active()))
    if metrics:
        metrics["rollout/episodes"] = float(len(rollouts.episodes))
    return metrics


def _step(job: Job, backend: TrainingBackend, reference: Any, rollouts: Rollouts, step: int) -> dict[str, float]:
    """One step's update on its rollouts, and the step's numbers."""
    from tinker import types

    cfg = job.cfg
    g = cfg.grpo
    episodes, rollout_s = rollouts.episodes, rollouts.rollout_s

    rewards = score_episodes(episodes, job.reward)
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
            loss_fn_config(g),
        )
        opt = backend.optim_step(
            types.AdamParams(learning_rate=lr, weight_decay=g.weight_decay, grad_clip_norm=g.grad_clip_norm)
        )
        fb_result, opt_result = fb.result(), opt.result()
        train_metrics = {
            "train/loss": fb_result.loss,
            "optim/lr": lr,
            **{f"train/{k}": v for k, v in fb_result.metrics.items()},
            **{f"optim/{k}": v for k, v in opt_result.items()},
        }
    train_s = time.perf_counter() - clock

    rollout = {k.replace("eval/", "rollout/"): v for k, v in summarize(episodes, rewards).items()}
    valid = [ep for ep in episodes if not ep.invalid]
    timing = {
        "time/rollout": rollout_s,  # wall clock of the step's episodes, run concurrently
        "time/sample": rollouts.sample_s,
        # sandbox-seconds, summed over the episodes that ran concurrently: starts, commands and stops; then tests
        "time/env": sum(
            ep.time_s.get("start", 0) + ep.time_s.get("agent", 0) + ep.time_s.get("stop", 0) - _sampled(ep).sample_s
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
        "rollout/tamper_episodes": rollout["rollout/tamper_episodes"],
        **{f"rollout/{k}": float(v) for k, v in counts.items()},
        **train_metrics,
        **timing,
    }


def _evaluate(
    job: Job, out: Path, backend: TrainingBackend, state: dict[str, Any], tracker: Tracker, step: int
) -> None:
    from tbexp.stages.eval import evaluate

    cfg = job.cfg
    # Every eval point on the same draws, but not the final rows' (tbexp.seeds says why).
    runtime = job.models.runtime(backend.sampler(), cfg.sampling, seed=stream(cfg.seed, "grpo_eval"))
    folder = out / "evals" / f"step-{step:05d}"
    metrics = evaluate(
        job, folder, "model", runtime, label=f"grpo step {step}", quiet=True, n_runs=cfg.grpo.eval_n_runs
    )
    checkpoint = state["checkpoint"] or backend.save_state(f"step-{step:05d}")
    state["evals"].append({"step": step, "checkpoint": checkpoint, **{k: metrics[k] for k in EVAL_KEYS}})
    tracker.log({k.replace("eval/", "heldout/"): metrics[k] for k in EVAL_KEYS}, step=step)
    _report(cfg, state["evals"], step)


def _report(cfg: Config, evals: list[dict[str, Any]], step: int) -> None:
    """Tell the job's sweep trial, if any, where it stands; the sweep's pruner may stop the job here (TrialPruned).

    A sweep prunes on one of two signals (its pruner.metric): eval/reward, the held-out reward at this step,
    or grpo/best_reward, the peak so far, which is what the stage returns if it stops now. A sweep that
    scores the chosen checkpoint (the pipeline's) wants the peak: a trial whose RL spoils a good start still
    returns that start, and judged on its latest reward it would be stopped and its good result thrown away.
    """
    trial.report(cfg, "eval/reward", evals[-1]["eval/reward"], step)
    trial.report(cfg, "grpo/best_reward", peak(evals)["eval/reward"], step)


def _drop_unless_kept(checkpoint: str, state: dict[str, Any], delete: Callable[[str], None]) -> None:
    """Delete a superseded per-step checkpoint unless an eval keeps it (`delete`: the backend's, so a Tinker service
    stops storing it too). With pipelined rollouts, one that a planned step still samples from waits in
    state["held"] until no plan needs it."""
    planned = {plan["checkpoint"] for plan in state.get("plans", [])}
    held = []
    for path in [checkpoint, *state.get("held", [])]:
        if not path or path == state["checkpoint"]:
            continue
        if any(e["checkpoint"] == path for e in state["evals"]):
            continue
        if path in planned:
            held.append(path)
            continue
        delete(path)
    if "plans" in state:
        state["held"] = held


def _save(state: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def _curve_table(evals: list[dict[str, Any]], best_step: int) -> str:
    lines = [f"{'step':>5} {'reward':>7} {'strict':>7} {'valid':>6} {'turns':>6}"]
    for e in evals:
        mark = "  <- peak" if e["step"] == best_step else ""
        lines.append(
            f"{e['step']:>5} {e['eval/reward']:7.3f} {e['eval/strict_success']:7.3f} {e['eval/valid_command_rate']:6.3f} {e['eval/avg_turns']:6.2f}{mark}"
        )
    return "\n".join(lines)
