#!/usr/bin/env python
"""scripts/bench_sweep.py: what the sweeper costs, and what TPE with pruning saves over random search.

    .venv/bin/python scripts/bench_sweep.py                                     # both parts, synthetic objective
    .venv/bin/python scripts/bench_sweep.py --only overhead
    .venv/bin/python scripts/bench_sweep.py --only efficiency --objective smoke --seeds 3
    .venv/bin/python scripts/bench_sweep.py --only efficiency --objective pipeline --seeds 3   # the real one: hours
    .venv/bin/python scripts/bench_sweep.py --only efficiency --objective pipeline --seeds 3 --no-run   # its figures so far

Overhead. The wall and CPU time of `python -m tbexp --cfg job` (target < 1 s),
and of a sweep of the sweeper tests' free app (`tests/sweep_app`: each job
appends a line to a file and reports one value to its trial, no work at all)
through `hydra/sweeper=tbexp_optuna`, one trial at a time so the wall time is
the sum of the trials' costs. A job's own work is well under a millisecond, so
nearly all of the sweep's time is the sweeper's: a child process per trial
(spawned, it imports Hydra and the app), composing the job's config, the
storage calls, the job's report. Per trial: all-in (the 16-trial sweep's time
/ 16, the sweeper's own start-up spread over the trials) and marginal (16
trials minus 1 trial, / 15). Target < 0.5 s per trial.

Efficiency. The same sweep file run twice per seed, with the same budget and
seeds: as written (TPE + its pruner) and as random search without pruning
(`sampler.name=random pruner.name=none`). Compute is counted in trial-steps:
the steps each trial ran before it finished or was pruned (the step its
pruning metric was last reported at: GRPO steps for `grpo_optuna`, SFT steps
for `smoke`), summed in the order trials finished. The table gives, per seed,
the trial-steps each mode spent until a finished trial first matched the best
objective value random search found, and their ratio (target <= 0.5). Trials
still running at that moment are not counted (at most n_jobs - 1 partial
trials, in both modes alike). With the same seed, TPE's first
`n_startup_trials` draws are random search's first draws (Optuna's TPE starts
with a RandomSampler of its seed), so the arms differ only after those and by
pruning; a seed whose random best comes early scores a ratio near 1.

`--objective` picks what the trials run:
* `pipeline`: the real objective, `python -m tbexp -m +experiment=pipeline
  +sweep=grpo_optuna` (32 full pipeline jobs per study, 2 at a time; 2 studies
  a seed). On this 2-core machine that is about 2-3 hours a seed; re-running
  the command continues the studies in `--out`, and a tpe+pruning study that
  has already matched random's best is not continued (`--full-budget` runs it
  to its budget; only its total changes).
* `smoke`: `+sweep=smoke` (6 trials of 20 tiny-model SFT steps, ~2.5 min a
  study here). Its reward barely moves, so it checks the plumbing, not the search.
* `synthetic` (the default, seconds): no tbexp job at all. Optuna is driven in
  process with the sampler, pruner, search space, budget and parallelism that
  the sweeper builds from `sweeps/grpo_optuna.yaml` (tbexp's own code for
  them), and each trial is a made-up held-out reward curve over GRPO steps
  (`_synthetic_run`), evaluated on the default pipeline's schedule. It shows
  the sampler + pruner mechanics on a curve of a plausible shape; it says
  nothing about how tbexp learns, and its constants were set once, not tuned
  to the target.

Not a test: the numbers are the output. Load average is printed with them,
since other work on the machine moves every figure.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# objective -> (sweep file, extra overrides of the jobs); synthetic reads grpo_optuna's settings only
OBJECTIVES = {
    "pipeline": ("grpo_optuna", ["+experiment=pipeline"]),
    "smoke": ("smoke", []),
    "synthetic": ("grpo_optuna", []),
}
# The two arms: the sweep file as written, and random search without pruning (hydra.sweeper.* changes).
MODES = {"random": {"sampler": {"name": "random"}, "pruner": {"name": "none"}}, "tpe+pruning": {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["overhead", "efficiency"], help="run one part (default both)")
    parser.add_argument("--objective", choices=list(OBJECTIVES), default="synthetic")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1, added to the sweep file's sampler seed")
    parser.add_argument("--repeats", type=int, default=3, help="runs of `python -m tbexp --cfg job`")
    parser.add_argument("--trials", type=int, default=16, help="trials of the do-nothing sweep")
    parser.add_argument(
        "--out",
        default="multirun/bench_sweep",
        help="smoke/pipeline: sweep directories and study storage (relative to the repository)",
    )
    parser.add_argument(
        "--full-budget",
        action="store_true",
        help="smoke/pipeline: continue a tpe+pruning study to its budget even when it has already matched random search's best (by default it is left there: its ratio is fixed)",
    )
    parser.add_argument(
        "--no-run",
        action="store_true",
        help="smoke/pipeline: score the studies as they stand in --out, launching nothing (an arm still short of its budget is marked partial)",
    )
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {_load()} at start")
    if args.only != "efficiency":
        _overhead(args.repeats, args.trials)
    if args.only != "overhead":
        _efficiency(args.objective, args.seeds, REPO / args.out, args.no_run, args.full_budget)
    print(f"load average {_load()} at the end")


# --- overhead -------------------------------------------------------------------------------------


def _overhead(repeats: int, n_trials: int) -> None:
    runs = [_timed([sys.executable, "-m", "tbexp", "--cfg", "job"]) for _ in range(repeats)]
    wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    print(
        f"\n`python -m tbexp --cfg job`, median of {repeats}: {wall:.2f} s wall, {cpu:.2f} s CPU (target < 1 s); load {_load()}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        one, many = _noop_sweep(Path(tmp), 1), _noop_sweep(Path(tmp), n_trials)
    print(
        f"do-nothing sweep (tests/sweep_app, 1 trial at a time): 1 trial {one[0]:.1f} s wall / {one[1]:.1f} s CPU, {n_trials} trials {many[0]:.1f} s wall / {many[1]:.1f} s CPU; load {_load()}"
    )
    print(
        f"  per trial, all-in ({n_trials} trials / {n_trials}):  {many[0] / n_trials:.2f} s wall, {many[1] / n_trials:.2f} s CPU (target < 0.5 s)"
    )
    print(
        f"  per trial, marginal (({n_trials} - 1) / {n_trials - 1}): {(many[0] - one[0]) / (n_trials - 1):.2f} s wall, {(many[1] - one[1]) / (n_trials - 1):.2f} s CPU"
    )


def _noop_sweep(tmp: Path, n_trials: int) -> tuple[float, float]:
    sweep_dir = tmp / f"noop-{n_trials}"
    overrides = [
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.sweeper.storage=sqlite:///{tmp}/optuna.db",
        f"hydra.sweeper.study_name=noop-{n_trials}",
        f"hydra.sweeper.n_trials={n_trials}",
        "hydra.sweeper.n_jobs=1",
        "steps=1",
    ]
    timing = _timed([sys.executable, "-m", "tests.sweep_app.app", "-m", *overrides])
    from omegaconf import OmegaConf

    counts = OmegaConf.load(sweep_dir / "optimization_results.yaml").trials
    if counts.get("COMPLETE") != n_trials:
        raise SystemExit(f"the do-nothing sweep did not complete all {n_trials} trials: {dict(counts)}")
    return timing


def _timed(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of a command, its children (the sweep's jobs) included."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# --- efficiency -----------------------------------------------------------------------------------


def _efficiency(objective: str, n_seeds: int, out: Path, no_run: bool = False, full_budget: bool = False) -> None:
    from omegaconf import OmegaConf

    sweep, _ = OBJECTIVES[objective]
    settings = _sweep_settings(sweep)
    pruner = (
        "none"
        if settings.pruner.name == "none"
        else f"{settings.pruner.name} pruner on {settings.pruner.metric or settings.objective.metric}"
    )
    print(
        f"\nefficiency, objective={objective}: sweeps/{sweep}.yaml, {settings.n_trials} trials a study, {settings.n_jobs} at a time; {settings.sampler.name} + {pruner} against random without pruning; seeds {settings.sampler.seed}..{settings.sampler.seed + n_seeds - 1}"
    )
    if objective == "synthetic":
        steps, eval_every = _pipeline_schedule()
        print(
            f"SYNTHETIC objective: made-up reward curves ({steps} GRPO steps, held-out eval at step 0 and every {eval_every}); shows the sampler and pruner mechanics, not tbexp's learning"
        )
    print(
        f"{'seed':>4} {'random best':>11} {'random steps to it':>18} {'tpe+pruning best':>16} {'tpe+pruning steps to it':>23} {'ratio':>6} {'total steps r / t':>17}"
    )
    ratios = []
    for seed in range(n_seeds):
        studies = {}
        for mode in MODES:
            if objective == "synthetic":
                studies[mode] = _synthetic_study(OmegaConf.merge(settings, MODES[mode]), seed, steps, eval_every)
            else:
                done = (
                    mode != "random"
                    and not full_budget
                    and _matched(_real_study(objective, mode, seed, out, launch=False), studies["random"])
                )
                studies[mode] = _real_study(objective, mode, seed, out, launch=not (no_run or done))
        waiting = [f"{mode} not begun" for mode, study in studies.items() if study is None]
        if studies["random"] is not None and not _complete(studies["random"]):
            waiting.append("random has no complete trial yet")
        if waiting:  # only with --no-run
            print(f"{seed:>4} ({'; '.join(waiting)})")
            continue
        target = studies["random"].best_value
        maximize = studies["random"].direction.name == "MAXIMIZE"
        finished = {mode: _finished(study) for mode, study in studies.items()}
        reach = {mode: _steps_to_reach(trials, target, maximize) for mode, trials in finished.items()}
        total = {mode: sum(steps for steps, _ in trials) for mode, trials in finished.items()}
        ratio = reach["tpe+pruning"] / reach["random"] if reach["tpe+pruning"] is not None else None
        ratios.append(ratio)
        tpe_reach = str(reach["tpe+pruning"]) if ratio is not None else f"not reached (>{total['tpe+pruning']})"
        shown = "-" if ratio is None else f"{ratio:.2f}"
        tpe_best = f"{studies['tpe+pruning'].best_value:.4f}" if _complete(studies["tpe+pruning"]) else "-"
        partial = [
            mode for mode, trials in finished.items() if len(trials) < settings.n_trials
        ]  # as the sweeper counts: interrupted trials left out
        note = f"  PARTIAL: {', '.join(partial)} short of {settings.n_trials} trials" if partial else ""
        print(
            f"{seed:>4} {target:>11.4f} {reach['random']:>18} {tpe_best:>16} {tpe_reach:>23} {shown:>6} {total['random']:>8} / {total['tpe+pruning']:<6}{note}"
        )
    reached = [r for r in ratios if r is not None]
    median = f", median ratio {statistics.median(reached):.2f} over those" if reached else ""
    unscored = (
        f" ({n_seeds - len(ratios)} not scored yet, see above)" if len(ratios) < n_seeds else ""
    )  # only with --no-run
    print(
        f"tpe+pruning reached random's best in {len(reached)} of {len(ratios)} seeds{unscored}{median}; ratio <= 0.5 (the target) in {sum(r <= 0.5 for r in reached)} of {len(ratios)}; load {_load()}"
    )


def _sweep_settings(sweep: str) -> Any:
    """hydra.sweeper of a sweep file, checked against the sweeper's schema as Hydra does."""
    from omegaconf import OmegaConf

    from hydra_plugins.tbexp_optuna_sweeper.config import TbexpOptunaSweeperConf

    return OmegaConf.merge(
        OmegaConf.structured(TbexpOptunaSweeperConf), OmegaConf.load(REPO / "sweeps" / f"{sweep}.yaml").hydra.sweeper
    )


def _finished(study: Any) -> list[tuple[int, float | None]]:
    """(trial-steps, value or None when not COMPLETE) of every finished trial, in the order they finished.

    A trial interrupted because its sweeper was killed is left out: its retry
    (same parameters, same seed) runs it again and is counted instead, so
    stopping and continuing a benchmark does not change its figures.
    """
    from optuna.trial import TrialState

    from tbexp.study.storage import INTERRUPTED_ATTR, PRUNED_AT_ATTR

    trials = sorted(
        (
            t
            for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and not t.user_attrs.get(INTERRUPTED_ATTR)
        ),
        key=lambda t: t.datetime_complete,
    )
    return [
        (int(t.user_attrs.get(PRUNED_AT_ATTR, t.last_step or 0)), t.value if t.state == TrialState.COMPLETE else None)
        for t in trials
    ]


def _steps_to_reach(finished: list[tuple[int, float | None]], target: float, maximize: bool) -> int | None:
    """Trial-steps spent until a complete trial's value first matched `target`; None if none did."""
    spent = 0
    for steps, value in finished:
        spent += steps
        if value is not None and (value >= target if maximize else value <= target):
            return spent
    return None


def _matched(study: Any, random_study: Any) -> bool:
    """Whether a finished trial of `study` already matches random search's best (its ratio can no longer change)."""
    if study is None or random_study is None or not _complete(random_study):
        return False
    return (
        _steps_to_reach(_finished(study), random_study.best_value, random_study.direction.name == "MAXIMIZE")
        is not None
    )


def _complete(study: Any) -> bool:
    """Whether the study has a COMPLETE trial, and so a best value."""
    return any(value is not None for _, value in _finished(study))


def _real_study(objective: str, mode: str, seed: int, out: Path, launch: bool = True) -> Any:
    """Run (or continue) one study through `python -m tbexp -m` and load it; with launch=False only load it (None if not begun)."""
    from tbexp.study.storage import load_study

    sweep, extra = OBJECTIVES[objective]
    name = f"bench-{objective}-{mode}-{seed}"
    storage = f"sqlite:///{out}/optuna.db"
    changes = [
        f"hydra.sweeper.{group}.{key}={value}" for group, fields in MODES[mode].items() for key, value in fields.items()
    ]
    seed_override = f"hydra.sweeper.sampler.seed={_sweep_settings(sweep).sampler.seed + seed}"
    cmd = [
        sys.executable,
        "-m",
        "tbexp",
        "-m",
        *extra,
        f"+sweep={sweep}",
        f"hydra.sweeper.study_name={name}",
        f"hydra.sweeper.storage={storage}",
        f"hydra.sweep.dir={out}/{name}",
        seed_override,
        f"seed={seed}",
        *changes,
    ]
    if launch:
        out.mkdir(parents=True, exist_ok=True)
        print(f"  {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    elif not (out / "optuna.db").exists():
        raise SystemExit(f"--no-run: no study storage at {out}/optuna.db; run without --no-run first")
    try:
        return load_study(storage, name)
    except KeyError:  # --no-run before this arm's sweep began
        return None


def _pipeline_schedule() -> tuple[int, int]:
    """GRPO steps and eval interval of the default job (conf/config.yaml), which the pipeline objective runs."""
    from omegaconf import OmegaConf

    grpo = OmegaConf.load(REPO / "conf" / "config.yaml").grpo
    return int(grpo.steps), int(grpo.eval_every)


def _synthetic_study(settings: Any, seed: int, steps: int, eval_every: int) -> Any:
    """One study as the sweeper would run it (its sampler, pruner, space, budget, n_jobs), on synthetic curves.

    Trials advance one step at a time in lockstep, `n_jobs` at once, and the
    next starts as soon as one ends; at each eval step a trial reports what
    GRPO reports under the pruner's metric (its held-out value, or for
    grpo/best_reward the peak so far) and is pruned the way
    `tbexp.study.trial.report` prunes a job.
    """
    import optuna
    from omegaconf import OmegaConf

    from hydra_plugins.tbexp_optuna_sweeper._space import SearchSpace
    from hydra_plugins.tbexp_optuna_sweeper._study_open import _sampler
    from tbexp.study.storage import PRUNED_AT_ATTR, make_pruner

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = _sampler(settings.sampler, settings.sampler.seed + seed)
    study = optuna.create_study(
        direction=settings.objective.direction,
        sampler=sampler,
        pruner=make_pruner(OmegaConf.to_container(settings.pruner)),
    )
    space = SearchSpace(settings.params)
    peak_metric = (
        settings.pruner.metric or settings.objective.metric
    ) == "grpo/best_reward"  # GRPO's peak so far, else its latest eval
    running: list[dict] = []
    started = 0
    while started < settings.n_trials or running:
        while len(running) < settings.n_jobs and started < settings.n_trials:
            trial = study.ask()
            evals, final = _synthetic_run(
                space.suggest(trial), random.Random(f"{seed}:{trial.number}"), steps, eval_every
            )
            running.append({"trial": trial, "evals": evals, "final": final, "step": 0, "peak": -math.inf})
            started += 1
        for run in list(running):
            trial, step = run["trial"], run["step"]
            if step in run["evals"]:
                run["peak"] = max(run["peak"], run["evals"][step])
                trial.report(run["peak"] if peak_metric else run["evals"][step], step)
                if trial.should_prune():
                    trial.set_user_attr(PRUNED_AT_ATTR, step)
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    running.remove(run)
                    continue
            if step == steps:
                study.tell(trial, run["final"])
                running.remove(run)
            run["step"] = step + 1
    return study


EVAL_SD = 0.03  # held-out mean reward over ~48 tasks x 2 runs, per-episode sd ~0.3
FINAL_SD = 0.025  # the final eval: 3 runs each


def _synthetic_run(
    values: dict[str, Any], rng: random.Random, steps: int, eval_every: int
) -> tuple[dict[int, float], float]:
    """Noisy held-out rewards at the eval steps, and the final eval of the peak checkpoint, for one trial.

    A made-up model of GRPO after SFT: reward rises from the SFT checkpoint's
    0.10 towards a ceiling, exponentially in the step. The best learning rate
    grows with LoRA rank (sqrt(rank / 32) x 1e-3: the adapter is scaled by
    alpha / rank); the ceiling falls off log-normally away from it, and with a
    small rank (capacity), a small group (noisier advantages), and a filter
    window [lower, upper] that lets in tasks outside the 0.1-0.8 solve rates
    that give a learning signal or keeps too few tasks. The rate of rise grows
    with the learning rate, and more than twice the best one drifts the reward
    down as training goes on.
    """
    lr, rank, group = values["grpo.learning_rate"], values["model.lora_rank"], values["grpo.group_size"]
    lower, upper = values["task_filter.lower"], values["task_filter.upper"]
    best_lr = 1e-3 * math.sqrt(rank / 32)
    q_lr = math.exp(-(math.log10(lr / best_lr) ** 2) / (2 * 0.4**2))
    q_rank = 1 - 0.075 * max(0.0, math.log2(32 / rank))
    q_group = 1 - 0.6 / group
    useful = max(0.0, min(upper, 0.8) - max(lower, 0.1)) / (upper - lower)
    q_filter = useful * min(1.0, (upper - lower) / 0.3)
    ceiling = 0.10 + 0.25 * q_lr * q_rank * q_group * q_filter
    rate = min(1.0, max(0.02, 0.25 * (lr / best_lr) ** 0.7))
    drift = 0.004 * max(0.0, math.log2(lr / (2 * best_lr)))

    def reward(t: int) -> float:
        return 0.10 + (ceiling - 0.10) * (1 - math.exp(-rate * t)) - drift * t

    evals = {t: reward(t) + rng.gauss(0, EVAL_SD) for t in sorted({*range(0, steps, eval_every), steps})}
    peak = max(evals, key=evals.get)  # the checkpoint the pipeline keeps
    return evals, reward(peak) + rng.gauss(0, FINAL_SD)


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
